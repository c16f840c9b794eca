"""Tensor parallelism: harness/parallel/tp.py, DTensor's parallelize_module, transformers' TP styles and
Megatron-Core's layers, against reference/tp.py.

Axes: every op; meshes from one rank to eight, with tp=3 for torch.chunk's uneven shards and dp x tp
for the gradient sum over dp; fp32 and bf16. Our implementation and DTensor run every mesh. The
third-party ones (``hf``, ``megatron``, behind the ``thirdparty`` extra) run tp 1-4 and dp2 x tp2:
the meshes where their code paths differ (none, even, uneven, dp) without the 8-rank cells' cost;
``hf`` also runs every transformers style that carries an op (switch ``style``); the two alias names
(colwise_rep = colwise_gather_output, rowwise_rep = rowwise_split_input: equal instances of one class)
only at tp=2. Cells an implementation declares known-divergent run as strict xfail (the parity fixture
marks them).
"""
import pytest

from harness.matrix import cells
from harness.parallel.thirdparty import HF_ALIASES, HF_STYLES
from reference.tp import OPS, SIZES

MESHES = ["tp=1", "tp=2", "tp=3", "tp=4", "tp=8", "dp=2,tp=2", "dp=2,tp=4", "dp=4,tp=2"]
THIRDPARTY_MESHES = ["tp=1", "tp=2", "tp=3", "tp=4", "dp=2,tp=2"]
DTYPES = ["fp32", "bf16"]
CELLS = cells("tp", impls=["ours", "dtensor"], meshes=MESHES, dtypes=DTYPES, sizes=SIZES, switches={"op": OPS})
CELLS += cells("tp", impls=["megatron"], meshes=THIRDPARTY_MESHES, dtypes=DTYPES, sizes=SIZES, switches={"op": OPS})
for op, styles in HF_STYLES.items():
    for names, meshes in (([s for s in styles if s not in HF_ALIASES], THIRDPARTY_MESHES),
                          ([s for s in styles if s in HF_ALIASES], ["tp=2"])):
        if names:
            CELLS += cells("tp", impls=["hf"], meshes=meshes, dtypes=DTYPES, sizes=SIZES,
                           switches={"op": [op], "style": names})


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_tp(cfg, parity):
    parity(cfg)
