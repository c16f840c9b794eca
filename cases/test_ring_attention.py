"""Context parallelism: harness/parallel/ring_attention.py (and torch's context_parallel) against reference/ring_attention.py.

Axes: 8 meshes (cp 1, 2, 3, 4, 8; dp and tp beside cp) x mask (causal, full) x layout (contig,
zigzag) x GQA (on, off) x fp32/bf16 x s in {24, 48}, less the cp=8 zigzag cells at s=24 (16 chunks
do not split 24 tokens; tests/test_config.py covers the rule): ``FULL``, 248 cells per implementation.
The gate runs its covering design (harness.matrix.design): on every mesh, 6 cells in which every
pair of values of two axes meets, e.g. causal with zigzag, bf16 with GQA, s=48 with zigzag at cp=8,
and the first is fp32 causal zigzag GQA at s=48.
The ring's bugs need cp > 1 and at most two switch values together (a zigzag mask bug: causal and
zigzag), so each still turns every cp > 1 mesh red (tests/test_matrix_design.py plants them);
``pytest --full-matrix`` runs all 248 (the nightly job).
"""
import pytest

from harness.config import ConfigError
from harness.matrix import cells, design
from harness.resolve import check_config
from reference.ring_attention import SIZES

MESHES = ["cp=1", "cp=2", "cp=3", "cp=4", "cp=8", "dp=2,cp=2", "cp=2,tp=2", "cp=4,tp=2"]
# the hardest value of each axis first: the covering design's greedy choice starts, on every mesh,
# from fp32 causal zigzag GQA at s=48, the cell with the tightest tolerance on the ring's trickiest path
SWITCHES = {"mask": ["causal", "full"], "layout": ["zigzag", "contig"], "gqa": ["on", "off"]}


def matrix(impl):
    out = []
    for s in (48, 24):
        for cfg in cells("ringattn", impls=[impl], meshes=MESHES, dtypes=["fp32", "bf16"],
                         sizes=dict(SIZES, s=s), switches=SWITCHES):
            try:
                check_config(cfg)
            except ConfigError:  # s=24 has no 2·cp=16 zigzag chunks at cp=8; test_config covers the rule
                continue
            out.append(cfg)
    return out


FULL = matrix("ours") + matrix("torch")
CELLS = design(FULL)


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_ring_attention(cfg, parity):
    parity(cfg)
