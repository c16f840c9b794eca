"""Whole models (harness.model): each model's own parallelize functions against it on one process.

Each model's cells are in a list of their own (one line each below, so models added on other
branches merge as one-line changes). Axes, and why:

* titan (harness/examples/titan.py, torchtitan's way): TP with sequence parallel and loss_parallel (tp2),
  composed with FSDP2 (dp2.tp2, in fp32 and bf16 autocast), HSDP (rep2.dp2), the 1F1B pipeline
  with FSDP2 (pp2.dp2) and with TP and FSDP2 on three dims at 8 ranks (pp2.dp2.tp2), HSDP × TP at 8
  ranks, and the interleaved 1F1B schedule (pp2, pp2.dp2); titanmp, the same model in FSDP2's mixed
  precision (bf16 compute, fp32 reduction and step) on dp2 and rep2.dp2.
"""
import pytest

from harness.model import model_cells

TITAN = (model_cells("titan", impls=["titan"], meshes=["tp=2", "rep=2,dp=2", "pp=2,dp=2", "pp=2,dp=2,tp=2",
                                                      "rep=2,dp=2,tp=2"])
         + model_cells("titan", impls=["titan"], meshes=["dp=2,tp=2"], dtypes=["fp32", "bf16"])
         + model_cells("titan", impls=["interleaved"], meshes=["pp=2", "pp=2,dp=2"]))
# the same model as bf16 users of FSDP2 train it: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
TITANMP = model_cells("titanmp", meshes=["dp=2", "rep=2,dp=2"], dtypes=["bf16"])

# transformers' tiny Llama (harness/examples/llama_hf.py): its own TP plan, FSDP2, HSDP and TP x FSDP2; Qwen3-MoE
# (harness/examples/qwen3moe_hf.py): its EP plan (all_to_all) x FSDP2, expert copies summed over efsdp or not
from harness.examples import llama_hf, qwen3moe_hf  # noqa: E402

HF = llama_hf.cells() + qwen3moe_hf.cells()

# users' code (harness/examples/pretrained_hf.py): save_pretrained on rank 0, from_pretrained(tp_plan="auto") on all
from harness.examples import pretrained_hf  # noqa: E402

HFPRETRAINED = pretrained_hf.cells()

# Qwen3-MoE as transformers builds it (harness/examples/qwen3moe_grouped_hf.py): default grouped_mm experts under EP
from harness.examples import qwen3moe_grouped_hf  # noqa: E402

QWEN3MOEGMM = qwen3moe_grouped_hf.cells()

# torchtitan's way of making meshes (harness/examples/titan_world.py): ParallelDims from a job config and the world
from harness.examples import titan_world  # noqa: E402

TITANWORLD = titan_world.cells()

# accelerate's ND parallelism (harness/examples/accelerate_hf.py): ParallelismConfig -> Accelerator -> prepare
from harness.examples import accelerate_hf  # noqa: E402

ACCELERATE = accelerate_hf.cells()

# the project's own components composed (harness/examples/composed/): the 5D seed pp2·ep2·cp2 with FSDP over
# dp·cp, the 3D seed pp2·dp2·tp2 (autograd and its manual-backward MLP), dp2ep on dp2·cp2·tp2, and a
# reshard of FSDP4·TP2·EP2 to HSDP2×2·TP2·EP2; the 16-rank pp2·dp2·cp2·tp2·ep4 cell runs under torchrun
# (tests/test_composed.py)
from harness.examples.composed.case import cells as composed_cells, quick_cells as composed_quick_cells  # noqa: E402

COMPOSED = composed_cells()
# and what --quick runs in their place: 3 steps, not 10 (harness.selection.select_quick)
COMPOSED_QUICK = [pytest.param(cfg, marks=pytest.mark.quick_only) for cfg in composed_quick_cells()]

CELLS = TITAN + TITANMP + HF + COMPOSED + COMPOSED_QUICK + HFPRETRAINED + QWEN3MOEGMM + TITANWORLD + ACCELERATE


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_model(cfg, parity):
    parity(cfg)
