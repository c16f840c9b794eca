"""Hypothesis strategies of valid configs, derived from what a component declares.

Nothing here names a component: the mesh dims, size ranges, switch values and dtypes come from
its ``Space`` (and the switch order from ``Component.simplest``), validity from its rules
(``validate``) and the pool size, and what an implementation cannot run here from its ``skip``.
A component registered later, or a user's own implementation, is explored the same way.

Random sizes rarely satisfy divisibility rules (a batch split over dp×m microbatches, layers over
pp×vs stages), so a size is *constructed* as often as it is drawn plain: a multiple of a product
of some mesh degrees and earlier sizes (``Space.sizes`` lists them in that order), which keeps the
rejection rate low without knowing any rule; the plain draw keeps uneven sizes (tp=3 over f=7) in
reach; and one size in ``LEAST`` takes the least value its range (and chosen multiple) allows,
since small sizes over many ranks are where edge shapes live (an ep rank that routing sends no
token needs few tokens per expert-parallel rank). The switches are drawn once per example and
kept while mesh and sizes are redrawn until the rules accept the draft, so that permissive switch
values do not crowd out the others. Hypothesis shrinks toward the first of each choice: fewer
and smaller mesh dims, the simplest switch values, fp32, small sizes, seed 0.
"""
from __future__ import annotations

import functools
import itertools
import math

from hypothesis import strategies as st

from ..config import Config, ConfigError
from ..registry import Component, Space, get, space_of
from ..resolve import resolve

ATTEMPTS = 25  # drafts per drawn example before hypothesis is told the draw is invalid
# Below 100 on purpose: hypothesis draws 1 integer in 20 from the literals of 100 or more (in
# magnitude) that it finds in every local module loaded (the harness's own code, a user's conftest),
# so a wider seed range made a seeded search change with unrelated edits of that code (a size range
# a component declares past 100 is exposed the same way).
MAX_SEED = 99
LEAST = 4  # one size in LEAST is the least its range (and chosen multiple) allows: few tokens over many ranks


class NoSpace(ConfigError):
    """The component declares nothing to explore."""


def required_space(component: Component) -> Space:
    """The component's exploration space (its ``space``), or :class:`NoSpace` naming the fix."""
    space = space_of(component)
    if space is None:
        raise NoSpace(f"component {component.name!r} declares no exploration space: add "
                      "space=Space(dims=..., sizes=..., switches=...) to its register_component(...)")
    return space


@st.composite
def meshes(draw, dims: tuple[str, ...], pool_size: int, ordered: bool = False,
           one_rank: bool = False) -> tuple[tuple[str, int], ...]:
    """Up to three named dims in any order (``ordered``: in the order of ``dims``), degrees whose
    product fits the pool; a dim after the first has a degree of 2 or more (a dim of 1 only renames
    the same cell). A world of two ranks or more, unless ``one_rank`` (``Space.one_rank``): one rank
    runs no collective, so its cell can hardly differ from the reference."""
    names = draw(st.lists(st.sampled_from(dims), min_size=1, max_size=min(3, len(dims)), unique=True))
    if ordered:
        names = sorted(names, key=dims.index)
    mesh, room = [], pool_size
    for i, name in enumerate(names):
        if i and room < 2:
            break
        # the first dim may be 1 where a later one makes the world (dp=1,tp=2: no dp, as a trainer writes it)
        least = 1 if one_rank or len(names) > 1 or pool_size < 2 else 2
        degree = draw(st.integers(least if not i else 2, max(least, room)))
        mesh.append((name, degree))
        room //= degree
    return tuple(mesh)


@st.composite
def sizes(draw, ranges: dict[str, tuple[int, int]], mesh: tuple[tuple[str, int], ...]) -> dict[str, int]:
    """Each size in its range: plain, or a multiple of some mesh degrees and earlier sizes."""
    out: dict[str, int] = {}
    for key, (lo, hi) in ranges.items():
        factors = [d for _, d in mesh if d > 1] + [v for v in out.values() if v > 1]
        chosen = [f for f in factors if draw(st.booleans())] if factors else []
        unit = math.prod(chosen)
        least = draw(st.integers(0, LEAST - 1)) == LEAST - 1
        if unit > 1 and -(-lo // unit) * unit <= hi:
            first = -(-lo // unit)
            out[key] = unit * (first if least else draw(st.integers(first, hi // unit)))
        else:
            out[key] = lo if least else draw(st.integers(lo, hi))
    return out


def every_mesh(dims: tuple[str, ...], pool_size: int, ordered: bool = False,
               one_rank: bool = False) -> list[tuple[tuple[str, int], ...]]:
    """Every mesh :func:`meshes` can draw, simplest first (fewer dims, fewer ranks): its rules, the
    first dim's least degree and a later dim's 2, with the degrees' product within the pool."""
    found = set()
    for count in range(1, min(3, len(dims)) + 1):
        least = 1 if one_rank or count > 1 or pool_size < 2 else 2
        most = max(least, pool_size)
        for names in (itertools.combinations if ordered else itertools.permutations)(dims, count):
            for degrees in itertools.product(range(least, most + 1), *[range(2, most + 1)] * (count - 1)):
                if math.prod(degrees) <= most:
                    found.add(tuple(zip(names, degrees)))
    return sorted(found, key=lambda m: (len(m), math.prod(d for _, d in m), [dims.index(n) for n, _ in m],
                                        [d for _, d in m]))


@functools.cache
def _meshes_that_run(component: str, impl: str, pool_size: int, switches: tuple[tuple[str, str], ...]) -> tuple:
    """For a space whose meshes are decided by the mesh and switches alone (``Space.mesh_decides``):
    the meshes a config with these switches runs on (in some dtype), simplest first."""
    space = required_space(get(component))
    least = {key: lo for key, (lo, _) in space.sizes.items()}
    return tuple(mesh for mesh in every_mesh(space.dims, pool_size, space.ordered, space.one_rank)
                 if any(runnable(Config(component, impl, mesh, dtype, least, dict(switches), 0), pool_size) is None
                        for dtype in space.dtypes))


def _switches(draw, component: Component) -> dict[str, str]:
    return {key: draw(st.sampled_from(values)) for key, values in component.switch_values().items()}


def _draft(draw, component: Component, impl: str, pool_size: int, switches: dict[str, str]) -> Config:
    space = required_space(component)
    run = _meshes_that_run(component.name, impl, pool_size, tuple(switches.items())) if space.mesh_decides else ()
    # drawn among the meshes that run: the case's supports would reject most others (a trainer of two dims)
    mesh = draw(st.sampled_from(run) if run else meshes(space.dims, pool_size, space.ordered, space.one_rank))
    dtype = draw(st.sampled_from(space.dtypes))
    drawn = draw(sizes(space.sizes, mesh))
    seed = draw(st.integers(0, MAX_SEED))
    return Config(component.name, impl, mesh, dtype, drawn, switches, seed)


def within(cfg: Config) -> bool:
    """Is ``cfg`` inside its component's space (dims, dtype, size ranges, switch values)? Shrinking
    outside it would reach sizes the space leaves out on purpose (numerics, not bugs). A one-rank
    world is inside: bisect's search tries it as the control that shows a dim is essential."""
    component = get(cfg.component)
    space, values = required_space(component), component.switch_values()
    return (all(name in space.dims for name, _ in cfg.mesh) and cfg.dtype in space.dtypes
            and all(key in space.sizes and space.sizes[key][0] <= v <= space.sizes[key][1] for key, v in cfg.sizes)
            and all(v in values.get(key, (v,)) for key, v in cfg.switches))


def runnable(cfg: Config, pool_size: int) -> str | None:
    """None when ``cfg`` can run here, else why not: the rule it breaks, its implementation's skip,
    or a divergence the implementation declares (``xfail``: known, so not worth finding again)."""
    disposition = resolve(cfg, pool_size).disposition
    if disposition.kind == "xfail":
        return f"declared divergence: {disposition.reason}"
    return disposition.reason if disposition.kind != "run" else None


@st.composite
def configs(draw, component: str, impl: str, pool_size: int) -> Config:
    """A config of ``component``/``impl`` that its rules accept, that fits ``pool_size`` ranks and
    that the implementation neither skips here nor declares a known divergence."""
    comp = get(component)
    if impl not in comp.implementations:
        raise ConfigError(f"no implementation {impl!r} of {component}; registered: "
                          f"{', '.join(sorted(comp.implementations))}")
    # The switches are drawn once and kept while the rest is redrawn: redrawing them with every
    # draft would let the switch values that most meshes accept crowd out the others (MoE's
    # emesh_ep1, valid on any dp/tp mesh, took 84% of the dropless configs, so expert parallelism
    # itself was rarely explored). A switch combination that no draft fits is then redrawn.
    for attempt in range(2 * ATTEMPTS):
        if attempt % ATTEMPTS == 0:
            switches = _switches(draw, comp)
        cfg = _draft(draw, comp, impl, pool_size, switches)
        if runnable(cfg, pool_size) is None:
            return cfg
    from hypothesis import reject

    reject()
