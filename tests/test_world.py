"""A cell is a world: a user's parallelize that reads only the world torchrun makes runs unchanged.

The project's parallelize asks ``dist.get_world_size()``, reads ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/
``LOCAL_WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, runs a collective on the default group, and
builds its mesh with ``init_device_mesh("cpu", (world // 2, 2))`` over the whole world, as a
training script does. Its 2-, 4- and 8-rank cells run one after the other in one 8-rank pool, in a
kept pool, and under torchrun with 8 ranks (the smaller cells on the job's first ranks), from a
project of its own, and pass; the next cell sees its own world (a variable the previous cell's code
set is gone).
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from harness.pool import kept
from tests.conftest import own_pool_env
from tests.project import Run, UserProject

MODEL = textwrap.dedent('''\
    import os

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from harness.model import ModelCase


    def batch(step):
        g = torch.Generator().manual_seed(step)
        return {"input": torch.randn(8, 16, generator=g), "target": torch.randn(8, 16, generator=g)}


    def parallelize(model, meshes):
        """The user's own: it knows nothing of the harness, only the world torchrun made."""
        world, rank = dist.get_world_size(), dist.get_rank()
        env = os.environ
        assert (int(env["WORLD_SIZE"]), int(env["RANK"]), int(env["LOCAL_RANK"])) == (world, rank, rank)
        assert int(env["LOCAL_WORLD_SIZE"]) == world and env["MASTER_ADDR"] and int(env["MASTER_PORT"]) > 0
        assert "LEFT_BY_THE_LAST_CELL" not in env, "a variable a previous cell set leaked into this one"
        env["LEFT_BY_THE_LAST_CELL"] = str(world)
        ones = torch.ones(1)
        dist.all_reduce(ones)  # the default group: this cell's ranks, no more
        assert ones.item() == world
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        return model


    CASE = ModelCase(build=lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), batch=batch,
                     loss=lambda out, b: F.mse_loss(out, b["target"]), parallelize={"world": parallelize})
    ''')
CONFTEST = 'from harness.model import register_model\n\nregister_model("worldly", "worldly:CASE")\n'
TEST = textwrap.dedent('''\
    import pytest

    from harness.model import model_cells

    CELLS = model_cells("worldly", meshes=["dp=4,tp=2", "tp=2", "dp=2,tp=2"])  # 8, 2, then 4 ranks


    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_worldly(cfg, parity):
        parity(cfg)
    ''')


def write_project(root: Path, model: str, test: str) -> UserProject:
    """A user's project at ``root``: the model case ``worldly``, its conftest and its test module."""
    return UserProject(root, {"worldly.py": model, "conftest.py": CONFTEST, "test_worldly.py": test})


@pytest.fixture
def project(tmp_path) -> UserProject:
    return write_project(tmp_path / "project", MODEL, TEST)


def _pytest(project: UserProject, *args: str, env: dict | None = None) -> Run:
    return project.pytest("--pool-size", "8", "--case-deadline", "120", *args, env=env)


def test_a_parallelize_that_reads_the_world_passes_on_cells_of_2_4_and_8_ranks_in_one_pool(project):
    done = _pytest(project, env=own_pool_env(project.env()))  # a pool of the run's own, not kept
    assert done.returncode == 0, done.tail
    assert "3 passed" in done.stdout


def test_the_same_in_a_kept_pool(project):
    """The suite's kept pool (tests/conftest.py): the ranks fork from a keeper's zygote that outlives
    this run and serves the other projects of the suite."""
    assert kept.ENV in project.env()
    done = _pytest(project)
    assert done.returncode == 0, done.tail
    assert "3 passed" in done.stdout


def test_the_same_under_torchrun_on_the_first_ranks_of_an_8_rank_job(project, tmp_path):
    # the last rank starts late, as on a loaded machine: pytest counts --rank-logs' value, once the
    # directory exists, in its choice of rootdir, so the other ranks must not make it before every rank
    # has chosen (that rank collected project/test_worldly.py::..., the others test_worldly.py::...)
    project.write({"sitecustomize.py": "import os, time\nif os.environ.get('RANK') == '7':\n    time.sleep(3)\n"})
    done = project.run("python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                       "-m", "pytest", "-p", "no:cacheprovider", "-q", "--case-deadline", "120",
                       "--rank-logs", str(tmp_path / "logs"))
    assert done.returncode == 0, done.tail
    assert "3 passed" in done.stdout
    assert not list(tmp_path.glob(".logs-rank*")), "a rank's log left beside --rank-logs"


BAD = MODEL.replace('parallelize={"world": parallelize})', '''parallelize={
    "initpg": lambda model, meshes: dist.init_process_group("gloo") or model,
    "bigmesh": lambda model, meshes: init_device_mesh("cpu", (dist.get_world_size(), 2)) and model,
    "smallmesh": lambda model, meshes: parallelize_module(
        model, init_device_mesh("cpu", (dist.get_world_size() // 2,)), {"0": ColwiseParallel(), "2": RowwiseParallel()}),
    "slurm": lambda model, meshes: model if int(os.environ["SLURM_PROCID"]) >= 0 else None,
})''')
BAD_TEST = TEST.replace('model_cells("worldly", meshes=["dp=4,tp=2", "tp=2", "dp=2,tp=2"])  # 8, 2, then 4 ranks',
                        'model_cells("worldly", meshes=["tp=4"])')
LINES = {
    "initpg": "the cell's code called torch.distributed.init_process_group (at worldly.py:LINE in <lambda>), but the "
              "harness made this cell's world already: the default group over its 4 ranks",
    "bigmesh": "the cell's code built a device mesh (at worldly.py:LINE in <lambda>) larger than its world of 4 ranks",
    "smallmesh": "parameter 0.weight lives on a device mesh of 2 ranks (shape (2,)), but this cell's world has 4: "
                 "build the mesh over the whole world",
    "slurm": "the cell's code read the environment variable SLURM_PROCID (at worldly.py:LINE in <lambda>), which this "
             "cell's world does not set: it sets RANK, LOCAL_RANK, WORLD_SIZE",
}


def test_a_parallelize_that_misuses_the_world_fails_with_one_line_naming_the_fix(tmp_path):
    project = write_project(tmp_path / "project", BAD, BAD_TEST)
    done = _pytest(project, "--pool-size", "4")
    assert done.returncode == 1, done.tail
    assert "4 failed" in done.stdout, done.tail
    for impl, line in LINES.items():
        failure = done.stdout.split(f"test_worldly[worldly-{impl}-tp4")[1]
        shown = re.sub(r"worldly\.py:\d+", "worldly.py:LINE", failure)  # the user's line, in their file
        assert f"ranks 0-3: raised: {line}" in shown, (impl, failure[:3000])
        assert "Traceback" not in failure.split("reproduce:")[0], (impl, failure[:3000])
