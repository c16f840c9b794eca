"""A model case as a Component: ``register_model`` and ``model_cells``.

Each registered model is a :class:`harness.registry.Component` named for it, whose implementations
are the keys of the case's ``parallelize``; its reference, rules, reduction size, meshes and rank
task are the case's own methods (``"mypkg.cases:CASE.run"``: dotted paths the rank processes
import), so ids, the pool, the ``parity`` fixture, goldens, report, torchrun and bisect take a
model cell as they take a component cell.
"""
from __future__ import annotations

from typing import Iterable

from ..config import Config
from ..matrix import cells
from ..registry import COMPONENTS, Component, Implementation, _load, register_component
from .case import ModelCase

# model name -> "module:ATTR" of its ModelCase
MODELS: dict[str, str] = {}

# bisect lowers ep by these values (mesh degrees and steps shrink by themselves)
SIMPLEST = {"ep": ("1", "2", "4", "8"), "etp": ("1",)}


def case_of(name: str) -> ModelCase:
    """The :class:`ModelCase` registered as ``name``."""
    from ..registry import get

    get(name)  # the built-in models register on first use
    return _load(MODELS[name])


def register_model(name: str, case: str, impls: Iterable[str] | None = None,
                   deadline_factor: float = 1.0) -> Component:
    """Register the :class:`ModelCase` at ``case`` (``"mypkg.cases:CASE"``, importable on the ranks)
    as model ``name``; its cells are ``model_cells(name, ...)``, ids ``<name>-<impl>-<mesh>-...``.

    ``impls``: the case's ``parallelize`` names, given to register without importing the case now
    (the built-in models: a harness import does not pay for torch's pipelining and FSDP modules).
    ``deadline_factor``: its cells may run that many times ``--case-deadline``."""
    taken = MODELS.get(name, "a component" if name in COMPONENTS else None)
    if taken is not None and taken != case:
        # a second registration would silently replace the first one's cells everywhere it is used
        raise ValueError(f"register_model({name!r}, case={case!r}): {name!r} is already registered for {taken}; "
                         "choose another name (it is the first field of the cells' ids)")
    if impls is None:
        found = _load(case)
        if not isinstance(found, ModelCase):
            raise TypeError(f"register_model({name!r}, case={case!r}): {case} is a {type(found).__name__}, "
                            "not a harness.model.ModelCase")
        impls = list(found.parallelize)
    MODELS[name] = case
    return register_component(Component(
        name=name,
        reference=f"{case}.reference_result",
        validate=f"{case}.check",
        reduction=f"{case}.reduction_size",
        meshes=f"{case}.meshes",
        simplest=dict(SIMPLEST),
        explain="harness.model.diverging:explain",
        deadline_factor=deadline_factor,
        implementations={impl: Implementation(impl, f"{case}.run", xfail=f"{case}.xfail_reason",
                                              validate=f"{case}.check_impl")
                         for impl in impls},
    ))


def model_cells(name: str, *, impls: Iterable[str] | None = None, meshes: Iterable[str] = ("dp=2",),
                dtypes: Iterable[str] = ("fp32",), steps: int | None = None,
                switches: dict[str, Iterable[str]] | None = None, seed: int = 0) -> list[Config]:
    """The cells of model ``name``, like :func:`harness.matrix.cells`: every implementation (all of
    the case's by default) × mesh × dtype × switch value. ``meshes`` name their dims ``pp``, ``rep``
    (rep), ``dp`` (dp), ``cp``, ``tp``, in that order (``"dp=2,tp=2"``); ``switches``
    ``ep`` and ``etp`` set the expert mesh (``{"ep": ["2"]}``); ``steps`` defaults to the case's."""
    case = case_of(name)
    return cells(name, impls=list(impls if impls is not None else case.parallelize), meshes=meshes, dtypes=dtypes,
                 sizes={"steps": steps or case.steps}, switches=dict(switches or {}), seed=seed)


def is_model(name: str) -> bool:
    return name in MODELS and name in COMPONENTS
