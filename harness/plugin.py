"""The pytest plugin: options, the ``parity`` and ``rank_pool`` fixtures, and the run's summary.

Installed with the package (a ``pytest11`` entry point), so a project that installs paritytest gets
the options and the fixtures without naming the plugin. It is inert until a test uses ``parity`` or
``rank_pool``: no pool is started otherwise. What it does lives in modules of its own:
:mod:`harness.options` (the options and their checks), :mod:`harness.selection` (``--quick``, an
empty ``-k``), :mod:`harness.fixture` (one cell, checked and recorded), :mod:`harness.summary` (the
closing section); under torchrun, :mod:`harness.torchrun.plugin` is registered beside it, and with
``--explore``, :mod:`harness.explore.pytest_entry`.
"""
from __future__ import annotations

import gc

import pytest

from . import selection
from .options import add_options, check_options, keep_seconds, usage
from .screen import Alike, live_line
from .summary import Summary
from .torchrun.plugin import TorchrunPlugin, launched_by_torchrun, runner_of

TORCHRUN_PLUGIN = "paritytest-torchrun"
_KEEP = pytest.StashKey[float]()  # the kept pool's idle seconds (0: none), read once at configure
_summary = Summary()
_alike: Alike | None = None  # where the failures are printed: this process, unless an xdist worker
_live = None  # the config, where each failing cell is also said the moment it fails (not under -q)
_timeline = None  # harness.report.workers.Timeline, made at the session's start


def pytest_addoption(parser):
    add_options(parser)


def _torchrun(config) -> TorchrunPlugin:
    """The torchrun plugin of this process, registered on first use."""
    plugin = config.pluginmanager.get_plugin(TORCHRUN_PLUGIN)
    if plugin is None:
        plugin = TorchrunPlugin()
        config.pluginmanager.register(plugin, TORCHRUN_PLUGIN)
    return plugin


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    """Under torchrun, the earliest moment to send the output of ranks other than 0 to their logs:
    before pytest's capture takes the file descriptors. (Loaded from a conftest instead of the
    entry point, the plugin arrives after this hook: those ranks then write to the terminal.)"""
    if launched_by_torchrun() and early_config.pluginmanager.get_plugin(TORCHRUN_PLUGIN) is None:
        _torchrun(early_config).redirect_output(early_config)
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Reject bad option values and unresolvable implementations before anything runs: one line each.
    Under torchrun, join the job (its plugin's configure, before junitxml's)."""
    global _alike, _live
    check_options(config)
    _alike = None if hasattr(config, "workerinput") else Alike()
    _live = config if _alike is not None and config.get_verbosity() >= 0 else None
    if config.getoption("--stop-pool"):
        from .pool.kept import stop

        stopped = stop(str(config.rootpath))
        pytest.exit(f"stopped {len(stopped)} kept pool(s) of {config.rootpath}", 0)
    config.stash[_KEEP] = keep_seconds(config)
    if hasattr(config, "workerinput") and config.stash[_KEEP] <= 0:  # the run's workers: one keeper
        from .pool.kept import share_with_run

        share_with_run(config.workerinput["testrunuid"])
    selection.one_cell_at_a_time(config)
    config.addinivalue_line("markers", f"{selection.QUICK_ONLY}: a shorter twin of a matrix cell (fewer steps or "
                            "smaller sizes) that --quick runs in its place, and nothing else runs")
    _check_implementations()
    if launched_by_torchrun():
        _torchrun(config)
    if config.getoption("--explore"):
        if launched_by_torchrun():
            raise usage("--explore", config.getoption("--explore"), "needs the warm pool, not torchrun")
        from .explore.pytest_entry import ExplorePlugin

        config.pluginmanager.register(ExplorePlugin(), "paritytest-explore")


@pytest.hookimpl(trylast=True)  # after junitxml's pytest_configure has made its writer
def pytest_sessionstart(session):
    from .report.workers import Timeline
    from .versions import record_in_junit

    global _timeline
    _timeline = Timeline()
    record_in_junit(session.config)


def pytest_report_header(config):
    """The harness's own version, the library versions under test, and a warning when one is not
    the thirdparty extra's pin."""
    from .versions import harness, line, mismatch_warning

    return [f"{harness()}: {line()}"] + [w for w in [mismatch_warning()] if w]


def _check_implementations() -> None:
    """Every implementation a user registered must import; said once, naming the path."""
    from .registry import unresolved

    problems = unresolved()
    if problems:
        raise pytest.UsageError("; ".join(problems))


def pytest_collection_modifyitems(config, items):
    if config.getoption("--changed"):
        selection.select_changed(config, items)
    if config.getoption("--quick"):
        selection.select_quick(config, items)
    else:
        selection.drop_quick_only(config, items)
    selection.by_world(items)


def pytest_deselected(items):
    selection.remember_deselected(items)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: a worker's -k and --changed lines (the workers collect, the controller prints)."""
    output = getattr(node, "workeroutput", {})
    if output.get(selection.NO_CELL_KEY):
        node.config.stash[selection.NO_CELL] = output[selection.NO_CELL_KEY]
    if output.get(selection.CHANGED_KEY):
        node.config.stash[selection.CHANGED] = output[selection.CHANGED_KEY]
    if output.get(selection.NOTHING_CHANGED_KEY):
        node.config.stash[selection.NOTHING_CHANGED] = True


def pytest_collection_finish(session):
    """Start the pool as soon as the selection is known, sized to it: its ranks import torch while
    this process goes on. This process never needs the optimizer's lazy ``torch._dynamo`` import
    (about 1 s): the references are computed on a rank (:meth:`harness.pool.parent.Pool.reference`)."""
    _check_implementations()  # registrations made by conftests collected late
    # torch, the harness and the collected cells live as long as the session: no full collection
    # need scan them again (with torch loaded one takes 0.2 s; pytest ends with two)
    gc.freeze()
    config = session.config
    line = selection.no_cell_matched(config, session.items)
    if line:
        config.stash[selection.NO_CELL] = line
        if hasattr(config, "workeroutput"):  # an xdist worker
            config.workeroutput[selection.NO_CELL_KEY] = line
    if runner_of(config) is not None or config.option.collectonly:
        return  # under torchrun: no pool (its plugin checks the collection)
    users = [item for item in session.items if "rank_pool" in getattr(item, "fixturenames", ())]
    if users:
        from .pool.parent import preloads

        cfgs = [selection.cell_config(item) for item in users]
        # the ranks import what the selected cells run, no more: one cell by id starts fast; the pool
        # of one, their references: both import while pytest collects and sets up
        _pool(config, _ranks_needed(cfgs, config.getoption("--pool-size")), **preloads(cfgs)).launch(alone=True)


def _ranks_needed(cfgs, most: int) -> int:
    """The most ranks any selected cell needs (the whole --pool-size for other pool users)."""
    if any(cfg is None for cfg in cfgs):
        return most
    return min(max([1] + [selection.world_needed(cfg) for cfg in cfgs]), most)


def _pool(config, size: int | None = None, preload: tuple[str, ...] | None = None,
          alone_preload: tuple[str, ...] | None = None):
    from .pool.parent import shared_pool  # torch: only once a cell needs the pool

    opt = config.getoption
    return shared_pool(size=size or opt("--pool-size"), backend=opt("--backend"), deadline=opt("--case-deadline"),
                       preload=preload, keep=config.stash[_KEEP], root=str(config.rootpath),
                       alone_preload=alone_preload)


@pytest.fixture(scope="session")
def rank_pool(pytestconfig):
    """This pytest process's warm pool of ranks, started on first use; under torchrun, this rank's
    runner (the same ``run``, every rank getting every rank's value)."""
    runner = runner_of(pytestconfig)
    if runner is not None:
        yield runner
        return
    pool = _pool(pytestconfig)
    yield pool
    pool.close()


@pytest.fixture
def parity(request, rank_pool):
    """``parity(cfg)``: run the cell in the pool, compare with the reference and its golden file."""
    from .fixture import CellCheck

    return CellCheck(request, rank_pool, runner_of(request.config))


@pytest.hookimpl(trylast=True)  # after junitxml has kept the whole failure
def pytest_runtest_logreport(report):
    from .record import record_of

    record = record_of(report)  # read once, for the summary and for the failures printed alike
    _summary.add(report, record)
    if _timeline is not None:
        _timeline.add(report)
    if _live is not None and record is not None and report.failed:
        _say_now(_live, record, report)
    if _alike is not None:
        _alike.add(report, record)


def _say_now(config, record: dict, report) -> None:
    """A failing cell's line, on its own line amid the progress dots: a long run shows what failed
    and where as it happens, not only at its end."""
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.ensure_newline()
        if tr._tw.width_of_current_line:  # after xdist's dots, which ensure_newline does not end
            tr._tw.line()
        tr.write_line(live_line(record, report), red=True)


def pytest_sessionfinish(session):
    """Before the terminal prints the failures: each way of failing names its other cells. A
    ``--changed`` run that the change left nothing to run passes (exit 0, not pytest's 5): a pull
    request that changes docs or CI files only moves no cell."""
    if _alike is not None:
        _alike.close()
    if session.config.stash.get(selection.NOTHING_CHANGED, False) and \
            session.exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    if selection.CHANGED in tr.config.stash:
        tr.write_line(tr.config.stash[selection.CHANGED])
    if tr.config.stash.get(selection.NOTHING_CHANGED, False):
        tr.write_line(f"--changed {tr.config.getoption('--changed')}: the change moves no cell and no test: "
                      "nothing to run (exit 0)", green=True, bold=True)
    if selection.NO_CELL in tr.config.stash:
        tr.write_line(tr.config.stash[selection.NO_CELL], yellow=True, bold=True)
    _summary.write(tr, _timeline)
