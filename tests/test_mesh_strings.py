"""Every bad mesh string a user may type gets one line that names the problem and the fix, from
the command they type (pytest collecting ``model_cells``), never a traceback.

The strings share one project, a test file each, and one pytest run (``--continue-on-collection-errors``:
a string refused at collection does not stop the one refused when its cell runs); each test reads its
own file's report from the run's junit XML."""
import xml.etree.ElementTree as ET

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


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The project with ``test_mesh_<i>.py`` for ``BAD[i]``, run once; its output and each file's
    reports (what pytest prints for its collection error or its failed cell)."""
    files = {f"test_mesh_{i}.py": TEST.format(mesh=mesh) for i, (mesh, _) in enumerate(BAD)}
    project = UserProject(tmp_path_factory.mktemp("mesh-strings") / "project", files, ini=False)
    done = project.pytest("--continue-on-collection-errors", timeout=300)
    reports: dict[str, str] = {}
    for case in ET.parse(done.junit).iter("testcase"):
        # a collection error is the testcase named after its module; a failed cell is classed by it
        module = case.get("classname") or case.get("name")
        for outcome in (e for e in case if e.tag in ("failure", "error")):
            reports[module] = reports.get(module, "") + f"{outcome.get('message')}\n{outcome.text}\n"
    return done, reports


@pytest.mark.parametrize("index", range(len(BAD)), ids=[m for m, _ in BAD])
def test_a_bad_mesh_string_is_one_line_with_the_fix(run, index):
    done, reports = run
    out, line = done.stdout + done.stderr, BAD[index][1]
    report = reports.get(f"test_mesh_{index}", "")
    assert done.returncode != 0 and line in report, (report, done.tail)
    assert "INTERNALERROR" not in out and "invalid literal" not in out, done.tail
    assert "harness/" not in out.replace("(harness.names)", ""), done.tail  # the user's line, not our frames
