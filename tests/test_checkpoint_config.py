"""Checkpoint cells: each config rule rejects a bad cell before any rank runs, naming the rule and the fix."""
import re

import pytest

from harness.config import Config, ConfigError
from harness.resolve import check_config
from reference.checkpoint import SIZES


def cfg(save="fsdp2", load="fsdp4", world=4, dtype="fp32", **sizes):
    return Config("ckpt", "dcp", (("w", world),), dtype, dict(SIZES, **sizes), {"save": save, "load": load})


@pytest.mark.parametrize("bad, message", [
    (cfg(save="zero3"), "checkpoint layout 'zero3' is not one of fsdp<n>, hsdp<r>x<s>, fsdptp<d>x<t>, ours<n>, "
                        "ourshsdp<r>x<s> (e.g. fsdp4, hsdp2x4, fsdptp2x2, ours3)"),
    (cfg(load="fsdp0"), "checkpoint layout fsdp0: every degree must be at least 1"),
    (cfg(load="fsdp5", world=5), "layout fsdp5 splits the batch b=24 over 5 data-parallel ranks: choose b a multiple "
                                 "of 5 (gradients are averaged, so the shards must be equal)"),
    (cfg(load="fsdptp2x2", f=9), "layout fsdptp2x2: tp=2 does not divide f=9: choose f a multiple of tp "
                                 "(DTensor TP here assumes even tp shards)"),
    (cfg(load="ours4", dtype="bf16"), "cells with our FSDP run in fp32"),
    (cfg(world=8), "a checkpoint cell's mesh is the larger layout's world, w=4, not w=8"),
    (cfg(load="fsdp8", world=8).replace(sizes=dict(SIZES, b=20)), "splits the batch b=20 over 8 data-parallel ranks"),
])
def test_rule(bad, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(bad)


def test_larger_world_than_the_pool_is_refused():
    with pytest.raises(ConfigError, match=re.escape("needs 8 ranks but the pool has 4; pass --pool-size 8")):
        check_config(cfg(load="hsdp2x4", world=8), pool_size=4)


def test_every_case_cell_is_valid():
    from cases.test_checkpoint import CELLS

    assert len(CELLS) == len({c.id for c in CELLS}) == 99
    for c in CELLS:
        check_config(c, pool_size=8)
