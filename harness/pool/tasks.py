"""Small tasks the harness itself sends to the pool (benchmarks, mesh checks)."""
from __future__ import annotations

import torch.distributed as dist

from ..context import RankContext


def noop(ctx: RankContext, payload):
    """The empty case: measures the pool's round trip."""
    return None


def reference(ctx: RankContext, payload):
    """A cell's single-process reference (``payload``: the component's reference path and the
    config), computed in a world of one rank (harness.resolve.Cell.reference); its calibration and a
    whole model's reduction the same way."""
    from ..registry import reference_of

    path, cfg = payload
    return reference_of(path, cfg)


def describe_mesh(ctx: RankContext, payload):
    """This rank's coordinates and, per dim, the ranks of its group, as torch sees them.

    ``payload``: the dims of a declared extra mesh to describe instead of the cell's (None: the cell's).
    """
    mesh = ctx.device_mesh if payload is None else ctx.mesh(payload)
    if mesh.get_coordinate() is None:  # this rank lies outside the (smaller) extra mesh
        return None
    groups = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in mesh.mesh_dim_names}
    return {"coords": tuple(mesh.get_coordinate()), "groups": groups}


def all_reduce_rank(ctx: RankContext, payload):
    """Sum of ranks over the ``payload`` dim's group: proves the groups carry traffic."""
    import torch

    x = torch.tensor([float(ctx.rank)])
    dist.all_reduce(x, group=ctx.group(payload))
    return float(x)
