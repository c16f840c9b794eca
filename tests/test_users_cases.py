"""The shipped users' cases, and planted bugs in users' parallelize functions (tests/model_bugs_users.py),
run from a project of their own: its files written into tmp_path, ``python -m pytest`` in a subprocess
from there (the harness the one on PYTHONPATH, as in tests/test_world.py).

* ``harness/examples/pretrained_hf.py`` copied as the project's own ``mypretrained.py``: rank 0
  ``save_pretrained`` to ``cell_dir()``, a barrier, ``from_pretrained(distributed_config=...)`` on every rank,
  no path broadcast anywhere: green;
* the shipped ``qwen3moegmm`` (``harness/examples/qwen3moe_grouped_hf.py``: default grouped_mm experts under
  the EP plan, the reference running ``_grouped_mm`` in fp32), by its built-in name: green;
* a ``tp_plan`` whose down_proj rowwise style leaves the partial sum: red, naming
  ``model.layers.0.mlp.down_proj`` as returning partial sums over tp;
* the same model under its shipped plan with its loss divided by the world size: red, saying it starts
  in the loss (x 1/2 = 1/tp) and listing the gradients in the order backward computed them (the mlp
  before the norm that runs before it, though the decoder layer registers the mlp first);
* accelerate's ``ParallelismConfig`` with dp_shard built from the whole world: red, naming the mesh
  larger than the world and where accelerate built it;
* the same grouped_mm MoE case without ``fp32_ops``: red, one line naming the op with no fp64 kernel,
  the module it ran in and the fix, no traceback;
* the from_pretrained case with a model class that saves a sharded model's shards swapped: red by the
  round trip before any step, naming the parameter and which rows landed where.

The seven cells run in one pytest session (one pool): each test below reads its own cell's part.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from tests.conftest import flat, line_of
from tests.project import Run, UserProject

ROOT = Path(__file__).resolve().parent.parent
PRETRAINED = ROOT / "harness" / "examples" / "pretrained_hf.py"

CONFTEST = textwrap.dedent('''\
    from harness.model import register_model

    register_model("mypretrained", "mypretrained:CASE")
    register_model("partialtp", "tests.model_bugs_users:PARTIAL")
    register_model("worldshard", "tests.model_bugs_users:ACCEL")
    register_model("lossworld", "tests.model_bugs_users:LOSSWORLD")
    register_model("nofp64", "tests.model_bugs_users:NOFP64")
    register_model("savedswapped", "tests.model_bugs_users:SAVEDSWAPPED")
    register_model("converterswapped", "tests.model_bugs_users:CONVERTERSWAPPED")
    ''')
TEST = textwrap.dedent('''\
    import pytest

    from harness.model import model_cells

    CELLS = (model_cells("mypretrained", meshes=["tp=2"])
             + model_cells("qwen3moegmm", meshes=["dp=2"], switches={"ep": ["2"]})  # the shipped one, by name
             + model_cells("partialtp", meshes=["tp=2"])
             + model_cells("worldshard", meshes=["dp=2,tp=2"])
             + model_cells("lossworld", meshes=["tp=2"])
             + model_cells("nofp64", meshes=["dp=2"], switches={"ep": ["2"]})
             + model_cells("savedswapped", meshes=["tp=2"])
             + model_cells("converterswapped", meshes=["tp=2"]))


    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_users(cfg, parity):
        parity(cfg)
    ''')
IDS = {"pretrained": "mypretrained-auto-tp2-fp32-plain-steps3-seed0",
       "moe": "qwen3moegmm-ep-dp2-fp32-ep_2-steps3-seed0",
       "partial": "partialtp-partial-tp2-fp32-plain-steps3-seed0",
       "worldshard": "worldshard-worldshard-dp2.tp2-fp32-plain-steps3-seed0",
       "lossworld": "lossworld-auto-tp2-fp32-plain-steps3-seed0",
       "nofp64": "nofp64-ep-dp2-fp32-ep_2-steps3-seed0",
       "savedswapped": "savedswapped-auto-tp2-fp32-plain-steps3-seed0",
       "converterswapped": "converterswapped-auto-tp2-fp32-plain-steps3-seed0"}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    project = UserProject(tmp_path_factory.mktemp("users") / "project",
                          {"mypretrained.py": PRETRAINED.read_text(), "conftest.py": CONFTEST, "test_users.py": TEST})
    return project.pytest("-p", "no:randomly", "--pool-size", "4", "--case-deadline", "120", "-rA")


def failure(run, key: str) -> str:
    """The failure report of cell ``key``: from its header to the next one."""
    parts = re.split(r"^_{3,} test_users\[", run.stdout, flags=re.MULTILINE)
    found = [p for p in parts if p.startswith(IDS[key])]
    assert found, f"no failure report for {IDS[key]}:\n{run.stdout[-6000:]}"
    return found[0]


def outcome(run, key: str) -> str:
    match = re.search(rf"^(PASSED|FAILED|XFAIL|XPASS|SKIPPED|ERROR) \S*test_users\[{re.escape(IDS[key])}\]",
                      run.stdout, re.MULTILINE)
    assert match, f"{IDS[key]} not in the summary:\n{run.tail}"
    return match.group(1)


def test_the_shipped_from_pretrained_case_passes_from_an_outside_project_without_broadcasting_a_path(run):
    source = PRETRAINED.read_text()
    assert "save_pretrained(path)" in source and "from_pretrained(path" in source and "cell_dir()" in source
    assert "broadcast" not in source.split('"""', 2)[2]  # the code, not its docstring
    assert outcome(run, "pretrained") == "PASSED", run.stdout[-6000:]


def test_the_grouped_mm_moe_case_runs(run):
    assert outcome(run, "moe") in ("PASSED", "XFAIL"), run.stdout[-6000:]


def test_a_tp_plan_leaving_a_rowwise_partial_sum_is_red_and_names_down_proj(run):
    assert outcome(run, "partial") == "FAILED"
    text = failure(run, "partial")
    assert ("first diverging module: model.layers.0.mlp.down_proj (output, step 1, microbatch 0): its inputs still "
            "match the reference, it returns per-rank partial sums over tp: summed they match the reference; "
            "model.layers.0.mlp uses them unreduced") in flat(text), text[-6000:]


def test_a_loss_over_the_world_says_it_starts_in_the_loss_and_lists_gradients_in_backward_order(run):
    assert outcome(run, "lossworld") == "FAILED"
    text = failure(run, "lossworld")
    assert ("first diverging module: none, it starts in the loss (step 1): every judged forward output matches, "
            "the gradient the loss hands back to lm_head does not (the reference x 1/2 = 1/tp)") in flat(text), text[-6000:]
    line = line_of(text, "first diverging parameter gradients")
    names = re.findall(r"(?:: |; )([\w.]+) \(module", line)
    assert names == ["lm_head.weight", "model.norm.weight", "model.layers.1.mlp.down_proj.weight"], line


def test_accelerate_with_dp_shard_built_from_the_whole_world_is_red_and_names_the_mesh(run):
    assert outcome(run, "worldshard") == "FAILED"
    text = failure(run, "worldshard")
    assert ("raised: the cell's code built a device mesh (at parallelism_config.py:" in flat(text)
            and "in build_device_mesh) larger than its world of 4 ranks" in flat(text)), text[-6000:]


def test_a_kernel_with_no_fp64_is_one_line_naming_the_op_the_module_and_the_fix(run):
    assert outcome(run, "nofp64") == "FAILED"
    text = failure(run, "nofp64")
    assert re.search(r"raised: the fp64 reference failed in module model\.layers\.\d+\.mlp\.experts: aten\._grouped_mm "
                     r"has no float64 kernel here \(.*\); run it from its fp32 kernel in the reference: "
                     r"ModelCase\(fp32_ops=\('_grouped_mm',\)\)", text), text[-6000:]
    assert "Traceback" not in text.split("reproduce:")[0], text[-6000:]


def test_a_model_that_loads_right_and_saves_its_shards_swapped_is_red_by_the_round_trip(run):
    assert outcome(run, "savedswapped") == "FAILED"
    text = flat(failure(run, "savedswapped"))
    assert ("LoadMismatch: the round trip: save_pretrained of the model from_pretrained loaded, loaded again on one "
            "process, holds 1 parameter(s) other than the ones first saved: model.layers.0.self_attn.q_proj.weight: "
            "rows 0-7 hold saved rows 8-15, rows 8-15 hold saved rows 0-7") in text, text[-4000:]


def test_a_family_whose_converter_swaps_a_fused_tensors_rows_is_red_by_the_load_check_before_any_step(run):
    assert outcome(run, "converterswapped") == "FAILED"
    text = flat(failure(run, "converterswapped"))
    assert ("LoadMismatch: from_pretrained loaded 4 parameter(s) other than save_pretrained was given (each gathered "
            "with full_tensor()): model.layers.0.mlp.gate_proj.weight: rows 0-31 hold model.layers.0.mlp.up_proj.weight's "
            "rows 0-31; model.layers.0.mlp.up_proj.weight: rows 0-31 hold model.layers.0.mlp.gate_proj.weight's "
            "rows 0-31; model.layers.1.mlp.gate_proj.weight") in text, text[-4000:]
    # the load check, before the first step: no table (its own report, not the summary's lines after it)
    assert "diverges from the reference" not in text.split("reproduce:")[0], text[-4000:]
