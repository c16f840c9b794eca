"""Which cells a run selects and in what order: ``--quick``'s few cells, cells of one world size
together, and the line that says a ``-k`` left none.

All read the cells from collected items by their ``cfg`` parameter (:func:`cell_config`).
"""
from __future__ import annotations

import shlex
from collections import defaultdict
from collections.abc import Iterable

import pytest

from .config import ID_SHAPE, Config

QUICK_ONLY = "quick_only"  # the marker of a cell that only --quick runs (:func:`select_quick`)
DESELECTED_CELL = pytest.StashKey[str]()  # the id of a cell some deselection dropped: an example
NO_CELL = pytest.StashKey[str]()  # the line that says -k matched no cell
NO_CELL_KEY = "parity_no_cell"  # the same line, from an xdist worker to the controller
CHANGED = pytest.StashKey[str]()  # --changed's line, when the controller did not collect (xdist)
CHANGED_KEY = "parity_changed"  # the same line, from an xdist worker to the controller
NOTHING_CHANGED = pytest.StashKey[bool]()  # --changed deselected everything collected
NOTHING_CHANGED_KEY = "parity_nothing_changed"


def cell_config(item) -> Config | None:
    """The config a collected test runs as a cell (its ``cfg`` parameter), or None."""
    callspec = getattr(item, "callspec", None)
    cfg = callspec.params.get("cfg") if callspec else None
    return cfg if isinstance(cfg, Config) else None


def world_needed(cfg: Config) -> int:
    """How many ranks ``cfg`` needs, for ordering and sizing at collection: its mesh's where its
    component's rules or mesh declarations fail, which the cell itself then reports (a collection
    hook that raised would end the whole session with an INTERNALERROR)."""
    from .registry import ranks_needed

    try:
        return ranks_needed(cfg)
    except Exception:  # noqa: BLE001  reported by the cell, with its id
        return cfg.world


def quick_selection(cfgs: list[Config], quick_only: Iterable[Config] = ()) -> set[Config]:
    """Per (component, implementation), few cells that together run every mesh dim it splits over
    (degree above 1), every dtype and every switch value, each value where it acts
    (``Space.acts_with``: sequence parallelism with tp) when some cell runs it there: the cover that
    needs the fewest ranks in all (:func:`_cheapest`). Cells of more than one rank cover first (a cell
    of one splits nothing); one whose switches all hold one value (a checkpoint saved and loaded under
    the same layout reshards nothing) only where no other cell shows what it shows. Small, yet every
    component, implementation, dim, dtype and switch value runs.

    ``quick_only``: cells that stand in for those equal to them but for their sizes (fewer training
    steps), which are then never picked."""
    quick_only = set(quick_only)
    stood_for = {_but_sizes(cfg) for cfg in quick_only}
    cfgs = [cfg for cfg in cfgs if cfg in quick_only or _but_sizes(cfg) not in stood_for]
    pairs: dict[tuple[str, str], list[Config]] = defaultdict(list)
    for cfg in cfgs:
        pairs[cfg.component, cfg.impl].append(cfg)
    acts = _acts()
    return {cfg for pair in pairs.values() for cfg in _cover(pair, acts)}


def _cover(cells: list[Config], acts) -> list[Config]:
    """:func:`quick_selection`'s cover of one (component, implementation)'s cells: first of what cells
    of more than one rank show, then of what only cells of one show."""
    acting = {(k, v) for cfg in cells for k, v in cfg.switches if acts(cfg, k)}
    shows = {cfg: _features(cfg, acts, acting) for cfg in cells}
    chosen: list[Config] = []
    for tier in ([cfg for cfg in cells if cfg.world > 1], cells):
        shown = set().union(*(shows[cfg] for cfg in chosen))
        missing = set().union(*(shows[cfg] for cfg in tier)) - shown
        # a one-valued cell costs more than every other cell of its tier together: taken only where needed
        penalty = 1 + sum(cfg.world for cfg in tier)
        useful = [cfg for cfg in tier if shows[cfg] & missing]
        chosen += _cheapest(useful, {cfg: shows[cfg] & missing for cfg in useful},
                            {cfg: cfg.world + penalty * _one_value(cfg) for cfg in useful})
    return chosen


SEARCH_NODES = 2000  # enough for the checkpoint's 98 cells of 26 values; bounds collection's time


def _cheapest(cells: list[Config], shows: dict[Config, set], cost: dict[Config, int]) -> list[Config]:
    """The cells that show everything ``cells`` show at the least total ``cost``: a branch and bound
    search, each branch on a cell showing the value fewest cells show, cheapest per value first. It
    stops after :data:`SEARCH_NODES` steps with the best cover found (its first descent finds one),
    counted in steps, not seconds, so that every process picks the same: xdist's workers must."""
    order = {cfg: i for i, cfg in enumerate(cells)}
    showing: dict[tuple, list[Config]] = defaultdict(list)
    for cfg in cells:
        for feature in sorted(shows[cfg]):
            showing[feature].append(cfg)
    cheapest = {feature: min(cost[cfg] for cfg in by) for feature, by in showing.items()}
    best: list[Config] = []
    best_cost = float("inf")
    nodes = 0

    def search(missing: frozenset, chosen: list[Config], spent: int) -> None:
        nonlocal best, best_cost, nodes
        nodes += 1
        if not missing:
            if spent < best_cost:
                best, best_cost = list(chosen), spent
            return
        # the dearest value still missing costs at least its cheapest cell
        if nodes > SEARCH_NODES or spent + max(cheapest[f] for f in missing) >= best_cost:
            return
        rarest = min(missing, key=lambda f: (len(showing[f]), f))
        branches: list[tuple[Config, frozenset]] = []
        for cfg in sorted(showing[rarest], key=lambda c: (cost[c] / len(shows[c] & missing), cost[c], order[c])):
            adds = frozenset(shows[cfg] & missing)
            if not any(adds <= other and cost[c] <= cost[cfg] for c, other in branches):  # dominated
                branches.append((cfg, adds))
        for cfg, adds in branches:
            chosen.append(cfg)
            search(missing - adds, chosen, spent + cost[cfg])
            chosen.pop()

    search(frozenset(showing), [], 0)
    return best


def _features(cfg: Config, acts, acting: set[tuple[str, str]]) -> set[tuple]:
    """What a cell shows :func:`_cover`: its split dims, its dtype, and each switch value it runs where
    the value acts (anywhere, for a value in no cell where it acts: not in ``acting``)."""
    return ({("dim", name) for name, degree in cfg.mesh if degree > 1} | {("dtype", cfg.dtype)}
            | {("switch", k, v) for k, v in cfg.switches if acts(cfg, k) or (k, v) not in acting})


def _acts():
    """``acts(cfg, switch)``: whether the switch does something on the cell's mesh (its component's
    ``Space.acts_with``; a switch without an entry acts everywhere)."""
    from .registry import get, space_of

    spaces: dict[str, dict] = {}  # component -> its switches' dims

    def acts(cfg: Config, name: str) -> bool:
        if cfg.component not in spaces:
            space = space_of(get(cfg.component))
            spaces[cfg.component] = space.acts_with if space is not None else {}
        dims = spaces[cfg.component].get(name)
        return dims is None or any(cfg.degree(d) > 1 for d in dims)
    return acts


def _but_sizes(cfg: Config) -> Config:
    return cfg.replace(sizes=())


def _one_value(cfg: Config) -> bool:
    """Whether the cell's switches, two or more, all hold the same value."""
    return len(cfg.switches) > 1 and len({v for _, v in cfg.switches}) == 1


def select_quick(config, items) -> None:
    """``--quick``: the :func:`quick_selection` cells, and no other test that needs the rank pool
    (the mesh-layout checks); the rest deselected."""
    cfgs = {item: cell_config(item) for item in items}
    keep = quick_selection([cfg for cfg in cfgs.values() if cfg is not None],
                           [cfgs[item] for item in items if cfgs[item] is not None and quick_only(item)])
    _keep(config, items, lambda item: cfgs[item] in keep if cfgs[item] is not None
          else "rank_pool" not in getattr(item, "fixturenames", ()))


def quick_only(item) -> bool:
    """Whether ``item`` is marked ``quick_only``: a shorter twin of a matrix cell, run by ``--quick`` in
    its place and by nothing else."""
    return item.get_closest_marker(QUICK_ONLY) is not None


def drop_quick_only(config, items) -> None:
    """Without ``--quick``: the ``quick_only`` cells deselected (the cells they stand for run in full),
    but for one named by its node id."""
    named = set(config.args)
    _keep(config, items, lambda item: not quick_only(item) or item.nodeid in named)


def _keep(config, items, wanted) -> None:
    """Deselect the items ``wanted`` refuses, as pytest reports deselected ones."""
    selected, deselected = [], []
    for item in items:
        (selected if wanted(item) else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def select_changed(config, items) -> None:
    """``--changed REF``: the cells the change can move (:mod:`harness.changes`), and the other tests
    whose module reaches a changed one; the rest deselected."""
    from pathlib import Path

    from .changes import ChangedError, Changes, module_of

    root = Path(config.rootpath)
    here = root.resolve()
    try:
        changes = Changes(root, config.getoption("--changed"),
                          Path(config.getoption("--golden-dir") or root / "golden"))
    except ChangedError as error:
        raise pytest.UsageError(str(error)) from None
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if hasattr(config, "workerinput"):  # an xdist worker: the controller says it, once
        config.workeroutput[CHANGED_KEY] = changes.describe()
    elif reporter is not None:
        reporter.write_line(changes.describe())

    def wanted(item) -> bool:
        path = Path(item.path).resolve()
        module = module_of(str(path.relative_to(here))) if path.is_relative_to(here) else None
        cfg = cell_config(item)
        return changes.moves(cfg, module) if cfg is not None else changes.reaches(module)
    _keep(config, items, wanted)
    if not items:  # a change no cell and no test can see (docs, CI files): nothing to run is a pass
        config.stash[NOTHING_CHANGED] = True
        if hasattr(config, "workerinput"):
            config.workeroutput[NOTHING_CHANGED_KEY] = True


def remember_deselected(items) -> None:
    """Keep the id of a deselected cell: the example the no-cell line shows."""
    cfg = next((c for c in map(cell_config, items) if c is not None), None)
    if cfg is not None:
        items[0].config.stash.setdefault(DESELECTED_CELL, cfg.id)


def no_cell_matched(config, items) -> str | None:
    """One line when ``-k`` left nothing of what was collected, cells among it: the expression, and
    what an id looks like with a real one. The exit status stays pytest's 5 ("no tests ran"): the
    command line is valid, and CI scripts that run shards tell an empty selection from a usage error
    (4) by it. A ``-k`` that selects other tests only (``-k under_torchrun``) meant them: no line."""
    example = config.stash.get(DESELECTED_CELL, None)
    keyword = config.getoption("keyword", "")
    if not keyword or example is None or items:
        return None
    return (f"no cell matched -k {shlex.quote(keyword)}; an id looks like {ID_SHAPE}, e.g. {example} "
            "(-k matches pieces of it: -k 'tp2 and bf16')")


def one_cell_at_a_time(config) -> None:
    """Under pytest-xdist's load scheduling, hand each worker its next cell when it is nearly done
    (``--maxschedchunk 1``), unless the user chose a chunk: cells last from 0.05 s to 10 s, and xdist's
    default chunks (up to half a worker's share, in collection order) handed one worker a run of
    8-rank model cells while the other sat idle for the last 40 to 50 s of ``--quick``."""
    option = config.option
    if getattr(option, "dist", "no") == "load" and getattr(option, "maxschedchunk", 0) is None:
        option.maxschedchunk = 1


def by_world(items) -> None:
    """Within each module, cells in order of the ranks they need, the most first (stable: the
    module's own order otherwise): a worker's cells of one size run one after another, so its ranks
    make a new world (:mod:`harness.world`) once per size, not once per cell; and the largest cells,
    the longest, start first instead of leaving the other worker idle at the end."""
    def need(item) -> int:
        cfg = cell_config(item)
        return world_needed(cfg) if cfg is not None else 0
    start = 0
    while start < len(items):
        end = start
        while end < len(items) and getattr(items[end], "module", None) is getattr(items[start], "module", None):
            end += 1
        items[start:end] = sorted(items[start:end], key=need, reverse=True)
        start = end
