"""A trainer that normalises by the global token count, as torchtitan's does, from a user's own project
(a temporary directory, pytest in a subprocess): each rank's loss is its own sum over the global count,
FSDP's gradient division is off, so the ranks' gradients and losses are summed, not averaged. With
``ModelCase(loss_reduction="sum")`` its cells pass on dp, HSDP and dp·tp, a loss that is a DTensor
(Partial over dp, as torchtitan's full_dtensor backend returns) included; declared ``"mean"``, the same
trainer's loss reads half the reference on dp=2 while its gradients match; and the bug such a trainer
can ship (FSDP's division left on: gradients 1/dp) is red."""
import dataclasses
import textwrap

import pytest

from harness.model import ModelCase
from tests.conftest import flat

MODEL = textwrap.dedent('''\
    import dataclasses

    import torch
    from torch import nn
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from harness.model import ModelCase

    ROWS = 8  # the global batch: every rank's loss is its sum over all of it


    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(16, 32)
            self.down = nn.Linear(32, 16)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))


    def batch(step):
        g = torch.Generator().manual_seed(step)
        return {"input": torch.randn(ROWS, 16, generator=g), "target": torch.randn(ROWS, 16, generator=g)}


    def loss(out, batch):
        target = batch["target"]
        if isinstance(out, DTensor):  # the rows of this rank, as a DTensor over the data ranks
            target = DTensor.from_local(target, out.device_mesh, out.placements)
        return ((out - target) ** 2).sum() / (ROWS * 16)


    def parallelize(model, meshes, divide=False):
        if meshes.spec.tp > 1:
            parallelize_module(model, meshes.dense["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        data = ("rep", "dp") if meshes.spec.rep > 1 else ("dp",)
        fully_shard(model, mesh=meshes.dense[data])
        if not divide:
            model.set_gradient_divide_factor(1.0)  # the loss is already over the global count
            model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        return model


    def divided(model, meshes):  # the bug: FSDP still averages the gradients of a global-count loss
        return parallelize(model, meshes, divide=True)


    def dtensor_out(model, meshes):
        model = parallelize(model, meshes)
        mesh = meshes.dense["dp"]
        model.register_forward_hook(lambda module, args, out: DTensor.from_local(out, mesh, [Shard(0)]))
        return model


    CASE = ModelCase(build=MLP, batch=batch, loss=loss, loss_reduction="sum",
                     parallelize={"share": parallelize, "divided": divided, "dtensor": dtensor_out})
    AS_MEAN = dataclasses.replace(CASE, loss_reduction="mean")
    ''')
CONFTEST = textwrap.dedent('''\
    from harness.model import register_model

    register_model("mlp", "mymodel:CASE")
    register_model("mlpmean", "mymodel:AS_MEAN")
    ''')
TEST = textwrap.dedent('''\
    import pytest

    from harness.model import model_cells

    CELLS = (model_cells("mlp", impls=["share"], meshes=["dp=2", "rep=2,dp=2", "dp=2,tp=2"])
             + model_cells("mlp", impls=["dtensor"], meshes=["dp=2"])
             + model_cells("mlp", impls=["divided"], meshes=["dp=2"])
             + model_cells("mlpmean", impls=["share"], meshes=["dp=2"]))


    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_mlp(cfg, parity):
        parity(cfg)
    ''')


def test_a_loss_over_the_global_count_is_summed_over_the_ranks(user_project):
    user_project.write({"mymodel.py": MODEL, "conftest.py": CONFTEST, "test_mlp.py": TEST})
    done = user_project.pytest("--case-deadline", "120")
    out = done.stdout
    assert done.returncode == 1 and "2 failed, 4 passed" in out, done.tail
    failed = out.split("short test summary")[1]
    for cell in ("mlp-share-dp2-", "mlp-share-rep2.dp2-", "mlp-share-dp2.tp2-", "mlp-dtensor-dp2-"):
        assert f"test_mlp[{cell}" not in failed, failed
    divided = flat(out.split("_ test_mlp[mlp-divided-dp2")[1].split("reproduce:")[0])
    assert "grad/down.weight mismatch" in divided and "loss/step1" not in divided, divided[:3000]
    # the loss hands back the reference's gradient; the parameters' gradients are 1/dp of it
    assert "first diverging module: down (parameter gradients, step 1)" in divided and "1/dp" in divided, divided[:3000]
    as_mean = flat(out.split("_ test_mlp[mlpmean-share-dp2")[1].split("reproduce:")[0])
    assert "loss/step1" in as_mean and "grad/" not in as_mean, as_mean[:3000]  # half the loss, the right gradients


def test_a_loss_reduction_the_harness_does_not_know_names_the_choices():
    with pytest.raises(ValueError, match=r"loss_reduction='avg': choose one of \('mean', 'sum'\)"):
        dataclasses.replace(ModelCase(build=object, batch=dict, loss=sum, parallelize={"a": id}), loss_reduction="avg")
