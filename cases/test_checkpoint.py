"""Checkpoint reshard round trips: harness/parallel/checkpoint.py against reference/checkpoint.py.

A cell is an ordered pair of layouts, saved under the first and loaded under the second (switches
``save`` and ``load``; the cell's mesh is ``w=<the larger world>``). How the axes were chosen:

* FSDP2 layouts, every ordered pair, the diagonal included (81 cells): FSDP over 1, 2, 3, 4, 8
  ranks (f=10 over 3, 4 and 8 gives uneven torch.chunk shards, h=6 over 8 empty ones), HSDP 2x2 and
  2x4 (replicas of each shard), FSDP x TP 2x2 and 4x2 (2-D DTensors, tp inside the dp shard). A
  reshard bug tends to depend on both sides' cuts, so every pair, not a sample.
* our FSDP (harness/parallel/fsdp.py) against FSDP2, both directions (18 cells): ours over 3 ranks (f=10 as
  4/4/2) and 4 ranks (3/3/3/1, and h=6 as 2/2/2/0: an empty shard) and HSDP 2x2, against FSDP2 over 2
  ranks, HSDP 2x2 and FSDP x TP 2x2, which between them cut every tensor differently from each of
  ours; all at world 4 or less (world-8 cells cost twice as much). Such cells use our FSDP's keys.
* fp32 only: a checkpoint holds the fp32 master state, and the load must restore it bit for bit.
"""
import pytest

from harness.config import Config
from harness.parallel.checkpoint import parse_layout
from reference.checkpoint import SIZES

FSDP2 = ["fsdp1", "fsdp2", "fsdp3", "fsdp4", "fsdp8", "hsdp2x2", "hsdp2x4", "fsdptp2x2", "fsdptp4x2"]
OURS = ["ours3", "ours4", "ourshsdp2x2"]
PARTNERS = ["fsdp2", "hsdp2x2", "fsdptp2x2"]


def cell(save: str, load: str) -> Config:
    world = max(parse_layout(save).world, parse_layout(load).world)
    return Config("ckpt", "dcp", (("w", world),), "fp32", SIZES, {"save": save, "load": load})


PAIRS = [(s, l) for s in FSDP2 for l in FSDP2]
PAIRS += [(o, p) for o in OURS for p in PARTNERS] + [(p, o) for o in OURS for p in PARTNERS]
CELLS = [cell(s, l) for s, l in PAIRS]


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_checkpoint(cfg, parity):
    parity(cfg)
