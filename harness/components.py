"""The built-in components. Each mirrors reference/<name>.py and parallel/<name>.py."""
from dataclasses import replace

from .registry import Component, Implementation, register_component

register_component(Component(
    name="tp",
    reference="reference.tp:reference",
    validate="parallel.tp:validate",
    reduction="reference.tp:reduction_size",
    implementations={
        "ours": Implementation("ours", "parallel.tp:run"),
        "dtensor": Implementation("dtensor", "parallel.tp_dtensor:run", skip="parallel.tp_dtensor:skip_reason"),
        # third-party libraries (pip install -e '.[thirdparty]'); skips and known divergences as data
        "hf": Implementation("hf", "parallel.tp_hf:run", skip="parallel.thirdparty:hf_skip",
                             xfail="parallel.thirdparty:hf_xfail"),
        "megatron": Implementation("megatron", "parallel.tp_megatron:run", skip="parallel.thirdparty:megatron_skip",
                                   xfail="parallel.thirdparty:megatron_xfail"),
    },
))

register_component(Component(
    name="ringattn",
    reference="reference.ring_attention:reference",
    validate="parallel.ring_attention:validate",
    reduction="reference.ring_attention:reduction_size",
    simplest={"mask": ("full", "causal"), "layout": ("contig", "zigzag"), "gqa": ("off", "on")},
    implementations={
        "ours": Implementation("ours", "parallel.ring_attention:run"),
        "torch": Implementation("torch", "parallel.ring_attention_torch:run",
                                skip="parallel.ring_attention_torch:skip_reason", omits=("lse",)),
    },
))

register_component(Component(
    name="moe",
    reference="reference.moe:reference",
    validate="parallel.moe:validate",
    reduction="reference.moe:reduction_size",
    meshes="parallel.thirdparty:moe_meshes",  # parallel.moe:meshes, plus transformers' 1-rank tp dim for hf
    simplest={"cap": ("none", "100", "125"), "score": ("softmax", "sigmoid"), "norm": ("off", "on")},
    implementations={
        "ours": Implementation("ours", "parallel.moe:run"),
        # transformers' apply_expert_parallelism (pip install -e '.[thirdparty]'): dropless, no `dropped`
        "hf": Implementation("hf", "parallel.moe_hf:run", skip="parallel.thirdparty:hf_moe_skip",
                             omits=("dropped",), xfail="parallel.thirdparty:hf_moe_xfail"),
    },
))

register_component(Component(
    name="fsdp",
    reference="reference.fsdp:reference",
    validate="parallel.fsdp:validate",
    reduction="reference.fsdp:reduction_size",
    implementations={
        "ours": Implementation("ours", "parallel.fsdp:run"),
        "fsdp2": Implementation("fsdp2", "parallel.fsdp_torch:run", skip="parallel.fsdp_torch:skip_reason"),
    },
))

register_component(Component(
    name="pp",
    reference="reference.pipeline:reference",
    validate="parallel.pipeline:validate",
    reduction="reference.pipeline:reduction_size",
    simplest={"sched": ("gpipe", "1f1b", "interleaved"), "tied": ("off", "on")},
    implementations={
        "ours": Implementation("ours", "parallel.pipeline:run"),
        "torch": Implementation("torch", "parallel.pipeline_torch:run", skip="parallel.pipeline_torch:skip_reason"),
    },
))

register_component(Component(
    name="ckpt",
    reference="reference.checkpoint:reference",
    validate="parallel.checkpoint:validate",
    reduction="reference.checkpoint:reduction_size",
    meshes="parallel.checkpoint:meshes",
    implementations={
        "dcp": Implementation("dcp", "parallel.checkpoint:run"),
    },
))

# ---- whole models (harness.model): models/<name>.py, each a ModelCase and its parallelize functions ----
from .model.register import register_model  # noqa: E402  (after the registry is filled: no cycle)

register_model("titan", "models.titan:CASE", impls=("titan", "interleaved"))
# transformers' own models (pip install -e '.[thirdparty]'; without it their cells skip saying so)
for _name, _case, _impls in (("llama", "models.llama_hf:CASE", ("tp", "fsdp", "tpfsdp")),
                             ("qwen3moe", "models.qwen3moe_hf:CASE", ("ep",))):
    _model = register_model(_name, _case, impls=_impls)
    _model.implementations = {k: replace(i, skip="models.hf:skip") for k, i in _model.implementations.items()}
