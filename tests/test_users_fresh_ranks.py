"""A library that keeps state across builds in a process (as torchtitan 0.3.0 does), from a user's own
project (a temporary directory, pytest in a subprocess): its module remembers the first model it
parallelized and hands the next one that model's scale, so on warm ranks the second cell's verdict is
set by the first (red, though its code is right); registered ``fresh=True``, every cell runs on rank
processes no cell ran in and both are green, their shared directory (``cell_dir()``) there as on warm
ranks."""
import textwrap

MODEL = textwrap.dedent('''\
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from harness.model import ModelCase, cell_dir

    _FIRST = {}  # the library's process-wide state: the first model it parallelized


    def batch(step):
        g = torch.Generator().manual_seed(step)
        return {"input": torch.randn(8, 16, generator=g), "target": torch.randn(8, 16, generator=g)}


    def loss(out, batch):
        return ((out - batch["target"]) ** 2).mean()


    def parallelize(model, meshes):
        (cell_dir() / f"rank{dist.get_rank()}").write_text("here")  # the cell's directory, on its new ranks too
        first = _FIRST.setdefault("model", model)
        if first is not model:  # a stale handle: right in a new process, wrong in a used one
            with torch.no_grad():
                model.weight.mul_(2)
        fully_shard(model, mesh=meshes.dense["dp"])
        return model


    CASE = ModelCase(build=lambda: nn.Linear(16, 16), batch=batch, loss=loss, parallelize={"lib": parallelize})
    ''')
TEST = textwrap.dedent('''\
    import pytest

    from harness.model import model_cells

    CELLS = model_cells("warm", meshes=["dp=2", "dp=4"]) + model_cells("fresh", meshes=["dp=2", "dp=4"])


    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_model(cfg, parity):
        parity(cfg)
    ''')
CONFTEST = textwrap.dedent('''\
    from harness.model import register_model

    register_model("warm", "mymodel:CASE")
    register_model("fresh", "mymodel:CASE", fresh=True)
    ''')


def test_a_library_that_keeps_state_across_builds_gets_new_ranks_for_each_cell(user_project):
    user_project.write({"mymodel.py": MODEL, "conftest.py": CONFTEST, "test_model.py": TEST})
    done = user_project.pytest("-rf")
    assert done.returncode == 1 and "1 failed, 3 passed" in done.stdout, done.tail
    failed = done.failed()  # the FAILED lines' node ids
    assert len(failed) == 1 and "test_model[warm-lib-" in failed[0], failed  # the second on warm ranks
