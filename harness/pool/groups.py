"""One process group per set of ranks, for the life of a rank process.

Every ``DeviceMesh``, flattened dim, ``_unflatten`` and user-made group asks ``torch.distributed``
for new groups. On gloo each group is a TCP device of its own, whose loop thread wakes every 10 ms
(gloo's epoll timeout), plus two worker threads. A rank that serves a whole matrix (hundreds of
layouts: every component mesh, every model cell's dense, sparse and flattened meshes) piled them
up: ~600 threads a rank, ~5,000 in a pool, and their wakeups alone kept both cores of a CI machine
busy (the matrix with the model cells took 976 s instead of ~210 s).

A rank runs one cell at a time, and every member of a group issues its collectives in program
order, so two groups over the same ranks (same backend, timeout and options) are interchangeable:
the rank creates each such group once and hands the same group back to every later request. Every
rank of the world still calls ``new_group`` in the same order (its cache sees the same requests), so
the collective group creation stays in step. A ``destroy_process_group`` of a shared group keeps
it (another mesh may hold it); ``destroy_process_group()`` of everything clears the cache too.
"""
from __future__ import annotations

from typing import Any

_shared: dict[tuple, Any] = {}  # request key -> what new_group returned (a group, or the non-member mark)


def share_groups() -> None:
    """Route this process's ``new_group`` and ``destroy_process_group`` through the cache: call it once
    per rank process, after ``init_process_group`` and before any mesh is built."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.distributed_c10d as c10d

    if getattr(c10d.new_group, "shared_by_rank_set", False):  # (torch's own is wrapped by its loggers)
        return
    create, destroy = c10d.new_group, c10d.destroy_process_group

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None,
                  use_local_synchronization: bool = False, group_desc=None, device_id=None,
                  sort_ranks: bool = True):
        call = dict(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                    use_local_synchronization=use_local_synchronization, group_desc=group_desc,
                    device_id=device_id, sort_ranks=sort_ranks)
        if pg_options is not None or not sort_ranks:  # options are not comparable: a group of its own
            return create(**call)
        members = None if ranks is None else tuple(sorted(int(r) for r in ranks))
        key = (members, timeout, backend, use_local_synchronization, device_id)
        if key not in _shared:
            _shared[key] = create(**call)
        return _shared[key]

    def destroy_process_group(group=None):
        if group is None:
            _shared.clear()
            return destroy(group)
        if any(group is kept for kept in _shared.values()):
            return None  # shared with other meshes over the same ranks: kept for the process's life
        return destroy(group)

    new_group.shared_by_rank_set = True
    for module in (dist, c10d, device_mesh):  # device_mesh imported new_group by name
        module.new_group = new_group
    for module in (dist, c10d):
        module.destroy_process_group = destroy_process_group


def own_groups() -> int:
    """How many process groups this process holds beyond its default group and the groups it
    shares by rank set: those a cell's code made with options of their own and left."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    shared = {id(g) for g in _shared.values()}
    default = dist.distributed_c10d._get_default_group()
    return sum(1 for g in dist.distributed_c10d._world.pg_map if g is not default and id(g) not in shared)


def shared_count() -> int:
    """How many distinct groups this process has created through the cache."""
    return len(_shared)
