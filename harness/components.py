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
    },
))
