"""Rank functions that misbehave on purpose, for the pool's fault tests."""
import os
import sys
import time

import torch
import torch.distributed as dist


def raise_on_rank1(ctx, payload):
    """Rank 1 raises before the all-reduce, so the other ranks are left waiting in it."""
    if ctx.rank == 1:
        raise ValueError("planted failure on rank 1")
    x = torch.ones(1)
    dist.all_reduce(x, group=ctx.group("tp"))
    return float(x)


def raise_everywhere(ctx, payload):
    raise RuntimeError(f"planted failure on rank {ctx.rank}")


def hang_on_last(ctx, payload):
    """The last rank sleeps; the others block in an all-reduce waiting for it."""
    if ctx.rank == ctx.layout.world - 1:
        while True:
            time.sleep(0.05)
    x = torch.ones(1)
    dist.all_reduce(x, group=ctx.group("tp"))
    return float(x)


def exit_on_rank1(ctx, payload):
    if ctx.rank == 1:
        os._exit(payload)
    x = torch.ones(1)
    dist.all_reduce(x, group=ctx.group("tp"))
    return float(x)


def pids(ctx, payload):
    return os.getpid()


def imported(ctx, payload):
    """Which of the modules ``payload`` names this rank's process has imported."""
    return sorted(m for m in payload if m in sys.modules)


def default_group(ctx, payload):
    """This rank's default group, as an identity: equal across tasks while the rank keeps its world."""
    import torch.distributed as dist

    return id(dist.distributed_c10d._get_default_group())


def draw_random(ctx, payload):
    """Values from the rank's global generator: private to the rank, fixed by the task's seed."""
    return torch.rand(3)


def _load_only_on_ranks():
    raise ImportError("No module named 'rank_only_module'")


class OnlyOnRanks:
    """Pickles on a rank; loading it fails, as a type from a module the parent lacks would."""

    def __reduce__(self):
        return (_load_only_on_ranks, ())


def unpicklable_result(ctx, payload):
    return OnlyOnRanks()


def write_files_forever(ctx, payload):
    """Create files in the task's scratch directory without end, as a checkpoint save writes there:
    whoever removes the pool's directory meanwhile races with it."""
    i = 0
    while True:
        with open(os.path.join(ctx.scratch, f"rank{ctx.rank}-{i}"), "w") as f:
            f.write("x")
        i += 1


def reference_where(cfg):
    """tp's reference, the process that computed it and the world it saw (its size, its rank, and
    RANK, LOCAL_RANK and WORLD_SIZE)."""
    import torch.distributed as dist

    from reference.tp import reference

    seen = [dist.get_world_size(), dist.get_rank(), *(int(os.environ[v]) for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))]
    return {**reference(cfg), "pid": torch.tensor(os.getpid()), "world": torch.tensor(seen)}


def tensors_of_every_kind(ctx, payload):
    """The payload's tensors back, with what the rank adds: each kind of tensor the wire carries
    (harness.pool.wire): raw bytes for plain CPU tensors, pickle's own way for the rest."""
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6) + ctx.rank
    return {
        "payload": payload,
        "view": base[1:, ::2],  # a strided view of a larger storage: its own values only
        "scalar": torch.tensor(ctx.rank + 0.5),
        "empty": torch.empty(0, 3, dtype=torch.int64),
        "bf16": (base / 7).to(torch.bfloat16),
        "bool": base > 10,
        "complex": torch.complex(base.float(), -base.float()).conj(),  # a conj bit: pickle's own way
        "param": torch.nn.Parameter(base.float()),
        "grad": base.float().requires_grad_(),
    }
