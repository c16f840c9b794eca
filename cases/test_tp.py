"""Tensor parallelism: parallel/tp.py (and DTensor's parallelize_module) against reference/tp.py."""
import pytest

from harness.matrix import cells
from reference.tp import OPS, SIZES

MESHES = ["tp=1", "tp=2", "tp=3", "tp=4", "tp=8", "dp=2,tp=2", "dp=2,tp=4", "dp=4,tp=2"]
CELLS = cells("tp", impls=["ours", "dtensor"], meshes=MESHES, dtypes=["fp32", "bf16"], sizes=SIZES,
              switches={"op": OPS})


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_tp(cfg, parity):
    parity(cfg)
