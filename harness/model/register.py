"""A model case as a Component: ``model_component``, ``register_model`` and ``model_cells``.

Each model is a :class:`harness.registry.Component` named for it, whose implementations are the keys
of the case's ``parallelize``; its rank task, reference, rules, reduction size and meshes are
:mod:`harness.model.tasks`' entry points bound to the case by path
(``"harness.model.tasks:run[mypkg.cases:CASE]"``), so ids, the pool, the ``parity`` fixture,
goldens, report, torchrun and bisect take a model cell as they take a component cell.
"""
from __future__ import annotations

from typing import Iterable

from ..config import Config, ConfigError
from ..matrix import cells
from ..paths import load
from ..registry import Component, Implementation, get, register_component
from .case import ModelCase

# bisect lowers ep by these values (mesh degrees and steps shrink by themselves)
SIMPLEST = {"ep": ("1", "2", "4", "8"), "etp": ("1",)}
TASKS = "harness.model.tasks"


def model_component(name: str, case: str, impls: Iterable[str], deadline_factor: float = 1.0,
                    skip: str | None = None, preload: Iterable[str] = (), fresh: bool = False) -> Component:
    """The Component of model ``name``: the :class:`ModelCase` at ``case`` (``"mypkg.cases:CASE"``)
    with implementations ``impls`` (its ``parallelize`` names), each skipped where ``skip`` says;
    the pools import the modules ``preload`` names before they fork; ``fresh``: each of its tasks
    runs on ranks no task ran on (:attr:`harness.registry.Component.fresh`)."""

    def task(entry: str) -> str:
        return f"{TASKS}:{entry}[{case}]"

    preload = (preload,) if isinstance(preload, str) else tuple(preload)
    if not all(isinstance(m, str) and all(part.isidentifier() for part in m.split(".")) for m in preload):
        raise ValueError(f"model {name!r}: preload={preload!r} must name modules, "
                         "e.g. preload=('transformers',) or preload=('mypkg.heavy',)")

    return Component(
        name=name,
        reference=task("reference"),
        calibration=task("calibration"),
        validate=task("check"),
        reduction=task("reduction_size"),
        meshes=task("meshes"),
        simplest=dict(SIMPLEST),
        diagnose=f"harness.model.diagnose:diagnose[{case}]",  # the parent's, not the ranks'
        space=task("space"),
        deadline_factor=deadline_factor,
        case=case,
        preload=preload,
        fresh=fresh,
        implementations={impl: Implementation(impl, task("run"), skip=skip, xfail=task("xfail"),
                                              validate=task("check_impl"))
                         for impl in impls},
    )


def register_model(name: str, case: str, impls: Iterable[str] | None = None,
                   deadline_factor: float = 1.0, preload: Iterable[str] = (), fresh: bool = False) -> Component:
    """Register the :class:`ModelCase` at ``case`` (``"mypkg.cases:CASE"``, importable on the ranks)
    as model ``name``; its cells are ``model_cells(name, ...)``, ids ``<name>-<impl>-<mesh>-...``.

    ``impls``: the case's ``parallelize`` names, given to register without importing the case now.
    ``deadline_factor``: its cells may run that many times ``--case-deadline``. ``preload``: modules
    its ranks import that its case module imports only inside functions (a library that takes
    seconds to import, kept out of the pytest process): the pools import them once, before they
    fork their ranks, instead of every rank importing them in its first cell. ``fresh``: each of its
    cells runs on rank processes no cell ran in (the pool replaces them first: about 2 s a cell), for
    a library that keeps state across builds in a process, which the harness cannot see or put back."""
    try:
        taken = get(name)
    except ConfigError:  # the name is free
        taken = None
    if taken is not None and taken.case != case:
        # a second registration would silently replace the first one's cells everywhere it is used
        raise ValueError(f"register_model({name!r}, case={case!r}): {name!r} is already registered for "
                         f"{taken.case or 'a component'}; choose another name (it is the first field of the cells' ids)")
    if impls is None:
        found = load(case)
        if not isinstance(found, ModelCase):
            raise TypeError(f"register_model({name!r}, case={case!r}): {case} is a {type(found).__name__}, "
                            "not a harness.model.ModelCase")
        impls = list(found.parallelize)
    return register_component(model_component(name, case, impls, deadline_factor, preload=preload, fresh=fresh))


def case_of(name: str) -> ModelCase:
    """The :class:`ModelCase` registered as model ``name``."""
    return load(get(name).case)


def model_cells(name: str, *, impls: Iterable[str] | None = None, meshes: Iterable[str] = ("dp=2",),
                dtypes: Iterable[str] = ("fp32",), steps: int | None = None,
                switches: dict[str, Iterable[str]] | None = None, seed: int = 0) -> list[Config]:
    """The cells of model ``name``, like :func:`harness.matrix.cells`: every implementation (all of
    the case's by default) × mesh × dtype × switch value. ``meshes`` name their dims ``pp``, ``rep``,
    ``dp``, ``cp``, ``tp``, in that order (``"dp=2,tp=2"``, :mod:`harness.names`); ``switches``
    ``ep`` and ``etp`` set the expert mesh (``{"ep": ["2"]}``); ``steps`` defaults to the case's."""
    __tracebackhide__ = True  # a bad mesh or switch: pytest shows the user's line and the message
    case = case_of(name)
    return cells(name, impls=list(impls if impls is not None else case.parallelize), meshes=meshes, dtypes=dtypes,
                 sizes={"steps": steps or case.steps}, switches=dict(switches or {}), seed=seed)
