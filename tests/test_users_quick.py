"""``--quick`` runs a switch's values where the switch acts, from a user's own project (a temporary
directory, pytest in a subprocess): a case whose ``sp`` switch (sequence parallelism) acts only with
tp declares ``acts_with={"sp": ("tp",)}``, and ``--quick`` runs ``sp_on`` on ``tp=2``, where the
planted SP-only bug (the norm on each rank's part of the sequence, its weight's gradient never summed
over tp) is red. The same case without ``acts_with`` shows the gap: ``--quick`` runs ``sp_on`` only
on ``dp=2``, where sequence parallelism does nothing, and the bug passes."""
import dataclasses  # noqa: F401  (used by the project's module)
import re
import textwrap

MODEL = textwrap.dedent('''\
    import dataclasses

    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from harness.model import ModelCase, switches


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.up = nn.Linear(16, 32)
            self.down = nn.Linear(32, 16)

        def forward(self, x):
            return self.down(torch.relu(self.up(self.norm(x))))


    def batch(step):
        g = torch.Generator().manual_seed(step)
        return {"input": torch.randn(4, 8, 16, generator=g), "target": torch.randn(4, 8, 16, generator=g)}


    def loss(out, batch):
        return ((out - batch["target"]) ** 2).mean()


    def parallelize(model, meshes):
        tp = meshes.dense["tp"]
        if tp.size() > 1:
            sp = switches()["sp"] == "on"
            parallelize_module(model, tp, {"up": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate()),
                                           "down": RowwiseParallel()})
            if sp:  # the norm runs on this rank's part of the sequence; its weight's gradient is never summed
                rank, n = tp.get_local_rank(), tp.size()
                model.norm.register_forward_pre_hook(lambda module, args: (args[0].chunk(n, dim=1)[rank],))
        if meshes.dense["dp"].size() > 1:
            fully_shard(model, mesh=meshes.mesh("fsdp"))
        return model


    CASE = ModelCase(build=Block, batch=batch, loss=loss, parallelize={"tp": parallelize},
                     switches={"sp": ("off", "on")}, acts_with={"sp": ("tp",)})
    BARE = dataclasses.replace(CASE, acts_with={})
    ''')
CONFTEST = textwrap.dedent('''\
    from harness.model import register_model

    register_model("spmlp", "mymodel:CASE")
    register_model("spbare", "mymodel:BARE")
    ''')
TEST = textwrap.dedent('''\
    import pytest

    from harness.model import model_cells

    CELLS = [cfg for name in ("spmlp", "spbare")
             for cfg in model_cells(name, meshes=["dp=2", "tp=2"], switches={"sp": ["off", "on"]})]


    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_cell(cfg, parity):
        parity(cfg)
    ''')


def test_quick_runs_a_switch_where_it_acts(user_project):
    user_project.write({"mymodel.py": MODEL, "conftest.py": CONFTEST, "test_cells.py": TEST})
    done = user_project.pytest("-rA", "--quick", "--case-deadline", "120")
    out = done.stdout
    ran = dict((cell, verdict) for verdict, cell in
               re.findall(r"^(PASSED|FAILED) test_cells.py::test_cell\[(\S+?)-steps3-seed0\]", out, re.M))
    assert ran.get("spmlp-tp-tp2-fp32-sp_on") == "FAILED", (ran, done.tail)
    failure = out.split("test_cell[spmlp-tp-tp2-fp32-sp_on")[1].split("reproduce:")[0]
    assert "partial sums over tp" in failure and "norm.weight" in failure, out[-6000:]
    # without acts_with, any cell shows a value: sp_on runs once, wherever it adds the most (here on tp=2
    # as well, for its dim; the bug is only seen there)
    assert len([c for c in ran if c.startswith("spbare-") and c.endswith("-sp_on")]) == 1, ran
    assert all(v == "PASSED" for c, v in ran.items() if not c.endswith("-tp2-fp32-sp_on")), ran
