"""The built-in components. Each mirrors reference/<name>.py and parallel/<name>.py."""
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
    implementations={
        "ours": Implementation("ours", "parallel.ring_attention:run"),
        "torch": Implementation("torch", "parallel.ring_attention_torch:run",
                                skip="parallel.ring_attention_torch:skip_reason", omits=("lse",)),
    },
))
