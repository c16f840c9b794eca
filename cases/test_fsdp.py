"""FSDP/HSDP: harness/parallel/fsdp.py (and FSDP2 ``fully_shard``) against reference/fsdp.py.

Axes, and why:

* mesh: FSDP ``dp`` in 1, 2, 3, 4, 8 (with f=13 rows dividing none of them, and o=5 rows fewer than
  4 and 8 ranks, so shards are uneven and some ranks hold empty ones); HSDP ``rep=2,shard=2`` and
  ``rep=2,shard=4`` (the divide factor is the whole data-parallel world, not the shard group);
  FSDP2 also on ``dp=2,tp=2`` and ``dp=4,tp=2`` (FSDP2 composed with DTensor tensor parallelism).
* dtype: fp32, and bf16 for mixed precision (bf16 compute, fp32 master shards and reduction).
* m: 1 microbatch, or 3 with gradient accumulation that reduces only on the last one.

Every cell takes three AdamW steps and checks each: loss, gradient norm, full gradients,
parameters and both AdamW moments.
"""
import pytest

from harness.matrix import cells
from reference.fsdp import SIZES

MESHES = ["dp=1", "dp=2", "dp=3", "dp=4", "dp=8", "rep=2,shard=2", "rep=2,shard=4"]
TP_MESHES = ["dp=2,tp=2", "dp=4,tp=2"]


def matrix(impl: str, meshes: list[str]) -> list:
    return [cfg for m in (1, 3) for cfg in cells("fsdp", impls=[impl], meshes=meshes, dtypes=["fp32", "bf16"],
                                                  sizes=dict(SIZES, m=m), switches={})]


CELLS = matrix("ours", MESHES) + matrix("fsdp2", MESHES + TP_MESHES)


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_fsdp(cfg, parity):
    parity(cfg)


# ---- properties of our FSDP the parity cells cannot see ------------------------------------------
# A bf16 reduction of bf16 gradients differs from the fp32 one by about one bf16 rounding, which is
# within the bf16 cells' tolerance (it must be: the compute itself carries that error). So the
# reduction dtype is checked on gradients that are exact in bf16 while their sum is not: each rank
# and microbatch contributes 1 + k/128, and the fp32 sum over 4 ranks x 3 microbatches, divided by 4,
# is exact in fp32; a sum in bf16 (8 significant bits) cannot hold it.
PROBE_ROWS = 5  # 5 rows over 4 shard ranks: 2/2/1/0, one empty shard


def reduction_probe(ctx, microbatches: int):
    """On every rank: one FSDPParam in bf16 compute; backward of known gradients; the reduced shard."""
    import torch

    from harness.parallel.fsdp import DPGroups, FSDPParam, GatherParam

    groups = DPGroups.of(ctx.device_mesh)
    param = FSDPParam("w", torch.zeros(PROBE_ROWS, 3), groups, torch.bfloat16)
    for i in range(microbatches):
        param.reduce_now = i == microbatches - 1
        full = GatherParam.apply(param.shard, param)
        assert full.dtype == torch.bfloat16 and full.shape == (PROBE_ROWS, 3)
        k = groups.index * microbatches + i + 1 + torch.arange(PROBE_ROWS).view(-1, 1).expand(-1, 3)
        full.backward((1 + k / 128).to(torch.bfloat16))
    return groups.index, groups.world, param.shard.grad


@pytest.mark.parametrize("mesh", ["dp=4", "rep=2,shard=2"])
def test_mixed_precision_reduces_gradients_in_fp32(rank_pool, mesh):
    import torch

    from harness.layout import chunk_bounds
    from harness.matrix import mesh as parse_mesh

    dims = parse_mesh(mesh)
    microbatches = 3
    results = rank_pool.run("cases.test_fsdp:reduction_probe", microbatches, dims, label=f"fsdp reduction {mesh}")
    world = results[0][1]
    k = torch.arange(PROBE_ROWS, dtype=torch.float64).view(-1, 1).expand(-1, 3)
    exact = sum(1 + (index * microbatches + i + 1 + k) / 128 for index in range(world) for i in range(microbatches))
    exact = exact / world
    shard_degree = dims[-1][1]
    for rank, (index, _, grad) in results.items():
        assert grad.dtype == torch.float32
        lo, hi = chunk_bounds(PROBE_ROWS, shard_degree, index % shard_degree)
        assert torch.equal(grad.double(), exact[lo:hi]), f"rank {rank}: {grad} != {exact[lo:hi]}"


def gather_probe(ctx, cfg_id: str):
    """On every rank: count all-gathers per parameter and whether a gathered weight outlives its forward."""
    import weakref

    from harness.config import Config
    from harness.parallel.fsdp import build, local_rows
    from reference.common import probe_loss
    from reference.fsdp import make_problem

    cfg = Config.parse(cfg_id)
    model, problem = build(ctx, cfg), make_problem(cfg)
    calls, alive = {}, []
    for name, param in model.params.items():
        def counted(param=param, name=name, gather=param.gather):
            calls[name] = calls.get(name, 0) + 1
            full = gather()
            alive.append(weakref.ref(full))
            return full
        param.gather = counted
    x, probe = (local_rows(t[0], model.groups) for t in (problem.x, problem.probe))
    loss = probe_loss(model.forward(x), probe, x.shape[0])
    after_forward = dict(calls), sum(ref() is not None for ref in alive)
    loss.backward()
    return after_forward, dict(calls)


def test_weights_are_freed_after_forward_and_gathered_again_for_backward(rank_pool):
    from harness.config import Config

    cfg = Config("fsdp", "ours", {"rep": 2, "shard": 2}, "bf16", dict(SIZES, m=1))
    for rank, ((forward_calls, still_alive), total_calls) in rank_pool.run(
            "cases.test_fsdp:gather_probe", cfg.id, cfg.mesh, label="fsdp gather probe").items():
        assert forward_calls == {"w1": 1, "b1": 1, "w2": 1, "b2": 1}, rank
        assert still_alive == 0, f"rank {rank}: {still_alive} gathered weights outlive the forward"
        # the backward gathers again exactly what it needs: W2, to pass the gradient on to the
        # hidden layer; not W1 (the input needs no gradient) nor the biases
        assert total_calls == {"w1": 1, "b1": 1, "w2": 2, "b2": 1}, rank
