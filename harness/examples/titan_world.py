"""torchtitan's way of making its meshes: from the job config and the world, not from the harness.

A training script's parallelize, as ``torchtitan/train.py`` + ``torchtitan/distributed/parallel_dims.py``
do it: the job config's ``parallelism`` degrees (``data_parallel_shard_degree=-1``: whatever the world
leaves), a small :class:`ParallelDims` resolving them against ``dist.get_world_size()`` and building
the world mesh with ``init_device_mesh``; then tensor parallelism (``parallelize_module``: sequence
parallel, colwise/rowwise, ``loss_parallel``) and FSDP2 (``fully_shard``) on that mesh's dims. The
model, its TP plan and FSDP units are ``harness/examples/titan.py``'s. ``meshes`` is not read.

Each implementation is a job config; a cell's mesh must be the one that config makes of the cell's
world (``supports``): job ``tp2`` (tp 2, dp_shard -1) on 2 ranks is ``tp=2``, on 4 ``dp=2,tp=2``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from harness.model import ModelCase, model_cells

from harness.examples.titan import Transformer, apply_fsdp, apply_tp, batch, loss


@dataclass
class Parallelism:
    """``job_config.parallelism``, under torchtitan's names."""

    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1
    tensor_parallel_degree: int = 1


@dataclass
class ParallelDims:
    """torchtitan's ``ParallelDims``, cut to dp_replicate x dp_shard x tp."""

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    def __post_init__(self):
        if self.dp_shard == -1:
            self.dp_shard = self.world_size // (self.dp_replicate * self.tp)
        if self.dp_replicate * self.dp_shard * self.tp != self.world_size:
            raise ValueError(f"Invalid parallel dims: dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) "
                             f"* tp({self.tp}) != WORLD_SIZE({self.world_size})")

    def build_mesh(self, device_type: str):
        dims = [(n, d) for n, d in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("tp", self.tp))
                if d > 1]
        names, shape = zip(*dims)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """HSDP over (dp_replicate, dp_shard), FSDP over dp_shard; () without data parallelism."""
        return tuple(n for n, d in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)) if d > 1)


JOBS = {"tp2": Parallelism(tensor_parallel_degree=2)}


def parallelize(model, meshes, job: Parallelism):
    p = job
    dims = ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                        tp=p.tensor_parallel_degree, world_size=dist.get_world_size())
    world_mesh = dims.build_mesh("cuda" if torch.cuda.is_available() else "cpu")
    if dims.tp > 1:
        apply_tp(model, world_mesh["tp"], loss_parallel=True)
    if dims.fsdp_dims:
        apply_fsdp(model, world_mesh[dims.fsdp_dims])
    return model


def tp2(model, meshes):
    return parallelize(model, meshes, JOBS["tp2"])


def made_by(job: Parallelism):
    """``supports``: the cell's mesh is the one ``job`` makes of the cell's world (no pp, no cp)."""
    def check(spec):
        world = spec.rep * spec.dp * spec.tp * spec.cp * spec.pp
        try:
            want = ParallelDims(job.data_parallel_replicate_degree, job.data_parallel_shard_degree,
                                job.tensor_parallel_degree, world)
        except ValueError as error:
            return str(error)
        if (spec.rep, spec.dp, spec.tp, spec.cp, spec.pp) != (want.dp_replicate, want.dp_shard, want.tp, 1, 1):
            return f"this job config makes rep={want.dp_replicate}, dp={want.dp_shard}, tp={want.tp} of {world} ranks"
        return None
    return check


CASE = ModelCase(build=Transformer, batch=batch, loss=loss, parallelize={"tp2": tp2},
                 supports={"tp2": made_by(JOBS["tp2"])})


def cells():
    """The titanworld cells of ``cases/test_models.py``: job ``tp2`` on worlds of 2 and 4 ranks."""
    return model_cells("titanworld", meshes=["tp=2", "dp=2,tp=2"])
