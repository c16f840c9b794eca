"""A ``parallelize`` written against torchtitan's mesh names, unchanged, from a user's own project
(a temporary directory, pytest in a subprocess): with ``ModelCase(mesh_names="torchtitan")`` it gets
meshes named as torchtitan names them (``dp_replicate``, ``dp_shard``, flattened ``dp_shard_cp``)
over the same ranks, and its cells pass; without it, the cell says in one line which name it asked
for and how to keep it; and a planted bug in the same function (FSDP over ``dp_replicate`` instead of
``dp_shard_cp``: on ``dp=2`` nothing reduces the gradients) is red; a slice out of the mesh's order
is told as that, not as a name to map; a name the case's ``mesh_names`` renamed, or asked of a mesh the
function built itself, gets no advice to set ``mesh_names``. The function reads the running cell
(``harness.model.running()``) too."""
import textwrap

from tests.conftest import flat

MODEL = textwrap.dedent('''\
    import dataclasses

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from harness.model import ModelCase, running


    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(16, 32)
            self.down = nn.Linear(32, 16)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))


    def batch(step):
        g = torch.Generator().manual_seed(step)
        return {"input": torch.randn(8, 16, generator=g), "target": torch.randn(8, 16, generator=g)}


    def loss(out, batch):
        return ((out - batch["target"]) ** 2).mean()


    def parallelize(model, meshes, shard="dp_shard_cp"):
        world_mesh = meshes.dense  # as torchtitan's parallelize_llama reads its world mesh
        cell = running()  # the running cell, by the harness's names
        assert cell.dtype is torch.float32 and cell.steps == 3 and cell.device == torch.device("cpu"), cell
        assert cell.mesh.get("dp", 1) == world_mesh["dp_shard"].size() and cell.id.startswith("mlp"), cell
        if world_mesh["tp"].size() > 1:
            parallelize_module(model, world_mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        dp_mesh_dim_names = ("dp_replicate", shard) if world_mesh["dp_replicate"].size() > 1 else (shard,)
        if world_mesh[dp_mesh_dim_names].size() > 1:
            fully_shard(model, mesh=world_mesh[dp_mesh_dim_names])
        return model


    def fsdp_over_replicate(model, meshes):
        return parallelize(model, meshes, shard="dp_replicate")


    def fsdp_without_replicate(model, meshes):  # HSDP that forgot its replicate dim: no reduction over it
        fully_shard(model, mesh=meshes.dense["dp_shard_cp"])
        return model


    def fsdp_over_replicate_alone(model, meshes):  # HSDP that forgot its shard dim
        fully_shard(model, mesh=meshes.dense["dp_replicate"])
        return model


    def reversed_slice(model, meshes):  # names the mesh holds, asked for out of its order
        fully_shard(model, mesh=meshes.dense["dp_shard_cp", "dp_replicate"])
        return model


    def harness_name(model, meshes):  # the harness's name for a group that mesh_names renamed
        fully_shard(model, mesh=meshes.dense["rep"])
        return model


    def own_mesh(model, meshes):  # a mesh the function builds itself, asked for a name it does not give
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("shard",))
        fully_shard(model, mesh=mesh["dp_shard"])
        return model


    CASE = ModelCase(build=MLP, batch=batch, loss=loss, mesh_names="torchtitan",
                     parallelize={"titan": parallelize, "fsdpbug": fsdp_over_replicate, "norep": fsdp_without_replicate,
                                 "reponly": fsdp_over_replicate_alone,
                                 "reversed": reversed_slice, "ourname": harness_name, "ownmesh": own_mesh})
    OURS = dataclasses.replace(CASE, mesh_names=None)
    ''')
CONFTEST = textwrap.dedent('''\
    from harness.model import register_model

    register_model("mlp", "mymodel:CASE")
    register_model("mlpours", "mymodel:OURS")
    ''')
TEST = textwrap.dedent('''\
    import pytest

    from harness.model import model_cells

    CELLS = (model_cells("mlp", impls=["titan"], meshes=["dp=2", "rep=2,dp=2", "dp=2,tp=2", "tp=2"])
             + model_cells("mlp", impls=["fsdpbug"], meshes=["dp=2"])
             + model_cells("mlp", impls=["reponly", "norep"], meshes=["rep=2,dp=2"])
             + model_cells("mlp", impls=["reversed"], meshes=["rep=2,dp=2"])
             + model_cells("mlp", impls=["ourname", "ownmesh"], meshes=["dp=2"])
             + model_cells("mlpours", impls=["titan"], meshes=["dp=2"]))


    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_mlp(cfg, parity):
        parity(cfg)
    ''')


def test_a_torchtitan_named_parallelize_runs_unchanged(user_project):
    user_project.write({"mymodel.py": MODEL, "conftest.py": CONFTEST, "test_mlp.py": TEST})
    done = user_project.pytest("--case-deadline", "120")
    out = done.stdout
    assert done.returncode == 1 and "7 failed, 4 passed" in out, done.tail
    for mesh in ("dp2", "rep2.dp2", "dp2.tp2", "tp2"):
        assert f"PASSED test_mlp.py::test_mlp[mlp-titan-{mesh}-" not in out  # -q: only failures are named
        assert f"test_mlp[mlp-titan-{mesh}-" not in out.split("short test summary")[1]
    bug = flat(out.split("test_mlp[mlp-fsdpbug-dp2")[1])
    assert "diverges from the reference" in bug and "replicas" in bug, bug[:3000]
    # each dp rank's gradients are its own batch's: a reduction over dp that never ran, said as one
    assert ("first diverging module: down (parameter gradients, step 1), in the backward pass: the gradient it "
            "received still matches, its parameters' gradients (bias, weight) differ over dp (averaged over dp they "
            "match the reference): their reduction over dp is missing") in bug, bug[:4000]
    # the same rule for every group: HSDP with FSDP over dp_replicate alone misses dp; over dp_shard alone, rep
    for cell, dim in (("reponly-rep2.dp2", "dp"), ("norep-rep2.dp2", "rep")):
        said = flat(out.split(f"test_mlp[mlp-{cell}")[1].split("reproduce:")[0])
        assert (f"its parameters' gradients (bias, weight) differ over {dim} (averaged over {dim} they match the "
                f"reference): their reduction over {dim} is missing") in said, said[-3000:]
    ours = flat(out.split("test_mlp[mlpours-titan-dp2")[1])
    assert ("the cell's code asked a mesh for dp_shard (at mymodel.py:") in ours, ours[:3000]
    assert "ModelCase(mesh_names='torchtitan') hands them over with torchtitan's names" in ours
    # a slice out of the mesh's order is not a missing name: no advice to rename what is already named
    backwards = flat(out.split("test_mlp[mlp-reversed-rep2.dp2")[1].split("reproduce:")[0])
    assert "the cell's code sliced a mesh by dp_shard_cp, dp_replicate (at mymodel.py:" in backwards, backwards[:3000]
    assert "e.g. ['dp_replicate', 'dp_shard_cp']" in backwards and "mesh_names" not in backwards, backwards[:3000]
    # a name the case's mesh_names renamed: no advice to set what is set, but the name it has here
    renamed = flat(out.split("test_mlp[mlp-ourname-dp2")[1].split("reproduce:")[0])
    assert "the cell's code asked a mesh for rep (at mymodel.py:" in renamed, renamed[:3000]
    assert "ModelCase.mesh_names names this case's dims as above ('rep' is 'dp_replicate')" in renamed, renamed[:3000]
    assert "mesh_names='torchtitan'" not in renamed, renamed[:3000]
    # a mesh the function built: the harness's names and mesh_names have nothing to do with it
    own = flat(out.split("test_mlp[mlp-ownmesh-dp2")[1].split("reproduce:")[0])
    assert "the cell's code asked a mesh for dp_shard (at mymodel.py:" in own, own[:3000]
    assert "Valid mesh_dim_names are ['shard']" in own and "the mesh is one the cell's code built" in own, own[:3000]
    assert "mesh_names" not in own, own[:3000]
