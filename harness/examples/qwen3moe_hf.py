"""transformers' tiny Qwen3-MoE with its expert-parallel plan × FSDP2: a model case to copy.

``Qwen3MoeForCausalLM`` from a ``Qwen3MoeConfig`` (2 layers, both MoE: 4 experts, top-2, hidden 16;
nothing downloaded), trained on next-token cross-entropy, parallelized by transformers' own
``maybe_distribute_model`` (``harness.examples.llama_hf.distribute``) with ``DistributedConfig(ep_size=...,
fsdp_size=..., ep_implementation="all_to_all")``: the model's ``base_model_ep_plan`` (experts sharded
over ``ep`` by ``grouped_gemm``, tokens exchanged by ``ep_dispatch_experts`` with all-to-all), then
its FSDP2 plan, the experts on the ``efsdp`` mesh (the copies of the same experts, which sum their
gradients) and the rest on ``dp``. The cell's mesh is ``dp=N`` with the switch ``ep_<M>``:
ep borrows its ranks from dp ("dp2ep"), and ``efsdp`` = N/M.

The model has no load-balancing loss (``output_router_logits=False``, as ``moe``'s ``aux_off``):
transformers computes it per rank, on the rank's own batch, which is not the global loss one
process computes (``harness/parallel/moe_hf.py`` shows the difference). The router is initialised with
std 1/sqrt(hidden) rather than transformers' 0.02, so that top-2 choices are decided by margins far
above fp32 rounding: a near tie routes a token differently in fp32 and in the fp64 reference,
which no parallel code can be blamed for.
"""
from __future__ import annotations

import torch

from harness.model import ModelCase, model_cells, switches

from harness.examples.llama_hf import batch, distribute, forward, loss

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, EXPERTS, TOP_K = 64, 16, 16, 2, 4, 2, 4, 2


def config(eager: bool = True, experts: str = "eager"):
    """The tiny config; ``eager``: eager attention, and the experts kernel ``experts`` (eager,
    batched: batched_mm, grouped: transformers' default grouped_mm); else transformers' defaults
    (sdpa, grouped_mm)."""
    from harness.examples.hf import Qwen3MoeConfig

    kernel = {"eager": "eager", "batched": "batched_mm", "grouped": "grouped_mm"}[experts]
    kernels = {"attn_implementation": "eager", "experts_implementation": kernel} if eager else {}
    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * FFN,
                          moe_intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS, num_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1,
                          max_position_embeddings=32, output_router_logits=False, tie_word_embeddings=False,
                          **kernels)


def build(eager: bool = True, experts: str = "eager"):
    from harness.examples.hf import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(config(eager, experts))
    with torch.no_grad():
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.mlp.gate.weight, std=HIDDEN ** -0.5)
    return model


def ep(model, meshes):
    """transformers' EP plan (all_to_all) over ``ep``, FSDP2 over ``dp`` (experts over ``efsdp``)."""
    spec = meshes.spec
    return distribute(model, meshes, ep_size=spec.ep, fsdp_size=spec.dp, dp_replicate_size=spec.rep,
                      ep_implementation="all_to_all")


def _ep_fits(spec):
    """The meshes transformers lays EP out on: dp (and rep) only, no etp."""
    if spec.tp > 1 or spec.cp > 1 or spec.pp > 1:
        return "the EP plan here runs on dp (and rep) meshes only, ep borrowed from dp"
    if spec.etp > 1:
        return "transformers has no expert tensor parallelism with EP"
    return None


def build_switched():
    """The model with the experts kernel the cell's ``experts`` switch names (eager by default)."""
    return build(experts=switches()["experts"])


# exploration draws the experts kernel and the expert mesh (python -m harness.explore qwen3moe)
CASE = ModelCase(build=build_switched, batch=batch, loss=loss, forward=forward, parallelize={"ep": ep},
                 supports={"ep": _ep_fits},
                 switches={"experts": ("eager", "batched", "grouped"), "ep": ("1", "2", "4")},
                 fp32_ops=("_grouped_mm",))


def cells():
    """The qwen3moe cells of ``cases/test_models.py``: EP alone (efsdp 1), EP with expert copies
    summed over efsdp = 2, and EP over the whole world."""
    return (model_cells("qwen3moe", meshes=["dp=2"], switches={"ep": ["2"]})
            + model_cells("qwen3moe", meshes=["dp=4"], switches={"ep": ["2", "4"]})
            # reshard round trip: experts over ep=2 with two copies saved, loaded with one copy each
            + model_cells("qwen3moe", meshes=["dp=4"], switches={"ep": ["2"], "reshard": ["dp2"]})
            # bf16 autocast: one process already departs from fp64 in the routing weights' gradient
            # (err/tol ~17 under the dtype's rounding alone), which the calibrated tolerance allows
            + model_cells("qwen3moe", meshes=["dp=4"], dtypes=["bf16"], switches={"ep": ["2"]}))
