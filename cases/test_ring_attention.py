"""Context parallelism: parallel/ring_attention.py (and torch's context_parallel) against reference/ring_attention.py."""
import pytest

from harness.config import ConfigError
from harness.matrix import cells
from harness.registry import validate
from reference.ring_attention import SIZES

MESHES = ["cp=1", "cp=2", "cp=3", "cp=4", "cp=8", "dp=2,cp=2", "cp=2,tp=2", "cp=4,tp=2"]
SWITCHES = {"mask": ["causal", "full"], "layout": ["contig", "zigzag"], "gqa": ["on", "off"]}


def matrix(impl):
    out = []
    for s in (24, 48):
        for cfg in cells("ringattn", impls=[impl], meshes=MESHES, dtypes=["fp32", "bf16"],
                         sizes=dict(SIZES, s=s), switches=SWITCHES):
            try:
                validate(cfg)
            except ConfigError:  # s=24 has no 2·cp=16 zigzag chunks at cp=8; test_config covers the rule
                continue
            out.append(cfg)
    return out


CELLS = matrix("ours") + matrix("torch")


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_ring_attention(cfg, parity):
    parity(cfg)
