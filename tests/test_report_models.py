"""harness.report on a real run of whole-model cells, one of them with a planted bug: the loss plot
holds the reference and every mesh, and the failing cell's module × step heatmap puts its first red
square on the module the bug is in."""
import json

import pytest

from harness.report.models import first_diverging, loss_gaps, module_grid
from tests.project import UserProject

MODEL = '''
from torch.distributed.fsdp import fully_shard

from harness.model import ModelCase
from tests.model_handtp import MLP, batch, loss  # a 2-layer MLP: fc1, act, fc2


def fsdp(model, meshes):
    return fully_shard(model, mesh=meshes.mesh("fsdp"))


def fsdp_scaled_fc2(model, meshes):
    """The planted bug: fc2's output scaled on every rank (a stray scale in a user's hook)."""
    model.fc2.register_forward_hook(lambda module, args, out: out * 1.01)
    return fsdp(model, meshes)


CASE = ModelCase(build=MLP, batch=batch, loss=loss, parallelize={"good": fsdp, "bad": fsdp_scaled_fc2})
'''

CASES = '''
import pytest
from harness.model import model_cells

CELLS = model_cells("mlp", meshes=["dp=2", "dp=4"])


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_mlp(cfg, parity):
    parity(cfg)
'''

CONFTEST = '''
from harness.model import register_model

register_model("mlp", "mymodel:CASE")
'''


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    """The project's run, and the reports ``harness.report`` made of its junit XML."""
    project = UserProject(tmp_path_factory.mktemp("models") / "project",
                          {"mymodel.py": MODEL, "test_cells.py": CASES, "conftest.py": CONFTEST})
    done = project.pytest("--pool-size", "4", "--case-deadline", "120")
    assert done.returncode == 1, done.tail
    out = project.harness("report", "--junit", str(done.junit), "--out", str(project.path / "reports"))
    assert out.returncode == 0, out.stderr
    return done, project.path / "reports"


def test_model_records_carry_every_steps_losses_and_the_failing_cells_module_errors(reported):
    records = {cell: c.record for cell, c in reported[0].cells.items()}
    assert {r["status"] for cell, r in records.items() if "-bad-" in cell} == {"failed"}
    assert {r["status"] for cell, r in records.items() if "-good-" in cell} == {"passed"}
    for cell, r in records.items():
        losses = r["model"]["losses"]
        assert len(losses["reference"]) == len(losses["run"]) == 3, cell
        assert ("modules" in r["model"]) == ("-bad-" in cell), cell  # only failing cells pay for the re-run
    bad = next(r for cell, r in records.items() if "-bad-" in cell)
    modules, columns, values = module_grid(bad)
    assert modules == ["fc1", "act", "fc2"]
    i, j = first_diverging(bad, modules, columns, values)  # the square outlined: the module pytest named
    assert (modules[i], columns[j]) == ("fc2", (1, "fwd")), json.dumps(bad["model"])
    assert bad["where"].startswith("first diverging module: fc2 (output, step 1"), bad["where"]
    assert values[modules.index("fc1"), columns.index((1, "fwd"))] < 1  # upstream of the bug: green
    # the loss plot's lower panel: run - reference per step, which the bug moves at every step and
    # the right cells leave about 100 times smaller (fp32 rounding)
    gaps = loss_gaps(list(records.values()))
    bad_gap = min(abs(g) for cell, steps in gaps.items() if "-bad-" in cell for g in steps)
    good_gap = max(abs(g) for cell, steps in gaps.items() if "-good-" in cell for g in steps)
    assert bad_gap > 100 * good_gap and len(gaps[bad["cell"]]) == 3, gaps


def test_the_report_holds_the_loss_plot_and_the_failing_cells_module_heatmap(reported):
    out = reported[1]
    bad = sorted(p.name for p in out.glob("modules-*.png"))
    assert bad == ["modules-mlp-bad-dp2-fp32-plain-steps3-seed0.png", "modules-mlp-bad-dp4-fp32-plain-steps3-seed0.png"]
    assert (out / "losses-mlp.png").stat().st_size > 10_000
    page = (out / "report.html").read_text()
    assert "Whole models" in page and page.count("data:image/png;base64") == 1 + 1 + len(bad)  # heatmap, losses, modules
    summary = (out / "summary.md").read_text()
    assert "`losses-mlp.png`" in summary and "`modules-mlp-bad-dp2-fp32-plain-steps3-seed0.png`" in summary
