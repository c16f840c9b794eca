"""Every bad mesh string a user may type gets one line that names the problem and the fix, from
the command they type (pytest collecting ``model_cells``), never a traceback."""
import pytest

from tests.project import UserProject

BAD = [
    ("dp=2;tp=2", "mesh 'dp=2;tp=2': separate its dims with commas, e.g. 'dp=2,tp=2'"),
    ("dp=2 tp=2", "mesh 'dp=2 tp=2': separate its dims with commas, e.g. 'dp=2,tp=2'"),
    ("dp2", "mesh 'dp2': 'dp2' is not <dim>=<degree>, e.g. 'dp=2'"),
    ("dp=two", "mesh 'dp=two': 'dp=two' is not <dim>=<degree>"),
    ("dp_shard=2", "torchtitan's 'dp_shard' is 'dp' here"),
    ("dp_replicate=2,dp=2", "torchtitan's 'dp_replicate' is 'rep' here"),
    ("dq=2", "mesh dim 'dq' is not a model mesh dim: name them pp, rep, dp, cp, tp (harness.names), e.g. "
             "dp=2,tp=2; did you mean 'dp'?"),
    ("dp=0", "mesh dim dp=0 must be at least 1"),
    ("dp=2,dp=2", "mesh dim names must be unique, got ['dp', 'dp']: give 'dp' once"),
]
TEST = '''import pytest

from harness.model import model_cells, register_model

register_model("llama", "harness.examples.llama_hf:CASE")


@pytest.mark.parametrize("cfg", model_cells("llama", impls=["fsdp"], meshes=[{mesh!r}]), ids=str)
def test_cell(cfg, parity):
    parity(cfg)
'''


@pytest.mark.parametrize("mesh, line", BAD, ids=[m for m, _ in BAD])
def test_a_bad_mesh_string_is_one_line_with_the_fix(tmp_path, mesh, line):
    project = UserProject(tmp_path / "project", {"test_cells.py": TEST.format(mesh=mesh)}, ini=False)
    done = project.pytest(timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and line in out, done.tail
    assert "INTERNALERROR" not in out and "invalid literal" not in out, done.tail
    assert "harness/" not in out.replace("(harness.names)", ""), done.tail  # the user's line, not our frames
