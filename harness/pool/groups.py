"""One process group per set of ranks, for the life of a rank process.

Every ``DeviceMesh``, flattened dim, ``_unflatten`` and user-made group asks ``torch.distributed``
for new groups. On gloo each group is a TCP device of its own, whose loop thread wakes every 10 ms
(gloo's epoll timeout), plus two worker threads. A rank that serves a whole matrix (hundreds of
layouts: every component mesh, every model cell's dense, sparse and flattened meshes) piled them
up: ~600 threads a rank, ~5,000 in a pool, and their wakeups alone kept both cores of a CI machine
busy (the matrix with the model cells took 976 s instead of ~210 s).

A rank runs one cell at a time, and every member of a group issues its collectives in program
order, so groups over the same ranks (same backend, timeout and options) may be reused from cell to
cell: the rank keeps the groups it made per rank set and hands them back to later requests. Within one
cell, though, groups of different names over the same ranks stay different groups, as torch makes
them: code may key on a group's identity (FSDP2 requires the parameters it shards over one group to
share one mesh, so torchtitan's ``fsdp`` and ``efsdp`` dims, both over ranks 0 and 2 when ep borrows
from tp, must not be one group). So the k-th name a cell asks for over a rank set gets the rank set's
k-th group (:func:`next_task` starts the count again). Every rank of the world still calls
``new_group`` in the same order (its cache sees the same requests), so the collective group creation
stays in step. A ``destroy_process_group`` of a kept group keeps it (another mesh may hold it);
``destroy_process_group()`` of everything clears the cache too.
"""
from __future__ import annotations

import atexit
import os
import queue
import threading

_shared: dict[tuple, list] = {}  # request key -> what new_group returned for it (a group, or the non-member mark)
_named: dict[tuple, dict] = {}  # this task: request key -> {group_desc: index in _shared[key]}


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
        made, names = _shared.setdefault(key, []), _named.setdefault(key, {})
        index = names.setdefault(group_desc, len(names))
        if index == len(made):
            made.append(create(**call))
        return made[index]

    def destroy_process_group(group=None):
        if group is None:
            _shared.clear()
            _named.clear()
            return destroy(group)
        if any(group is kept for made in _shared.values() for kept in made):
            return None  # shared with other meshes over the same ranks: kept for the process's life
        return destroy(group)

    new_group.shared_by_rank_set = True
    for module in (dist, c10d, device_mesh):  # device_mesh imported new_group by name
        module.new_group = new_group
    for module in (dist, c10d):
        module.destroy_process_group = destroy_process_group


def next_task() -> None:
    """A new task begins: its first group of each name over a rank set is again the set's first."""
    _named.clear()


def own_groups() -> int:
    """How many process groups this process holds beyond its default group and the groups it
    shares by rank set: those a cell's code made with options of their own and left."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    shared = {id(g) for made in _shared.values() for g in made}
    default = dist.distributed_c10d._get_default_group()
    return sum(1 for g in dist.distributed_c10d._world.pg_map if g is not default and id(g) not in shared)


def shared_count() -> int:
    """How many distinct groups this process has created through the cache."""
    return sum(len(made) for made in _shared.values())


_released: queue.Queue = queue.Queue()  # past worlds' meshes, for the teardown thread to drop
_teardown: threading.Thread | None = None


def _forget_teardown() -> None:  # a forked child has no such thread, and its copy of the queue may be mid-use
    global _released, _teardown
    _released, _teardown = queue.Queue(), None


os.register_at_fork(after_in_child=_forget_teardown)


def release(meshes: dict, backend: str) -> None:
    """Let go of a past world's built meshes (``meshes`` is emptied), and so of their groups.

    A gloo group's teardown closes each of its connections and waits, for each, for the group's
    transport loop to come round (its 10 ms epoll timeout, stretched by the ranks' timer slack): tens
    of milliseconds a group, ~75 ms a world change on rank 0, which every rank waited out before the
    next world's rendezvous (two thirds of an exploration's trial time, whose draws change the world
    at every other trial). The groups are already out of torch's tables
    (``destroy_process_group``) and nothing else holds them, so they are dropped on a thread of the
    rank's own while the next world is made; torch lets go of the GIL in their destructors. The
    thread is started on first use, before the task's code runs, and lives as long as the process,
    so the clean-start check finds it both before and after every task. Other backends' groups are
    dropped here, at once, as before (NCCL's teardown beside a new world's set-up is untried).
    """
    global _teardown
    if backend != "gloo":
        meshes.clear()
        return
    if _teardown is None:
        _teardown = threading.Thread(target=_drop_released, name="harness-teardown", daemon=True)
        _teardown.start()
    _released.put(dict(meshes))
    meshes.clear()


def _drop_released() -> None:
    while True:
        _released.get().clear()
        _released.task_done()


def settled() -> None:
    """Wait until every world :func:`release` was given is dropped."""
    _released.join()


atexit.register(settled)  # a destructor cut off by the interpreter's shutdown would abort the process
