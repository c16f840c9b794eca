"""Exploring a whole model: a bug that lives in one combination of a model's own switches, which
the case's fixed cells never run, is found by ``python -m harness.explore <model>:<impl>`` within its
default budget, shrunk to the switches and mesh it needs, and printed as the cell to add.

The project is a user's own (written to a temporary directory, run in a subprocess as the user runs
it): a two-layer MLP whose activation and bias are the case's switches (``ModelCase.switches``, read
with ``harness.model.switches()``), parallelized by the team's own plan, whose fast path for bias-free
SiLU blocks leaves the row-parallel output as partial sums.
"""
import json
import textwrap

from tests.conftest import flat

CASE = 'import torch\nimport torch.nn.functional as F\nfrom torch import nn\nfrom torch.distributed.fsdp import fully_shard\nfrom torch.distributed.tensor import Partial\nfrom torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n\nfrom harness.model import ModelCase, switches\n\n\ndef build():\n    bias = switches()["bias"] == "on"\n    act = nn.SiLU() if switches()["act"] == "silu" else nn.GELU()\n    return nn.Sequential(nn.Linear(16, 32, bias=bias), act, nn.Linear(32, 16, bias=bias))\n\n\ndef batch(step):\n    g = torch.Generator().manual_seed(step)\n    return {"input": torch.randn(8, 16, generator=g), "target": torch.randn(8, 16, generator=g)}\n\n\ndef parallelize(model, meshes):\n    if meshes.spec.tp > 1:\n        # the team\'s fast path for bias-free SiLU blocks leaves fc2\'s output as partial sums\n        fast = switches()["act"] == "silu" and switches()["bias"] == "off"\n        row = RowwiseParallel(output_layouts=Partial()) if fast else RowwiseParallel()\n        parallelize_module(model, meshes.dense["tp"], {"0": ColwiseParallel(), "2": row})\n    if meshes.spec.dp > 1:\n        fully_shard(model, mesh=meshes.dense["dp"])\n    return model\n\n\ndef tp_and_dp(spec):\n    if spec.pp > 1 or spec.cp > 1 or spec.rep > 1:\n        return "tp and dp only"\n    return None if 16 % spec.tp == 0 else f"tp={spec.tp} does not divide the 16 features"\n\n\nCASE = ModelCase(build=build, batch=batch, loss=lambda out, b: F.mse_loss(out, b["target"]),\n                 parallelize={"mine": parallelize}, supports={"mine": tp_and_dp},\n                 switches={"act": ("gelu", "silu"), "bias": ("on", "off")})\n'
CONFTEST = 'from harness.model import register_model\n\nregister_model("mlp", "mlpcase:CASE")\n'
TEST = textwrap.dedent("""\
    import pytest

    from harness.model import model_cells

    CELLS = model_cells("mlp", meshes=["tp=2", "dp=2,tp=2"])  # the switches' defaults: gelu, bias on


    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_mlp(cfg, parity):
        parity(cfg)
    """)


def test_the_fixed_cells_pass_and_exploring_the_switches_finds_shrinks_and_prints_the_cell(user_project):
    user_project.write({"mlpcase.py": CASE, "conftest.py": CONFTEST, "test_mlp.py": TEST})
    fixed = user_project.pytest("--case-deadline", "120")
    assert fixed.returncode == 0 and "2 passed" in fixed.stdout, fixed.tail

    # the default budget (100 examples, 300 s); seeded, so that the search is the same every run
    found = user_project.harness("explore", "mlp:mine", "--pool-size", "4", "--seed", "0",
                                 "--out", str(user_project.path / "out"), "--case-deadline", "120", timeout=900)
    assert found.returncode == 1, found.tail
    cell = "mlp-mine-tp2-fp32-act_silu.bias_off-steps1-seed0"
    assert f"mlp:mine: found {cell} fails with mismatch" in found.stdout, found.stdout[-3000:]
    assert "essential: tp=2, act=silu, bias=off" in found.stdout
    # the first line pytest's diagnosis gives the same cell, then the events' answer
    assert ("first diverging module: 2 (output, step 1, microbatch 0): its inputs still match the reference, it "
            "returns per-rank partial sums over tp: summed they match the reference; the model uses them "
            "unreduced") in flat(found.stdout), found.stdout[-3000:]
    assert "where it starts: fwd module microbatch=0 module=2 step=1: its inputs match the reference" in flat(found.stdout)
    assert f'CELLS.append(Config.parse("{cell}"))' in found.stdout
    result = json.loads((user_project.path / "out" / "result.json").read_text())
    assert result[0]["minimal"] == cell


# the team's trainer of two dims: dp and tp together or not at all, its plan right
TOGETHER = '''
def together(spec):
    if spec.pp > 1 or spec.cp > 1 or spec.rep > 1 or spec.dp == 1 or spec.tp == 1:
        return "dp and tp together only"
    return None


CASE = ModelCase('''
PAIR = (CASE.replace('fast = switches()["act"] == "silu" and switches()["bias"] == "off"', "fast = False")
        .replace("\nCASE = ModelCase(", TOGETHER).replace("supports={\"mine\": tp_and_dp}", "supports={\"mine\": together}"))


def test_a_model_that_runs_on_few_meshes_is_explored_on_those_without_rejected_draws(user_project):
    # drafting meshes and rejecting the ones its supports refuse, 70% of such a model's draws found
    # nothing that runs: now its meshes are drawn from those it supports
    assert "fast = False" in PAIR and "together}" in PAIR
    user_project.write({"paircase.py": PAIR, "conftest.py": 'from harness.model import register_model\n\n'
                        'register_model("pair", "paircase:CASE")\n'})
    done = user_project.harness("explore", "pair:mine", "--pool-size", "4", "--seed", "0", "--max-examples", "8",
                                "--out", str(user_project.path / "out"), "--case-deadline", "120", timeout=600)
    assert done.returncode == 0, done.tail  # its plan is right: nothing found
    (result,) = json.loads((user_project.path / "out" / "result.json").read_text())
    assert result["rejected draws"] == 0 and result["trials"] >= 4, result
    tried = [line.split()[-1] for line in done.stderr.splitlines() if " search trial " in line]
    assert tried and all("dp2" in cell and "tp2" in cell for cell in tried), tried
