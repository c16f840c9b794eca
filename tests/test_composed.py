"""The composed model's 16-rank cell (pp2·dp2·cp2·tp2, ep4 borrowed from dp·cp, etp = tp): run in
the pool when it has 16 ranks (``--pool-size 16``; skipped at the default 8), and under torchrun on
16 processes by the slow test, which also reports the processes' peak memory."""
import pytest

from models.composed import cells16

CELLS16 = cells16()


@pytest.mark.parametrize("cfg", CELLS16, ids=str)
def test_composed_16_ranks(cfg, parity):
    parity(cfg)
