"""transformers' tiny Qwen3-MoE as transformers builds it, default ``grouped_mm`` experts, under its EP plan.

``harness/examples/qwen3moe_hf.py``'s model and EP plan with nothing switched: the config names no ``experts_implementation``
(transformers picks ``grouped_mm``, ``torch._grouped_mm`` on CPU) and no ``attn_implementation``
(``sdpa``). ``torch._grouped_mm`` has no fp64 kernel, so the fp64 reference runs it from its fp32
kernel (``fp32_ops``). Parallelized by transformers' ``maybe_distribute_model`` with
``DistributedConfig(ep_size=..., fsdp_size=..., ep_implementation="all_to_all")``: experts sharded
over ``ep`` (borrowed from dp), tokens exchanged by all-to-all, FSDP2 over dp (experts over efsdp).
No load-balancing loss, and the router drawn with std 1/sqrt(hidden), as in qwen3moe_hf.py (why: there).
"""
from __future__ import annotations

from harness.model import ModelCase, model_cells

from harness.examples.llama_hf import batch, forward, loss
from harness.examples.qwen3moe_hf import _ep_fits, build as build_qwen3moe, ep


def build():
    return build_qwen3moe(eager=False)


CASE = ModelCase(build=build, batch=batch, loss=loss, forward=forward, parallelize={"ep": ep},
                 supports={"ep": _ep_fits}, fp32_ops=("_grouped_mm",))


def cells():
    """The qwen3moegmm cells of ``cases/test_models.py``: EP over dp=2 (efsdp 1)."""
    return model_cells("qwen3moegmm", meshes=["dp=2"], switches={"ep": ["2"]})
