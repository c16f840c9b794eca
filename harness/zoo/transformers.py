"""The transformers zoo: every architecture of the installed transformers that ships a parallel plan,
built tiny from its own config and trained under that plan against one process.

One function makes every case (:func:`case`, loaded by the ranks as
``"harness.zoo.transformers:case(<model_type>)"``); :func:`zoo_cells` registers each architecture as
model ``hf<model type's letters and digits>`` (:func:`name_of`) and returns its cells:

* ``tp``: the model's ``base_model_tp_plan`` through ``maybe_distribute_model`` with a
  ``DistributedConfig(tp_size=...)``, at tp=2 and tp=4;
* ``tpauto``: the same plan through the other entry point, ``save_pretrained`` then
  ``from_pretrained(distributed_config=DistributedConfig(tp_plan="auto"))``, at tp=2;
* ``ep``: the model's ``base_model_ep_plan`` with FSDP2 (all-to-all), ep=2 borrowed from dp=2;
* ``tpep``: both plans at once, ``DistributedConfig(tp_size=2, ep_size=2)``: the experts over the
  tensor-parallel ranks (ep borrowed from tp, ``etp=1``), the rest under the TP plan;
* ``tpfixed``: ``tp`` with a :class:`Known` bug's ``tp_plan`` override, at tp=2: must pass.

A tiny config is the architecture's default config with :data:`SIZES` given for every field it has,
:data:`OVERRIDES` for the families a generic shrink cannot build, and every field that draws random
numbers in training mode (:data:`RANDOM`) set to 0. An architecture that still does not build, or
whose built model still holds a dropout, is a skip that says why: never a red.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import re
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from harness.examples import llama_hf, pretrained_hf, qwen3moe_hf
from harness.known import Known
from harness.model import ModelCase, model_cells
from harness.model.register import model_component
from harness.registry import get, register_component

# the generic shrink: a field of these names the architecture's config has takes this value
SIZES = dict(
    vocab_size=llama_hf.VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, head_dim=8, max_position_embeddings=64,
    moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
    topk_group=1, kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
    sliding_window=16, output_router_logits=False, use_cache=False,
)
# a tiny model has about 10^4 to 10^5; more says the shrink missed a size field
MOST_PARAMETERS = 2_000_000
# fields that draw random numbers in training mode: dropouts and router jitter
RANDOM = re.compile(r".*(dropout|jitter).*")
# per family, the size fields the generic shrink does not know (the meta-device size check names
# the parameters they leave large)
OVERRIDES: dict[str, dict] = {
    # its MoE block is off by default (enable_moe_block): on, so the EP plan and the experts' TP entries
    # name something
    "gemma4_text": {"vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 8, "global_head_dim": 8,
                    "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16},
    # MoE from the third layer as shipped: the tiny model's two layers were both dense, so its EP
    # cells ran no expert; a dense layer, then a sparse one
    "flint": {"mlp_only_layers": [0]},
    "step3p5": {"share_expert_dim": 16},
    "zaya": {"num_experts_per_tok": 1},  # its only supported routing
    # gemma4_text's MoE block, off by default
    "diffusion_gemma_text": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16},
    "deepseek_v4": {"head_dim": 8, "o_lora_rank": 16, "index_head_dim": 8, "index_topk": 4},
    "muse_spark_text": {"moe_hidden_size": 16},
    "granitemoehybrid": {"mamba_n_heads": 8, "mamba_d_head": 8},
    # layer_types None by default (the model indexes it): a conv layer, then an attention one; the
    # first dense, the second MoE
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # gemma4_text's per-layer inputs; no layer sharing another's key/value cache (its 15 of 35 would
    # share with a layer the tiny model does not have); the first layer keeps its activation sparsity
    "gemma3n_text": {"vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 0,
                     "laurel_rank": 8, "activation_sparsity_pattern": [0.95, 0.0]},
    # its size fields under names of its own; multi-head latent attention whose rope part is head_dim
    "longcat_flash": {"num_layers": 2, "ffn_hidden_size": 32, "moe_topk": 2, "n_routed_experts": 4,
                      "zero_expert_num": 2, "expert_ffn_hidden_size": 16, "qk_head_dim": 8, "head_dim": 4},
    # multimodal rope sections the model holds for full-size heads ([16, 24, 24]), not in its config
    "paddleocr_vl_text": {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default",
                                              "mrope_section": [2, 1, 1]}},
    # rope parameters per layer type, empty by default (the model reads them by type)
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 50000.0,
                                                                   "mrope_section": [2, 1, 1]}}},
    # its sliding-window layers have twice the full layers' kv heads: the shrink's 4 kv heads of 4 made
    # 8 for 4 query heads there (no whole group a head); 8 query heads, 4 kv heads (8 in the sliding
    # layers), so that tp=4 splits whole heads in both kinds
    "mimo_v2_flash": {"num_attention_heads": 8, "num_key_value_heads": 4},
    # mlp_layer_types and num_experts_per_tok None by default (the model indexes the one and routes by
    # the other; its checkpoints set both): a dense layer, then a sparse one, top-2
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"], "num_experts_per_tok": 2},
    # its DSA attention takes no rope (the shrink's qk_rope_head_dim of 4 is rejected); the indexer's top-k a
    # whole number of its pools; its linear-attention (KDA) heads tiny; a KDA layer then a DSA one, a dense MLP
    # then a sparse one, as its layers alternate at full size
    "glm5_next_text": {"qk_rope_head_dim": 0, "qk_nope_head_dim": 8, "v_head_dim": 8, "index_topk": 16, "index_kpool": 4,
                       "linear_head_dim": 8, "linear_num_heads": 4, "index_head_dim": 8, "index_n_heads": 2,
                       "layer_types": ["linear_attention", "indexed_attention"], "mlp_layer_types": ["dense", "sparse"]},
    # its global layers rotate a quarter of each head in M-RoPE pairs: a multiple of 4 dims needs a head of 16
    "neomme": {"head_dim": 16},
    # its MoE sizes under names of its own, the text and vision experts' intermediate sizes a list; rope
    # sections (h, w, t) for a head of 8 (its default [22, 22, 20] is for a head of 128)
    "ernie4_5_vl_moe_text": {"moe_intermediate_size": [16, 16], "moe_num_experts": 4, "moe_k": 2,
                             "moe_num_shared_experts": 1,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [1, 1, 2]}},
    # its encoder reads config.dropout_rate, a field its config does not declare (transformers' slip): given
    "t5gemma2_text": {"dropout_rate": 0.0},
    # its language model's sizes in its own config, its vision and audio towers' in sub-configs the
    # shrink does not reach (870 M parameters left): the towers tiny too (token ids alone reach neither)
    "phi4_multimodal": {
        "vision_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                          "image_size": 28, "patch_size": 14, "crop_size": 28},
        "audio_config": {"hidden_size": 16, "intermediate_size": 32, "num_blocks": 1, "num_attention_heads": 2,
                         "ext_pw_out_channel": 16, "depthwise_separable_out_channel": 16, "nemo_conv_channels": 16}},
}


@dataclass(frozen=True)
class KnownBug:
    """A divergence or crash of one architecture's shipped plans, found by the zoo and traced in
    transformers' source: its cells run as strict xfails held to ``shows`` (a regular expression
    found in the failure: its first line, where the divergence starts, or the crash's own line;
    :class:`harness.known.Known`), on the releases
    it was ``seen`` on and every later one. A release that fixes it turns its cells into an XPASS the
    zoo reports as ``fixed``; one that fails them otherwise, a red or crash saying so.

    ``fix``: the ``tp_plan`` entries that make the TP plan right, where one exists: the zoo also
    runs the plan with them (implementation ``tpfixed``), which must pass."""

    model_type: str
    plans: tuple[str, ...]  # of PLANS
    seen: tuple[str, ...]  # the transformers releases the zoo ran it on, and saw it: ("5.23.0",)
    reason: str
    shows: str
    fix: dict[str, str] = field(default_factory=dict)

    def declared(self, installed: str) -> Known:
        """Its declaration for a cell on transformers ``installed``: the reason says whether this
        release is one it was seen on."""
        seen = ", ".join(self.seen)
        where = (f"transformers {installed}" if installed in self.seen
                 else f"transformers {installed}, a release it has not been seen on yet (seen on {seen})")
        return Known(f"{where}: {self.reason}", shows=self.shows)


_NORMS = "q_norm and k_norm (RMSNorm over each head) run on each rank's heads and are left plain by the plan"
# the releases a bug was seen on: 5.23.0 and, rerun with the same first line, 5.24.0
SEEN = ("5.23.0", "5.24.0")
KNOWN: tuple[KnownBug, ...] = (
    # silent: gradients left per-rank partial sums (each fix turns the cell green)
    *(KnownBug(model_type, ("tp", "tpauto"), seen,
               "the MLP's xIELU activation has parameters (alpha_p, alpha_n) and runs on each rank's shard of the "
               "up projection; the plan leaves it plain, so their gradients stay per-rank partial sums over tp",
               r"^first diverging module: model\.layers\.\d+\.mlp\.act_fn \(parameter gradients, step 1\)",
               fix={"model.layers.*.mlp.act_fn": "replicated_with_grad_allreduce"})
      for model_type, seen in (("apertus", SEEN), ("apertus1p5_text", ("5.24.0",)))),
    *(KnownBug(model_type, plans, seen,
               f"{_NORMS} (Qwen3's own plan has replicated_with_grad_allreduce): their weights' gradients stay "
               "per-rank partial sums over tp",
               r"^first diverging module: (model\.)?layers\.\d+\.self_attn\.[qk]_norm \(parameter gradients, step 1\)",
               fix={f"{prefix}layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
                    f"{prefix}layers.*.self_attn.k_norm": "replicated_with_grad_allreduce"})
      for model_type, plans, seen, prefix in (("qwen3_vl_moe_text", ("tp", "tpauto", "tpep"), SEEN, ""),
                                              ("qwen3_omni_moe_text", ("tp", "tpauto", "tpep"), SEEN, ""),
                                              # built as a Glm4MoeForCausalLM, whose plan names "model.layers";
                                              # its tpauto cell crashes in the load's conversion first: not traced
                                              ("sarvam_moe", ("tp", "tpep"), ("5.24.0",), "model."))),
    KnownBug("hrm_text", ("tpauto",), SEEN,
             "save_pretrained writes q/k/v/gate and gate/up fused (gqkv_proj, gate_up_proj: conversion_mapping.py); "
             "from_pretrained(tp_plan='auto') shards the fused tensor before chunking it, so each rank loads the "
             "wrong rows of every colwise projection (one process loads them right, and so does "
             "maybe_distribute_model on a built model)",
             r"LoadMismatch: .*model\.L_module\.layers\.0\.self_attn\.q_proj\.weight: rows "),
    KnownBug("inkling2_text", ("tp",), ("5.23.0",),
             "the plan shards the experts' fused gate_up_proj 'colwise' where Qwen3-MoE's has 'packed_colwise': each "
             "rank holds a contiguous half of [gate; up], and the experts' chunk(2) pairs gate rows with gate rows, "
             "so the forward is wrong (its router runs in fp32, so the zoo's reference runs that op from its fp32 "
             "kernel as the model asks)",
             r"^first diverging module: model\.layers\.0\.mlp\.experts\.act_fn\.gate_softcap \(output, step 1",
             fix={"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise"}),
    KnownBug("inkling2_text", ("tpauto",), ("5.23.0",),
             "from_pretrained loads each rank the packed halves of the experts' fused gate_up_proj, so its forward "
             "is right, but labels them with the plan's 'colwise' placement: gathered (full_tensor, as "
             "save_pretrained gathers) the parameter comes out with its rows in the wrong places (the load check)",
             r"LoadMismatch: .*model\.layers\.0\.mlp\.experts\.gate_up_proj: rows "),
    KnownBug("gemma3n_text", ("tp", "tpauto"), SEEN,
             "the MLP's activation sparsity (_gaussian_topk, on in the first 10 of 35 layers as shipped) cuts the "
             "gate at mean + std * icdf(0.95) over the intermediate dim, which the plan shards (gate_proj "
             "colwise): each rank takes the mean and std of its own shard, so the cutoff, and every activation "
             "after it, differ from one process's; no tp_plan entry fixes it (the statistics need an all-reduce)",
             r"^first diverging module: model\.layers\.0\.mlp\.act_fn \(output, step 1"),
    # crashes at tp=2
    KnownBug("doge", ("tp", "tpauto"), SEEN,
             "crash: dt_proj is rowwise, so the dynamic attention mask it makes holds every head while q/k/v are "
             "colwise (each rank's heads): eager_attention_forward adds a 4-head mask to 2-head scores (at tp=4 "
             "it broadcasts over 1-head scores, and o_proj gets 4 heads' worth)",
             r"in module model\.layers\.0\.self_attn(\.o_proj)?: RuntimeError: (The size of tensor a \(2\) must match "
             r"the size of tensor b \(4\)|shape '\[32, 8\]' is invalid)"),
    KnownBug("embedding_gemma2_text", ("tp", "tpauto"), SEEN,
             "crash: the full-attention layers have one key/value head of 512 (per_layer_config); the colwise "
             "k_proj/v_proj split it across ranks and .view(..., -1, head_dim) fails",
             r"in module layers\.1\.self_attn: RuntimeError: shape '\[4, 8, -1, 512\]' is invalid"),
    KnownBug("esmc", ("tp", "tpauto"), SEEN,
             "crash: q_norm/k_norm are LayerNorms over the whole hidden size, applied to the colwise q/k "
             "projections' local halves",
             r"in module layers\.0\.self_attn\.q_norm: RuntimeError: Given normalized_shape=\[32\]"),
    *(KnownBug(model_type, ("tp", "tpauto", "tpep"), SEEN,
               "crash: the token embedding applies its own RMSNorm (embed_norm) inside its forward, on the rowwise "
               "embedding's partial sums before the style reduces them: DTensor cannot reduce a Partial there",
               r"in module (model\.)?embed_tokens\.embed_norm: AssertionError")
      for model_type in ("inkling_text", "muse_glimmer_text", "muse_spark_text")),
    *(KnownBug(model_type, ("ep",), SEEN,
             "crash: its EP plan also shards the dense MLP beside the experts (gate_proj and up_proj colwise, "
             "down_proj rowwise) over the ep ranks, which ep borrows from dp; apply_fully_sharded_data_parallelism "
             "then shards those DTensors again over dp, the same ranks, and fully_shard cannot compose the two",
             r"RuntimeError: Cannot concatenate overlapping meshes: \[DeviceMesh\(\(dp=2\)")
      for model_type in ("gemma4_text", "diffusion_gemma_text")),
    KnownBug("neomme", ("tp", "tpauto"), SEEN,
             "crash: q/k/v are colwise (each rank's heads), but two per-head tensors the plan leaves whole meet "
             "them: exclusive self-attention's alpha (one scale per attention head; its view(1, 1, -1, 1) meets 2 "
             "heads at tp=2, and at tp=4 broadcasts 1 head to 4, so output_projection gets 4 heads' worth), and the "
             "value embeddings added to the first and last global layers' values (every kv head). Sharding alpha "
             "(colwise, its attention local_params) moves the crash to the value embeddings; no style keeps an "
             "embedding's hidden-dim shard local, so no tp_plan entry fixes it",
             r"in module layers\.0\.self_attn\.(exclusive_self_attention|output_projection): RuntimeError: The size of "
             r"tensor a \((4|64)\) must match the size of tensor b \((2|16)\)"),
    KnownBug("glm5_next_text", ("tp", "tpauto", "tpep"), SEEN,
             "crash: the plan's layers.*.self_attn.o_proj rowwise also matches the linear-attention (KDA) layers "
             "(three of every four as shipped), whose q/k/v projections it leaves whole: o_proj's half of the "
             "weight gets every head's output",
             r"in module layers\.0\.self_attn\.o_proj: RuntimeError: shape '\[32, (16|8)\]' is invalid"),
    KnownBug("t5gemma2_text", ("tp", "tpauto"), SEEN,
             "crash: its token embedding writes its own eoi_embedding (a plain parameter the plan leaves whole) into "
             "the rows of the eoi token inside its forward (input_embeddings[mask] = ...), on the rowwise "
             "embedding's DTensor output: index_put mixes a tensor and a DTensor, and its backward raises",
             r"RuntimeError: aten\.index_put\.default got mixed torch\.Tensor and DTensor"),
    KnownBug("llama4_text", ("tp", "tpauto"), SEEN,
             "crash: the MoE block adds the routed experts' output in place (out.add_) to the shared expert's "
             "output, a view _ToTorchTensor returns under autograd",
             r"in module model\.layers\.0\.feed_forward: RuntimeError: Output 0 of _ToTorchTensor is a view"),
)


def known(model_type: str, plan: str) -> KnownBug | None:
    """The :class:`KnownBug` of ``model_type``'s ``plan`` on the installed transformers: one seen on
    this release or an earlier one."""
    from packaging.version import Version
    from transformers import __version__

    return next((k for k in KNOWN if k.model_type == model_type and plan in k.plans
                 and Version(__version__) >= min(map(Version, k.seen))), None)


class Unbuildable(Exception):
    """An architecture the zoo cannot build tiny: the cell skips with this reason."""


def architectures(plan: str | None = None) -> list[str]:
    """The model types of the installed transformers whose config ships a ``base_model_<plan>_plan``
    (``plan`` None: a TP or an EP plan). Imports every config class: seconds, where
    :func:`has_plan` of a few model types imports theirs alone."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return sorted(m for m in CONFIG_MAPPING.keys() if has_plan(m, plan))


def has_plan(model_type: str, plan: str | None = None) -> bool:
    """Whether ``model_type``'s config ships a ``base_model_<plan>_plan`` (``plan`` None: a TP or an EP
    plan); False for a model type transformers does not know or whose config cannot import."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config_class = CONFIG_MAPPING[model_type]
    except Exception:  # noqa: BLE001  unknown (KeyError), or a config whose module cannot import (a missing extra)
        return False
    return bool(shipped(config_class) & ({plan} if plan else {"tp", "ep"}))


def shipped(config_class) -> set[str]:
    """The parallel plans a config class ships: ``"tp"`` for a ``base_model_tp_plan``, ``"ep"`` for a
    ``base_model_ep_plan``."""
    return {plan for plan in ("tp", "ep") if getattr(config_class, f"base_model_{plan}_plan", None)}


def tiny_config(model_type: str, layers: str = "kinds"):
    """The architecture's config, shrunk (see the module docstring); raises :class:`Unbuildable`.
    ``layers``: for an architecture that mixes layer kinds (``layer_types``), ``"kinds"`` keeps one
    layer of each kind, in the order it first uses them (two layers cut from the front can miss
    one); ``"front"`` keeps the first two (for architectures whose other per-layer fields follow
    the front)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    fields = set(default.to_dict()) | set(inspect.signature(config_class.__init__).parameters)
    sizes = {k: v for k, v in SIZES.items() if k in fields}
    if "qk_rope_head_dim" in fields:  # multi-head latent attention: its head_dim is the rope part's
        sizes.pop("head_dim", None)
    sizes |= {k: 0.0 for k, v in default.to_dict().items() if RANDOM.fullmatch(k) and isinstance(v, float)}
    # token ids of the full vocabulary (bos, eos, pad, an image's) name no token of the tiny one
    beyond = [k for k, v in default.to_dict().items()
              if k.endswith("_token_id") and isinstance(v, int) and v >= SIZES["vocab_size"]]
    sizes |= {k: SIZES["vocab_size"] - 1 - i for i, k in enumerate(beyond)}  # the last ids, one each
    if "mrope_section" in getattr(config_class, "ignore_keys_at_rope_validation", ()):
        # multimodal rope: its sections (a default the model holds for full-size heads) split the
        # rotary half of a head, which the tiny head makes smaller
        rope = dict(default.to_dict().get("rope_parameters") or {})
        half = int(sizes.get("head_dim", SIZES["head_dim"]) * rope.get("partial_rotary_factor", 1.0)) // 2
        sizes["rope_parameters"] = rope | {"mrope_section": [half - 2 * (half // 3)] + [half // 3] * 2}
    if isinstance(default.to_dict().get("layer_types"), list):
        kinds = list(dict.fromkeys(default.layer_types))
        kept = kinds if layers == "kinds" and len(kinds) > 1 else default.layer_types[:SIZES["num_hidden_layers"]]
        sizes |= {"layer_types": kept, "num_hidden_layers": len(kept)}
    if isinstance(default.to_dict().get("mlp_layer_types"), list):
        # dense and sparse MLPs per layer (MoE from the fourth layer, say): one layer of each kind, so
        # that the plans' dense and expert entries both name a module of the tiny model
        kinds = list(dict.fromkeys(default.mlp_layer_types))
        count = sizes.get("num_hidden_layers", SIZES["num_hidden_layers"])
        sizes["mlp_layer_types"] = (kinds * count)[:count]
    sizes |= OVERRIDES.get(model_type, {})
    try:
        return config_class(**sizes)
    except Exception as error:  # noqa: BLE001  a strict validator: the reason is the skip's
        raise Unbuildable(f"its config rejects the tiny sizes: {type(error).__name__}: {error}") from error


def model_class(model_type: str):
    """What builds the architecture: its causal LM where it has one, else its base model (a text
    tower of a multimodal model, an encoder: what the plan is written for), by the auto mappings or,
    for a config no mapping names, the class of its modeling module that declares that config (a
    causal LM first). Each answers ``_from_config(config, attn_implementation=...)``."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING,
                                                        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING,
                                                        MODEL_MAPPING_NAMES)
    from transformers.modeling_utils import PreTrainedModel

    config_class = CONFIG_MAPPING[model_type]
    # a model type of the user's own, registered with the auto classes (--import), is theirs to say
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or config_class in MODEL_FOR_CAUSAL_LM_MAPPING._extra_content:
        return AutoModelForCausalLM
    if model_type in MODEL_MAPPING_NAMES or config_class in MODEL_MAPPING._extra_content:
        return AutoModel
    try:
        modeling = importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_"))
    except ImportError as error:
        raise Unbuildable(f"no model class for {config_class.__name__}: {error}") from error
    declared = [c for c in vars(modeling).values() if isinstance(c, type) and issubclass(c, PreTrainedModel)
                and getattr(c, "config_class", None) is config_class]
    declared.sort(key=lambda c: (not c.__name__.endswith("ForCausalLM"), not c.__name__.endswith("Model"), c.__name__))
    if not declared:
        raise Unbuildable(f"no auto mapping names {config_class.__name__} and {modeling.__name__} declares no "
                          "model of it")
    return declared[0]


# per family, inputs besides the token ids that route tokens through a part of the model its plans shard
INPUTS: dict[str, Callable[[torch.Tensor], dict]] = {
    # its vision experts (vision_moe, sharded as the text experts are) take the tokens marked as vision
    # tokens: every other token, so that both sets of experts get some
    "ernie4_5_vl_moe_text": lambda ids: {"moe_mm_token_type_ids": (torch.arange(ids.shape[-1]) % 2).expand_as(ids)},
}


def forward(model, batch):
    """The logits of a causal LM; a base model's last hidden state."""
    ids = batch["input"]
    extra = INPUTS.get(model.config.model_type)
    out = model(input_ids=ids, **(extra(ids) if extra else {}))
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def loss(output, batch):
    """Next-token cross-entropy on logits; on a base model's hidden states (no vocabulary), their
    mean square: a mean over every token, as one process computes it."""
    if output.shape[-1] == llama_hf.VOCAB:
        return llama_hf.loss(output, batch)
    return output.float().pow(2).mean()


def build_tiny(model_type: str) -> torch.nn.Module:
    """The architecture's causal LM (or base model: :func:`model_class`), tiny, eager attention; its
    routers initialised wide enough that top-k choices do not hang on fp32 rounding (as
    harness.examples.qwen3moe_hf does)."""
    # what it takes first: a tower of pixels or audio is not the zoo's, whatever its config would reject
    _takes_token_ids(_concrete(model_type))
    failed = None
    for layers in ("kinds", "front"):
        try:
            return _built(model_type, tiny_config(model_type, layers))
        except Unbuildable as error:
            failed = failed or error
    raise failed


def _takes_token_ids(made) -> None:
    """:class:`Unbuildable` where model class ``made`` (None: not known yet) takes no ``input_ids``."""
    if made is not None and "input_ids" not in inspect.signature(made.forward).parameters:
        raise Unbuildable(f"{made.__name__} takes no token ids (pixels, audio): the zoo feeds token ids")


def _concrete(model_type: str):
    """The class :func:`model_class` builds for ``model_type`` (an auto class's, by its mapping), or None
    where it cannot say without a config."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        made = model_class(model_type)
    except Unbuildable:
        return None
    mapping = getattr(made, "_model_mapping", None)
    if mapping is None:
        return made
    try:
        found = mapping[CONFIG_MAPPING[model_type]]
    except (KeyError, ValueError):
        return None
    return found if isinstance(found, type) else None  # a mapping to several classes: the config decides


def _built(model_type: str, config) -> torch.nn.Module:
    """:func:`build_tiny` from one tiny config."""
    if language := _language_part(config):
        raise Unbuildable(f"a multimodal composite whose language model is {language}, which the zoo runs as an "
                          "architecture of its own (the composite's sizes live in its parts' configs)")
    made = model_class(model_type)
    build = made.from_config if made.__name__.startswith("Auto") else made._from_config
    try:
        with torch.device("meta"):  # its size first: a field the shrink missed can ask for gigabytes
            sized = build(config, attn_implementation="eager")
        _takes_token_ids(type(sized))  # where its class was known only from its config
        count = sum(p.numel() for p in sized.parameters())
        if count > MOST_PARAMETERS:
            raise Unbuildable(f"the generic shrink leaves {count:,} parameters (at most {MOST_PARAMETERS:,}): "
                              "a size field it does not know needs an entry in OVERRIDES")
        model = build(config, attn_implementation="eager")
    except Unbuildable:
        raise
    except Exception as error:  # noqa: BLE001
        first = (str(error).splitlines() or [""])[0]
        raise Unbuildable(f"not built by {made.__name__}: {type(error).__name__}: {first}") from error
    random = [f"{n} (p={m.p})" for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    if random:
        raise Unbuildable(f"draws random numbers in training mode: dropout at {', '.join(random[:3])}")
    hidden = getattr(config, "hidden_size", 32)
    with torch.no_grad():
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if re.search(r"\.(gate|router)(\.classifier)?$", name) and isinstance(weight, torch.Tensor) \
                    and weight.dim() == 2:
                torch.nn.init.normal_(weight, std=hidden ** -0.5)
    return model


def _language_part(config) -> str | None:
    """The model type of a composite config's language part (its ``text_config``) where the zoo runs
    that part as an architecture of its own (its config class ships a plan, as :func:`architectures`
    asks); else None."""
    text = getattr(config, "text_config", None)
    kind = getattr(text, "model_type", None)
    return kind if kind and kind != config.model_type and shipped(type(text)) else None


class _Tried(NamedTuple):
    """What the parent learns from building an architecture tiny once (:func:`_tried`)."""

    unbuilt: str | None  # why it is not built, or does not run on one process; None when it does
    names: tuple[str, ...]  # its modules' and parameters' names (none when not built)
    plans: dict[str, dict]  # "tp", "ep" -> the built model's ``_tp_plan``, ``_ep_plan``


@functools.cache
def _tried(model_type: str) -> _Tried:
    """The architecture built tiny and run on one process, once per process, in the parent, before
    any rank is asked to; what :func:`unbuilt` and :func:`unexercised` read from it (the model is
    not kept)."""
    try:
        model = build_tiny(model_type)
    except Unbuildable as error:
        return _Tried(str(error), (), {})
    names = tuple(n for n, _ in model.named_modules()) + tuple(n for n, _ in model.named_parameters())
    plans = {plan: dict(getattr(model, attr, None) or {}) for plan, attr in (("tp", "_tp_plan"), ("ep", "_ep_plan"))}
    try:
        forward(model, llama_hf.batch(0))
    except Exception as error:  # noqa: BLE001  the shrink's doing, or the architecture's: no plan's
        first = (str(error).splitlines() or [""])[0]
        return _Tried(f"the tiny model does not run on one process: {type(error).__name__}: {first}", names, plans)
    return _Tried(None, names, plans)


@functools.cache
def _moved(model_type: str) -> dict[str, bool]:
    """Each parameter of the architecture's tiny build (one that runs on one process), with whether
    two steps on one process give it a gradient other than zero; {} where the steps fail. Two steps:
    a parameter behind one that starts at zero (an output projection initialised so) gets its first
    gradient at step 2. The report's alone (:func:`unexercised`): resolving a cell never pays for it."""
    model = build_tiny(model_type)
    moved = dict.fromkeys((n for n, _ in model.named_parameters()), False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(2):
            batch = llama_hf.batch(step)
            loss(forward(model, batch), batch).backward()
            for n, p in model.named_parameters():
                moved[n] = moved[n] or (p.grad is not None and bool(p.grad.any()))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    except Exception:  # noqa: BLE001  the cells' own reference says why; here nothing is known of the gradients
        return {}
    return moved


def unbuilt(model_type: str) -> str | None:
    """Why the zoo cannot build ``model_type`` tiny (:class:`Unbuildable`) or run it on one process,
    or None."""
    return _tried(model_type).unbuilt


# how unexercised() marks an entry whose parameters two steps on one process leave without a gradient
STILL = " (no gradient)"


def unexercised(model_type: str) -> dict[str, list[str]]:
    """The entries of the architecture's TP and EP plans (``_tp_plan``, ``_ep_plan`` of the model it
    builds, by plan) that no cell of the zoo exercises: those that name no module or parameter of its
    tiny build (what the tiny config turns off: the dense MLPs beside MoE layers, an n-gram
    embedding), and, marked :data:`STILL`, those whose parameters (the named ones, or those under the
    named modules) all get zero gradients from two steps on one process: experts no token reaches (a
    multimodal model's vision experts, fed text), where a wrong sharding passes unseen. {} where every
    entry is exercised, or where it is not built. An entry names what its ``*`` (a layer's index) and
    the rest match, as transformers matches it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return {}
    tried, missed = _tried(model_type), {}
    moved = _moved(model_type) if tried.unbuilt is None else {}
    for plan, entries in tried.plans.items():
        out = []
        for entry in entries:
            pattern = re.compile(re.escape(entry).replace(r"\*", r"\d+"))
            named = [n for n in tried.names if pattern.fullmatch(n)]
            judged = [p for p in moved if any(p == n or p.startswith(n + ".") for n in named)]
            if not named:
                out.append(entry)
            elif judged and not any(moved[p] for p in judged):
                out.append(entry + STILL)
        if out:
            missed[plan] = out
    return missed


def _expertless(model_type: str) -> str | None:
    """Why an expert cell of ``model_type`` would check nothing of expert parallelism: no expert the
    EP plan names is in the tiny build (a config that turns its MoE layers off, or leaves them past
    the tiny model's layers). Such a cell would pass as the dense model it runs."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    plan = getattr(CONFIG_MAPPING[model_type], "base_model_ep_plan", None) or {}
    experts = [e for e in plan if e.endswith("experts")]  # the dispatch entry: ep_dispatch_experts
    missed = unexercised(model_type).get("ep", [])
    if experts and all(any(m.endswith(e) for m in missed) for e in experts):
        return (f"the tiny build has no expert its EP plan names ({', '.join(experts)}): a cell would run the "
                "dense model; OVERRIDES must switch its MoE layers on")
    return None


def skip_reason(cfg) -> str | None:
    """A zoo cell's skip: the architecture's (``Implementation.skip``), or, for an expert plan's
    cell, a tiny build without experts."""
    model_type = get(cfg.component).case.partition("(")[2].rstrip(")")
    if reason := unbuilt(model_type):
        return f"not built tiny: {reason}"
    return _expertless(model_type) if cfg.impl in EXPERT_PLANS else None


def tp_with(model, meshes, tp_plan: dict[str, str]):
    """The model's TP plan with ``tp_plan``'s entries put over it, as a user's ``DistributedConfig``
    does."""
    return llama_hf.distribute(model, meshes, tp_size=meshes.spec.tp, tp_plan=tp_plan)


def tp_and_ep(model, meshes):
    """The TP plan and the EP plan together, the experts over the tensor-parallel ranks."""
    spec = meshes.spec
    return llama_hf.distribute(model, meshes, tp_size=spec.tp, ep_size=spec.ep, ep_implementation="all_to_all")


def _tp_only(spec):
    used = [d for d in ("pp", "rep", "dp", "cp") if getattr(spec, d) > 1]
    return f"the TP plan here runs on tp meshes only, not {', '.join(used)}" if used else None


def case(model_type: str) -> ModelCase:
    """The zoo's case for one architecture: its own plans as implementations (module docstring)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    parallelize = {"tp": llama_hf.tp, "tpauto": pretrained_hf.parallelize}
    supports = {"tp": _tp_only, "tpauto": _tp_only}
    if "ep" in shipped(config_class):
        parallelize |= {"ep": qwen3moe_hf.ep, "tpep": tp_and_ep}
        supports |= {"ep": qwen3moe_hf._ep_fits, "tpep": _tp_only}
    xfail = {}
    for plan in list(parallelize):
        found = known(model_type, plan)
        if found is not None:
            xfail[plan] = lambda cfg, found=found: found.declared(version())
            if found.fix:
                parallelize["tpfixed"] = functools.partial(tp_with, tp_plan=found.fix)
                supports["tpfixed"] = _tp_only
    # transformers' default experts kernel, as its users run it: the reference runs it from fp32
    return ModelCase(build=lambda: build_tiny(model_type), batch=llama_hf.batch, loss=loss, forward=forward,
                     parallelize=parallelize, supports=supports, xfail=xfail, fp32_ops=("_grouped_mm",))


def name_of(model_type: str) -> str:
    """The model name of an architecture in cell ids: ``hf`` and its model type's letters and digits
    (``qwen3_moe`` -> ``hfqwen3moe``): a cell id's first field takes nothing else."""
    return "hf" + re.sub(r"[^a-z0-9]", "", model_type.lower())


def version() -> str:
    """The installed transformers' release (a zoo's report names it)."""
    import transformers

    return transformers.__version__


# each plan's cells, and the shipped plans they need: a square of one of them with no cell reads
# "not shipped" in the report
PLANS = {"tp": {"tp"}, "tpauto": {"tp"}, "ep": {"ep"}, "tpep": {"tp", "ep"}}
EXPERT_PLANS = ("ep", "tpep")


def zoo_cells(only: list[str] | None = None, plans: tuple[str, ...] = tuple(PLANS), imports: tuple[str, ...] = ()):
    """Register every architecture with a TP or an EP plan (``only``: these model types) and return
    the cells of the plans it ships: ``tp`` at tp=2 and tp=4, ``tpauto`` at tp=2, ``ep`` at dp=2
    with ep=2, ``tpep`` at tp=2 with ep=2 (etp=1). ``imports``: modules that register model types of
    the user's own with transformers' auto classes (and their checkpoint conversion mappings),
    imported here and by every pool before it forks its ranks."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for module in imports:
        importlib.import_module(module)
    out, named = [], {}
    for model_type in only or architectures():
        if name_of(model_type) in named:
            raise ValueError(f"{model_type!r} and {named[name_of(model_type)]!r} both name {name_of(model_type)!r}")
        named[name_of(model_type)] = model_type
        ships = shipped(CONFIG_MAPPING[model_type])
        impls = [p for p in plans if PLANS[p] <= ships]
        if "tp" in impls and any(k.fix for k in KNOWN if k.model_type == model_type):
            impls.append("tpfixed")
        name = name_of(model_type)
        register_component(model_component(name, f"harness.zoo.transformers:case({model_type})", impls,
                                           skip="harness.zoo.transformers:skip_reason", preload=imports))
        if "tp" in impls:
            out += model_cells(name, impls=["tp"], meshes=["tp=2", "tp=4"])
        if "tpfixed" in impls:
            out += model_cells(name, impls=["tpfixed"], meshes=["tp=2"])
        if "tpauto" in impls:
            out += model_cells(name, impls=["tpauto"], meshes=["tp=2"])
        if "ep" in impls:
            out += model_cells(name, impls=["ep"], meshes=["dp=2"], switches={"ep": ["2"]})
        if "tpep" in impls:
            out += model_cells(name, impls=["tpep"], meshes=["tp=2"], switches={"ep": ["2"], "etp": ["1"]})
    return out
