"""Checkpoint reshard round trips: parallel/checkpoint.py against reference/checkpoint.py."""
import pytest

from harness.config import Config
from reference.checkpoint import SIZES

LAYOUTS = ["fsdp1", "fsdp2", "fsdp3", "fsdp4", "fsdp8", "hsdp2x2", "hsdp2x4", "fsdptp2x2", "fsdptp4x2"]


def world(layout):
    from parallel.checkpoint import parse_layout

    return parse_layout(layout).world


def cell(save, load):
    return Config("ckpt", "dcp", (("w", max(world(save), world(load))),), "fp32", SIZES,
                  {"save": save, "load": load})


CELLS = [cell(s, l) for s in LAYOUTS for l in LAYOUTS]


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_checkpoint(cfg, parity):
    parity(cfg)
