"""A pool rank keeps one process group per set of ranks (harness.pool.groups): meshes, however many and
however named, add no gloo devices (each a loop thread waking every 10 ms) once their rank sets exist,
and every mesh's groups still carry the right traffic."""
import os
import warnings

import pytest

from harness.pool.parent import LeftChanged, Pool

# the same rank sets of a 4-rank world under many names and orders: what a long matrix builds
FIRST = [(("dp", 2), ("tp", 2)), (("tp", 4),)]
LATER = [(("cp", 2), ("tp", 2)), (("pp", 2), ("dp", 2)), (("dp", 2), ("cp", 2)), (("cp", 4),),
         (("pp", 2), ("tp", 2)), (("rep", 2), ("dp", 2))]


def gloo_devices(ctx, payload):
    """Rank task: this process's gloo devices (one loop thread each)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("gloo_tcp_loop")


def settled_gloo_devices(ctx, payload):
    """Rank task: the gloo devices this process holds once the past worlds' groups are dropped."""
    from harness.pool.groups import settled

    settled()
    return gloo_devices(ctx, None)


def timer_slack(ctx, payload):
    """Rank task: how late the kernel may wake this thread's timed waits, and those of the threads it
    starts (gloo's loops, made by ``new_group`` on this thread), in ns."""
    import ctypes

    return ctypes.CDLL(None).prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK


def two_names_per_rank_set(ctx, payload):
    """Rank task: torchtitan's dense and sparse meshes when ep borrows from tp (dp=2, tp=2, ep=2):
    ``fsdp`` and ``efsdp`` over the same ranks, ``tp`` and ``ep`` too. Whether each pair is one group,
    and the gloo devices this rank holds after."""
    from torch.distributed.device_mesh import init_device_mesh

    dense = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    return {"fsdp is efsdp": dense.get_group("fsdp") is sparse.get_group("efsdp"),
            "tp is ep": dense.get_group("tp") is sparse.get_group("ep"), "devices": gloo_devices(ctx, None)}


def rank_sums(ctx, payload):
    """Rank task: the sum of ranks over each dim's group of the cell's mesh (the groups carry traffic)."""
    import torch
    import torch.distributed as dist

    out = {}
    for name in ctx.device_mesh.mesh_dim_names:
        x = torch.tensor([float(ctx.rank)])
        dist.all_reduce(x, group=ctx.device_mesh.get_group(name))
        out[name] = float(x)
    return out


def new_and_destroyed(ctx, payload):
    """Rank task: a user's own group over ranks 0 and 1, destroyed after use, then made again."""
    import torch
    import torch.distributed as dist

    sums = []
    for _ in range(2):
        group = dist.new_group([0, 1])
        if ctx.rank in (0, 1):
            x = torch.tensor([1.0])
            dist.all_reduce(x, group=group)
            sums.append(float(x))
            dist.destroy_process_group(group)
    return sums


@pytest.fixture(scope="module")
def pool():
    pool = Pool(size=4, deadline=30.0)
    yield pool
    pool.close()


def test_meshes_over_the_same_ranks_add_no_gloo_devices(pool):
    for mesh in FIRST:
        pool.run(f"{__name__}:rank_sums", None, mesh)
    before = pool.run(f"{__name__}:gloo_devices", None, FIRST[0])
    for mesh in LATER:
        sums = pool.run(f"{__name__}:rank_sums", None, mesh)
        for rank, by_dim in sums.items():
            for name, total in by_dim.items():
                # ranks 0..3 row-major: a size-2 group over the last dim holds r and r^1, over the first
                # r and r^2; a size-4 group holds them all
                size = dict(mesh)[name]
                stride = 1 if name == mesh[-1][0] else 2
                group = {rank} if size == 1 else ({0, 1, 2, 3} if size == 4 else {rank, rank ^ stride})
                assert total == sum(group), (mesh, rank, name)
    after = pool.run(f"{__name__}:gloo_devices", None, FIRST[0])
    assert after == before, f"gloo devices per rank grew from {before} to {after} over meshes of the same ranks"


def test_a_past_worlds_groups_are_let_go_and_the_clean_start_check_sees_nothing_left(pool):
    """A new world drops the old one's groups on a thread of the rank's own (harness.pool.groups.release):
    none survives it, and that thread is no cell's."""
    for mesh in FIRST:
        pool.run(f"{__name__}:rank_sums", None, mesh)
    before = pool.run(f"{__name__}:settled_gloo_devices", None, FIRST[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", LeftChanged)  # "thread(s) left running" and the like
        for _ in range(3):
            pool.run(f"{__name__}:rank_sums", None, (("tp", 2),))  # a world of two: the four-rank one goes
            for mesh in FIRST:
                pool.run(f"{__name__}:rank_sums", None, mesh)
    after = pool.run(f"{__name__}:settled_gloo_devices", None, FIRST[0])
    assert after == before, f"gloo devices per rank grew from {before} to {after} over worlds made and left"


def test_a_user_group_destroyed_and_made_again_still_works(pool):
    sums = pool.run(f"{__name__}:new_and_destroyed", None, (("tp", 4),))
    assert sums[0] == sums[1] == [2.0, 2.0] and sums[2] == sums[3] == []


@pytest.mark.skipif(not os.path.exists("/proc/self/timerslack_ns"), reason="timer slack is Linux's")
def test_gloo_loops_of_a_rank_wake_rarely(pool):
    """Each group's loop polls every 10 ms plus the slack of the thread that made it: at the kernel's
    default slack (50 us) a rank's ~20 idle loops woke 2,000 times a second."""
    slack = pool.run(f"{__name__}:timer_slack", None, FIRST[0])
    assert all(ns >= 20_000_000 for ns in slack.values()), f"ranks' timer slack (ns): {slack}"


def test_one_cell_gets_a_group_per_name_over_the_same_ranks(pool):
    """FSDP2 requires the parameters it shards over one group to share one mesh: torchtitan's fsdp and
    efsdp dims over the same ranks must stay two groups within a cell, as torch makes them. The next
    cell that asks the same gets the same groups back (no device more)."""
    first = pool.run(f"{__name__}:two_names_per_rank_set", None, FIRST[0])
    again = pool.run(f"{__name__}:two_names_per_rank_set", None, FIRST[0])
    for rank, told in first.items():
        assert not told["fsdp is efsdp"] and not told["tp is ep"], (rank, told)
        assert again[rank]["devices"] == told["devices"], (rank, told, again[rank])
