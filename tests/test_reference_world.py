"""The reference is one process, from a user's project (written to a temporary directory, run with
pytest in a subprocess): code that reads the world is judged, never copied into the reference.

- A loss divided by ``dist.get_world_size()`` (on top of the mean FSDP already takes): every
  multi-rank cell is red with norm ratio 1/world, run alone or together, in either order, and no
  golden file is written; its one-rank cell stays green (there the division is by one).
- A ``build`` that seeds by ``dist.get_rank()``: the reference is rank 0's model on one process, so
  a parallelize that starts every rank from rank 0's weights (a broadcast, as DDP makes it) passes,
  and one that shards each rank's own weights fails.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from tests.conftest import flat, line_of
from tests.project import Run, UserProject

MODEL = textwrap.dedent('''\
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from harness.model import ModelCase


    def batch(step):
        g = torch.Generator().manual_seed(step)
        return {"input": torch.randn(8, 16, generator=g), "target": torch.randn(8, 16, generator=g)}


    def build():
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


    def fsdp(model, meshes):
        fully_shard(model, mesh=meshes.mesh("fsdp"))
        return model


    def scaled_loss(out, b):
        """The classic mistake: FSDP already averages gradients over the ranks."""
        return F.mse_loss(out, b["target"]) / dist.get_world_size()


    def build_seeded_by_rank():
        torch.manual_seed(1000 + dist.get_rank())  # a trainer seeding each rank its own way
        return build()


    SCALED = ModelCase(build=build, batch=batch, loss=scaled_loss, parallelize={"fsdp": fsdp})
    def synced(model, meshes):
        """Every rank starts from rank 0's weights, as DDP's constructor makes it."""
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
        return fsdp(model, meshes)


    def divided_twice(model, meshes):
        """Data parallel by hand: each gradient summed over dp as autograd computes it and divided by
        dp, the last layer's by dp once more."""
        group = meshes.mesh("fsdp").get_group()
        dp = dist.get_world_size(group)
        for name, param in model.named_parameters():
            param.register_hook(lambda grad, by=dp * dp if name.startswith("2.") else dp: averaged(grad, group, by))
        return model


    def averaged(grad, group, by):
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad / by


    DIVIDED = ModelCase(build=build, batch=batch, loss=lambda out, b: F.mse_loss(out, b["target"]),
                        parallelize={"twice": divided_twice})
    SEEDED = ModelCase(build=build_seeded_by_rank, batch=batch, loss=lambda out, b: F.mse_loss(out, b["target"]),
                       parallelize={"synced": synced, "fsdp": fsdp})
    ''')
CONFTEST = textwrap.dedent('''\
    from harness.model import register_model

    register_model("scaled", "worldly:SCALED")
    register_model("seeded", "worldly:SEEDED")
    register_model("divided", "worldly:DIVIDED")
    ''')
TEST = textwrap.dedent('''\
    import pytest

    from harness.model import model_cells

    MESHES = {MESHES!r}
    CELLS = model_cells("{NAME}", meshes=MESHES)


    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_cell(cfg, parity):
        parity(cfg)
    ''')


def run_project(root: Path, name: str, meshes: list[str]) -> Run:
    project = UserProject(root, {"worldly.py": MODEL, "conftest.py": CONFTEST,
                                 "test_cells.py": TEST.replace("{MESHES!r}", repr(meshes)).replace("{NAME}", name)})
    return project.pytest("-p", "no:randomly", "--case-deadline", "120", "--pool-size", "4")


def failures(output: str) -> dict[str, str]:
    """Each failing cell's id -> what pytest printed of it."""
    return dict(re.findall(r"_ test_cell\[(\S+)\] _+\n(.*?)(?=\n_{3,} test_cell|\n=+ short test summary)", output, re.S))


def norm_ratios(output: str) -> dict[str, float]:
    """Each failing cell's id -> the norm ratio of its first gradient row (the ``norm ratio`` column);
    for a cell printed as failing alike another (no table of its own), the factor its line names."""
    ratios = {}
    for cell, body in failures(output).items():
        row = next((line for line in body.splitlines() if re.match(r"\s*grad/", line)), None)
        alike = re.search(r"fails as \S+ does \(printed in full\): .* \(the reference x 1/(\d+) = 1/dp\)", flat(body))
        ratios[cell] = 1 / int(alike.group(1)) if row is None and alike else float(row.split()[-3])
    return ratios


@pytest.mark.parametrize("order", [["dp=2", "dp=4", "dp=1"], ["dp=4", "dp=1", "dp=2"], ["dp=2"], ["dp=4"]],
                         ids=lambda order: "_".join(m.replace("=", "") for m in order))
def test_a_loss_divided_by_the_world_size_is_red_on_every_multi_rank_cell(tmp_path, order):
    done = run_project(tmp_path / "project", "scaled", order)
    print(done.stdout[-6000:])
    ratios = norm_ratios(done.stdout)
    want = {f"scaled-fsdp-{mesh.replace('=', '')}": 1 / int(mesh.split("=")[1]) for mesh in order if mesh != "dp=1"}
    assert {c.split("-fp32")[0] for c in ratios} == set(want), done.tail
    for cell, ratio in want.items():
        assert ratios[next(c for c in ratios if c.startswith(cell + "-"))] == pytest.approx(ratio, rel=1e-3), ratios
    passed = re.search(r"^(?:\d+ failed, )?(\d+) passed", done.stdout.splitlines()[-1])
    assert (int(passed.group(1)) if passed else 0) == ("dp=1" in order), done.tail
    written = sorted(p.name for p in (tmp_path / "project" / "golden").rglob("*") if p.is_file()) \
        if (tmp_path / "project" / "golden").exists() else []
    assert all("-dp1-" in name for name in written), written  # only the one-rank cell, which matched
    for cell, body in failures(done.stdout).items():  # every gradient is the reference over the world, named so
        world, body = cell.split("-dp")[1].split("-")[0], flat(body)
        assert f"norm ratio {1 / int(world):g}: the reference x 1/{world} = 1/dp" in body or "fails as" in body, body
        assert ("first diverging module: none, it starts in the loss (step 1): every judged forward output matches, "
                f"the gradient the loss hands back to 2 does not (the reference x 1/{world} = 1/dp)") in body, body


def test_a_loss_divided_by_the_world_size_on_several_meshes_prints_once_naming_the_world(tmp_path):
    """One bug on dp=2, dp=4 and HSDP: one way of failing whatever its factor, printed once in full,
    and on HSDP the factor named as the world."""
    done = run_project(tmp_path / "project", "scaled", ["dp=2", "dp=4", "rep=2,dp=2"])
    assert "3 failed" in done.stdout, done.tail
    out = flat(done.stdout)
    # counted in the failures section: the short summary repeats each first line (whole under CI=true)
    failures = out[out.index("= FAILURES ="):out.index("short test summary info")]
    assert failures.count(" diverges from the reference (") == 1, done.tail  # one table, not one per factor
    assert "2 more cells fail alike (printed once, here): " in out, done.tail
    assert ("the gradient the loss hands back to 2 does not (the reference x 1/4 = 1/rep·dp (the world))"
            in out), done.tail


def test_a_gradient_divided_by_dp_twice_is_named_with_its_group(tmp_path):
    done = run_project(tmp_path / "project", "divided", ["dp=2"])
    print(done.stdout[-6000:])
    assert "1 failed" in done.stdout, done.tail
    assert ("first diverging module: 2 (parameter gradients, step 1), in the backward pass: every judged forward "
            "output matches, the gradient it received still matches, its parameters' gradients") in flat(done.stdout)
    line = line_of(done.stdout, "first diverging parameter gradients")
    assert line == ("first diverging parameter gradients (step 1, in backward order): 2.bias (module 2: mismatch, "
                    "norm ratio 0.5: the reference x 1/2 = 1/dp, ranks 0,1); 2.weight (module 2: mismatch, "
                    "norm ratio 0.5: the reference x 1/2 = 1/dp, ranks 0,1)"), line


def test_a_build_seeded_by_rank_is_judged_against_rank_0s_model_on_one_process(tmp_path):
    done = run_project(tmp_path / "project", "seeded", ["dp=2", "dp=4"])
    print(done.stdout[-6000:])
    assert "2 failed, 2 passed" in done.stdout, done.tail
    failed = re.findall(r"^FAILED \S+test_cell\[(seeded-\w+)-", done.stdout, re.M)
    assert sorted(failed) == ["seeded-fsdp", "seeded-fsdp"], failed
