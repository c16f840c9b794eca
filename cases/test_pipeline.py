"""Pipeline parallelism: harness/parallel/pipeline.py (and torch.distributed.pipelining) against reference/pipeline.py.

How the axes were chosen:

* pp ∈ {1, 2, 3, 4, 8}: no pipeline, the smallest, an odd one, and the pool's width; microbatches
  m ∈ {pp, 2·pp, pp+1}: just full, two rounds, and a count that is not a multiple of pp (a last
  round of another size, the case where loss scaling and the interleaved rounds go wrong).
* schedules gpipe, 1f1b, and interleaved with vs=2 virtual stages per rank (at pp=1 both stages sit
  on one rank and hand over locally). The model has l = 2·pp layers, so every schedule of one
  (pp, m) runs the same model (one reference each).
* tied embedding/head on and off: on, the first and last stage hold copies of E whose gradients must
  be summed between the two ranks (with pp=1 they are one tensor).
* pp ≤ 4: the whole (pp, m, schedule) grid in fp32 with tied on; tied off (a separate head on the
  last stage: nothing m-dependent) and bf16 at m = pp+1. pp=8, fp32, tied on: one pp=8 cell holds the whole pool for as long as several
  smaller ones. No bf16 at pp=8: the rounding of its 16 bf16 layers alone reaches 0.6-0.7 of the
  bf16 tolerance in the gradients (measured; a single-process bf16 run of the same model does the
  same), too close to 1 to tell from a bug.
* dp × pp (dp=2,pp=2 with dp outermost, pp=4,dp=2 with pp outermost: peers that a hand-written
  "rank ± 1" map gets wrong on one of them), and pp × tp 2×2 with the tensor-parallel layers of
  harness/parallel/tp.py inside each stage; m ∈ {pp, pp+1} in fp32, pp+1 in bf16.
* torch.distributed.pipelining: each pp and mesh at m = pp+1 with tied on, fp32 (bf16 at pp=4 and
  pp×tp); its pp=1 interleaved tied cell skips with the measured reason.

A failing cell of our implementation shows its schedule's time x rank table under the failure.
"""
import pytest

from harness.config import Config
from harness.matrix import cells
from harness.parallel.pipeline import schedule
from harness.parallel.pipeline_schedule import simulate, table
from reference.pipeline import SIZES

PP = (1, 2, 3, 4, 8)


def microbatches(pp: int) -> list[int]:
    return sorted({pp, 2 * pp, pp + 1})


def schedules(pp: int) -> list[str]:
    return ["gpipe", "1f1b", "interleaved"]


def grid(impl: str, mesh: str, pp: int, dtypes, tied, ms=None, dp: int = 1) -> list[Config]:
    out = []
    for m in ms or microbatches(pp):
        for sched in schedules(pp):
            sizes = dict(SIZES, b=dp * m, m=m, l=2 * pp, vs=2 if sched == "interleaved" else 1)
            out += cells("pp", impls=[impl], meshes=[mesh], dtypes=dtypes, sizes=sizes,
                         switches={"sched": [sched], "tied": tied})
    return out


def matrix() -> list[Config]:
    out = []
    for pp in PP[:-1]:
        out += grid("ours", f"pp={pp}", pp, ["fp32"], ["on"])
        out += grid("ours", f"pp={pp}", pp, ["fp32"], ["off"], ms=[pp + 1])
        out += grid("ours", f"pp={pp}", pp, ["bf16"], ["on"], ms=[pp + 1])
    out += grid("ours", "pp=8", 8, ["fp32"], ["on"])
    for mesh, pp, dp in (("dp=2,pp=2", 2, 2), ("pp=4,dp=2", 4, 2)):
        out += grid("ours", mesh, pp, ["fp32"], ["on"], ms=[pp, pp + 1], dp=dp)
        out += grid("ours", mesh, pp, ["bf16"], ["on"], ms=[pp + 1], dp=dp)
    out += grid("ours", "pp=2,tp=2", 2, ["fp32"], ["on", "off"], ms=[2, 3])
    out += grid("ours", "pp=2,tp=2", 2, ["bf16"], ["on"], ms=[3])
    # torch.distributed.pipelining: every pp and mesh, m = pp + 1, tied
    for pp in PP:
        out += grid("torch", f"pp={pp}", pp, ["fp32"], ["on"], ms=[pp + 1])
    out += grid("torch", "pp=4", 4, ["bf16"], ["on"], ms=[5])
    out += grid("torch", "dp=2,pp=2", 2, ["fp32"], ["on"], ms=[3], dp=2)
    out += grid("torch", "pp=4,dp=2", 4, ["fp32"], ["on"], ms=[5], dp=2)
    out += grid("torch", "pp=2,tp=2", 2, ["fp32", "bf16"], ["on"], ms=[3])
    return out


CELLS = matrix()


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_pipeline(cfg, parity):
    try:
        parity(cfg)
    except pytest.fail.Exception as failure:
        if cfg.impl != "ours":
            raise
        pytest.fail(f"{failure.msg}\n\nthe schedule this cell ran:\n{table(simulate(schedule(cfg)))}", pytrace=False)
