"""FSDP/HSDP: parallel/fsdp.py (and FSDP2 ``fully_shard``) against reference/fsdp.py.

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
