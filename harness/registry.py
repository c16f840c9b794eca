"""Components and their implementations, registered by name.

A component names its single-process reference, its config rules and its reduction size; each
implementation names a ``run(ctx, cfg) -> dict[str, Piece]`` by import path (``"module:function"``,
:mod:`harness.paths`), which the rank processes import themselves. A user adds an implementation of
their own from a ``conftest.py``, without editing this project::

    from harness.registry import register_implementation
    register_implementation("tp", "mine", "mypkg.tp_impl:run")

and its cells are then ``Config("tp", "mine", ...)``, run by the same cases.

The built-in components are the table ``harness.components:BUILTIN``, read on first use. A library
registers its own on install with an entry point of the group ``paritytest.components`` naming a
sequence of :class:`Component` values (``mylib.parity:COMPONENTS``) or a function that registers
(``mylib.parity:register``, calling :func:`register_implementation`), read on first use too::

    [project.entry-points."paritytest.components"]
    mylib = "mylib.parity:register"
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from importlib.metadata import entry_points

from .config import Config, ConfigError
from .layout import declared
from .paths import load, modules
from .world import alone

BUILTIN = "harness.components:BUILTIN"
ENTRY_POINTS = "paritytest.components"


@dataclass(frozen=True)
class Implementation:
    name: str
    run: str  # "module:function", run(ctx, cfg) on every rank of the mesh
    # "module:function" returning a reason to skip a config on this machine, or None
    skip: str | None = None
    # results of the reference this implementation cannot produce (e.g. SDPA returns no log-sum-exp)
    omits: tuple[str, ...] = ()
    # "module:function" returning why a config is known to diverge (the upstream behaviour), or None:
    # such cells run as strict xfail, so a fix upstream fails them with "remove this entry"
    xfail: str | None = None
    # "module:function" raising ConfigError for configs this implementation does not support (a
    # TP-only plan on a dp mesh): such cells are invalid for it, not skipped
    validate: str | None = None

    # what skip and xfail say of a cell is its disposition (harness.resolve.resolve(cfg).disposition);
    # these are the old spellings, kept for a release

    def skip_reason(self, cfg: Config) -> str | None:
        _renamed("Implementation.skip_reason(cfg)", "harness.resolve.resolve(cfg).disposition")
        return load(self.skip)(cfg) if self.skip else None

    def xfail_reason(self, cfg: Config) -> str | None:
        _renamed("Implementation.xfail_reason(cfg)", "harness.resolve.resolve(cfg).disposition")
        return load(self.xfail)(cfg) if self.xfail else None


@dataclass(frozen=True)
class Space:
    """What exploration (``python -m harness.explore``) may draw for a component's configs, beyond
    what its rules (``validate``) decide: the mesh dims a cell may name, each size's range, the
    values of switches that ``Component.simplest`` does not order, and the dtypes. Meshes go up to
    the pool size; whatever the ranges allow but the rules reject is never run."""

    dims: tuple[str, ...]  # mesh dim names a cell may use (any subset, any order the rules accept)
    sizes: dict[str, tuple[int, int]]  # size key -> (smallest, largest) value to draw
    switches: dict[str, tuple[str, ...]] = field(default_factory=dict)  # key -> every value
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    ordered: bool = False  # a mesh names its dims in the order of ``dims`` (a whole model's: slowest first)
    # draw these switches only, not also those ``Component.simplest`` orders for bisect (a whole
    # model's ep and etp, which a model without experts does not have)
    only_these: bool = False
    # draw one-rank worlds too: for a component whose one-rank run is not the reference's own code
    # (by default none is drawn; it runs no collective, so it can hardly diverge)
    one_rank: bool = False
    # switch -> the mesh dims it acts with (sequence parallelism: tp); elsewhere it changes nothing,
    # so --quick covers each of its values on a mesh where one of these has a degree above 1
    acts_with: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # whether a mesh runs is decided by the mesh and the switches, not the sizes (a model's
    # ``supports``): exploration then draws only meshes that run, instead of drafting and rejecting
    mesh_decides: bool = False


@dataclass
class Diagnosis:
    """What a component adds to a cell's verdict: ``text`` under a failing cell's table (where the
    divergence starts), and ``record``, extras for the cell's junit property (``harness.report``)."""

    text: str = ""
    record: dict = field(default_factory=dict)
    # the parameters whose tensors the failure's table lists first, in this order (where the
    # divergence starts first); empty: the comparison's own order
    order: list[str] = field(default_factory=list)


# a component's diagnosis when it declares none: where its events say the divergence starts
EVENTS_DIAGNOSIS = "harness.bisect.localise:diagnosis"


@dataclass
class Component:
    name: str
    reference: str  # "module:function", cfg -> dict[str, Tensor] of logical fp64 tensors
    validate: str  # "module:function", raises ConfigError
    # "module:function", cfg -> terms a result's reduction adds, for the tolerance: an int for every
    # result, or {tensor name: n} with "*" for the rest
    reduction: str
    implementations: dict[str, Implementation] = field(default_factory=dict)
    # "module:function", cfg -> the meshes the cell's ranks build besides cfg.mesh: a dims tuple
    # ((name, degree), ...) for a DeviceMesh (the layout a checkpoint is loaded under), or a
    # harness.meshes.MeshSpec for its dense, sparse and flattened meshes (a whole model's)
    meshes: str | None = None
    # For bisect: each switch's values, simplest first (a switch not named here is never changed).
    # Sizes are halved and mesh degrees lowered while the component's rules accept the config.
    simplest: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # "module:function", (cfg, pool, report, rerun) -> Diagnosis: what a cell adds to its verdict;
    # ``rerun`` says whether a failing cell may be run again to find where it diverges. None: where
    # its recorded events say it starts (EVENTS_DIAGNOSIS, the lines bisect and exploration print)
    diagnose: str | None = None
    # For exploration: the space its configs are drawn from, or the "module:function" path that returns
    # it (a whole model's, from its case); None: it cannot be explored yet
    space: Space | str | None = None
    # A cell's deadline is --case-deadline times this (a whole model's ten steps on 8 gloo ranks of a
    # loaded 2-core machine outlast the 30 s a component cell gets)
    deadline_factor: float = 1.0
    # a whole model's ModelCase ("module:CASE"); None for a component
    case: str | None = None
    # "module:function", cfg -> the reference's results computed on one process in the cell's dtype,
    # the rounding a right run makes (harness.compare.tolerance); None: the policy without it
    calibration: str | None = None
    # modules its ranks and its reference import that none of its paths names (a whole model's
    # library, which its case module imports inside functions so that collecting its cells and
    # resolving them in the pytest process stay cheap): the pools import them before they fork
    preload: tuple[str, ...] = ()
    # its every task on ranks no task ran on (the pool replaces them first): for libraries that keep
    # state across builds in a process, which the clean-start check cannot see or put back
    fresh: bool = False

    def switch_values(self) -> dict[str, tuple[str, ...]]:
        """Every value of every switch exploration draws: ``simplest``'s order where it gives one,
        else ``space``'s (``space``'s alone where it says ``only_these``)."""
        space = space_of(self)
        if space is not None and space.only_these:
            return dict(space.switches)
        return {**(space.switches if space else {}), **self.simplest}

    # What a path field gives for one cell is the resolved cell's member of the same name
    # (harness.resolve.Cell); these methods are the old spellings, kept for a release.

    def exploration_space(self) -> Space | None:
        _renamed("Component.exploration_space()", "harness.registry.space_of(component)")
        return space_of(self)

    def check(self, cfg: Config) -> None:
        _renamed("Component.check(cfg)", "harness.resolve.resolve(cfg).disposition (or check_config(cfg))")
        check_rules(self, cfg)

    def diagnosis(self, cfg: Config, pool, report, rerun: bool) -> Diagnosis:
        _renamed("Component.diagnosis(cfg, ...)", "harness.resolve.resolve(cfg).diagnose(pool, report, rerun)")
        return diagnosed(self, cfg, pool, report, rerun)

    def reference_result(self, cfg: Config):
        _renamed("Component.reference_result(cfg)", "harness.resolve.resolve(cfg).reference()")
        return reference_of(self.reference, cfg.problem)

    def calibration_result(self, cfg: Config):
        _renamed("Component.calibration_result(cfg)", "harness.resolve.resolve(cfg).calibration()")
        return reference_of(self.calibration, cfg.problem)

    def reduction_size(self, cfg: Config) -> int | dict[str, int]:
        _renamed("Component.reduction_size(cfg)", "harness.resolve.resolve(cfg).reduction")
        return load(self.reduction)(cfg)

    def extra_meshes(self, cfg: Config) -> tuple:
        _renamed("Component.extra_meshes(cfg)", "harness.resolve.resolve(cfg).meshes")
        return meshes_of(self, cfg)


def _renamed(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated and goes in the next release: use {new}", DeprecationWarning, stacklevel=3)


def space_of(component: Component) -> Space | None:
    """The space exploration draws ``component``'s configs from: its ``space``, or what that path returns."""
    return load(component.space)() if isinstance(component.space, str) else component.space


def check_rules(component: Component, cfg: Config) -> None:
    """The component's rules for ``cfg``, then its implementation's (raising :class:`ConfigError`)."""
    if cfg.impl not in component.implementations:
        raise ConfigError(f"{cfg.id}: no implementation {cfg.impl!r} of {component.name}; "
                          f"registered: {', '.join(sorted(component.implementations))}")
    load(component.validate)(cfg)
    own = component.implementations[cfg.impl].validate
    if own:
        load(own)(cfg)


def meshes_of(component: Component, cfg: Config) -> tuple:
    """What ``cfg``'s ranks build besides its mesh (the component's ``meshes``), each as a
    :class:`harness.layout.MeshDeclaration`; a declaration that is no mesh makes the cell invalid: a
    :class:`ConfigError` naming the component's path and what a mesh may be."""
    if not component.meshes:
        return ()
    out = []
    for mesh in load(component.meshes)(cfg):
        try:
            out.append(declared(mesh))
        except TypeError as error:
            raise ConfigError(f"{component.meshes} returned, for {cfg.id}, {error}") from None
    return tuple(out)


def diagnosed(component: Component, cfg: Config, pool, report, rerun: bool) -> Diagnosis:
    """What ``component`` adds to the verdict of ``cfg`` (its ``diagnose``), never raising: the
    comparison itself is the verdict."""
    try:
        return load(component.diagnose or EVENTS_DIAGNOSIS)(cfg, pool, report, rerun)
    except Exception as error:  # noqa: BLE001  a diagnosis that fails must not hide the failure
        return Diagnosis(f"(no diagnosis: {type(error).__name__}: {error})")


def reference_of(path: str, cfg: Config):
    """``path(cfg)`` in a world of one (:func:`harness.world.alone`): a reference sees one process
    whatever the cell's mesh, so code that reads the world is judged, never copied into it. Its
    result is computed from ``cfg.problem`` (the same for every mesh); bisect's events from the cell's
    ``cfg``, which say what each step of the cell's mesh should hold (a ring's steps over cp)."""
    with alone():
        return load(path)(cfg)


COMPONENTS: dict[str, Component] = {}
_builtins_read = False


def _read_builtins() -> None:
    """The built-in table, then every installed library's (entry points), once per process."""
    global _builtins_read
    if _builtins_read:
        return
    _builtins_read = True
    for component in load(BUILTIN):
        COMPONENTS.setdefault(component.name, component)
    for point in entry_points(group=ENTRY_POINTS):
        found = point.load()
        if isinstance(found, Component):
            COMPONENTS.setdefault(found.name, found)
        elif callable(found):
            found()
        else:
            for component in found:
                COMPONENTS.setdefault(component.name, component)


def register_component(component: Component) -> Component:
    """Add (or replace) ``component``."""
    _read_builtins()
    COMPONENTS[component.name] = component
    return component


_REGISTERED: list[tuple[str, str]] = []  # (component, implementation) added by users


def register_implementation(component: str, name: str, run: str, skip: str | None = None,
                            omits: tuple[str, ...] = (), xfail: str | None = None,
                            validate: str | None = None) -> None:
    """Add (or replace) implementation ``name`` of ``component``; ``run`` is imported on the ranks.

    ``run`` and ``skip`` are ``"module:function"`` paths importable in this environment (the
    plugin checks them once, before any cell runs); ``omits`` names reference results the
    implementation cannot produce; ``xfail`` (``"module:function"``, cfg -> reason or None) declares
    the cells it is known to get wrong (the ``parity`` fixture runs them as strict xfail);
    ``validate`` (``"module:function"``, cfg -> None, raising :class:`ConfigError`) declares the
    configs it supports: the others are invalid for it (reported before any rank runs), not skipped.
    """
    get(component).implementations[name] = Implementation(name, run, skip, tuple(omits), xfail, validate)
    _REGISTERED.append((component, name))


def unresolved() -> list[str]:
    """One message per user-registered implementation path that does not import, naming it."""
    problems = []
    for component, name in dict.fromkeys(_REGISTERED):
        impl = COMPONENTS[component].implementations.get(name)
        for what, path in (("run", impl.run), ("skip", impl.skip), ("xfail", impl.xfail),
                           ("validate", impl.validate)) if impl else ():
            if path is None:
                continue
            try:
                function = load(path)
            except Exception as error:  # noqa: BLE001  any import failure reads the same to the user
                problems.append(f"implementation {component}/{name}: {what} path {path!r} does not resolve "
                                f"({type(error).__name__}: {error}); fix register_implementation(..., {what}=...) "
                                f"or make the module importable")
                continue
            if not callable(function):
                problems.append(f"implementation {component}/{name}: {what} path {path!r} is not a function")
    return problems


def get(name: str) -> Component:
    """The component registered as ``name``."""
    _read_builtins()
    try:
        return COMPONENTS[name]
    except KeyError:
        raise ConfigError(f"unknown component {name!r}; registered: {', '.join(sorted(COMPONENTS))}") from None


def _targets(cfgs) -> set[tuple[str, str]]:
    """``(component, implementation)`` of each config, or each such pair given as it is (an
    exploration's targets, before any config is drawn)."""
    return {cfg if isinstance(cfg, tuple) else (cfg.component, cfg.impl) for cfg in cfgs}


def preload_modules(cfgs=None) -> list[str]:
    """The modules a set of configs' (or ``(component, implementation)`` pairs') components and
    implementations name or preload (every registered one's by default), for the pool to import
    before it forks its ranks."""
    _read_builtins()
    wanted = None if cfgs is None else _targets(cfgs)
    paths, named = [], []
    for component in COMPONENTS.values():
        impls = [i for i in component.implementations.values() if wanted is None or (component.name, i.name) in wanted]
        if not impls:
            continue
        paths += [component.reference, component.validate, component.reduction]
        paths += [p for p in (component.meshes, component.calibration) if p]
        for impl in impls:
            paths += [impl.run] + [p for p in (impl.skip, impl.xfail, impl.validate) if p]
        named += component.preload
    return sorted({module for path in paths for module in modules(path)} | set(named))


def reference_modules(cfgs=None) -> list[str]:
    """The modules the references and calibrations of a set of configs' components name, and those
    the components preload (every registered component's by default), for the pool of one they run
    in to import before its fork: no implementation's (Megatron-Core, the parallel code) is needed
    there."""
    _read_builtins()
    wanted = None if cfgs is None else {component for component, _ in _targets(cfgs)}
    chosen = [component for component in COMPONENTS.values() if wanted is None or component.name in wanted]
    paths = [path for component in chosen for path in (component.reference, component.calibration) if path]
    return sorted({module for path in paths for module in modules(path)}
                  | {module for component in chosen for module in component.preload})


def ranks_needed(cfg: Config, meshes: tuple | None = None) -> int:
    """How many ranks ``cfg`` needs: its mesh's, or the largest of the further meshes its component
    declares for it (``meshes``, when already computed: a checkpoint saved on more ranks than it is
    loaded on)."""
    if meshes is None:
        meshes = meshes_of(get(cfg.component), cfg)
    return max([cfg.world] + [mesh.world for mesh in meshes])
