"""The pytest plugin: options, the ``parity`` fixture that runs a cell, and a summary per component.

Installed with the package (a ``pytest11`` entry point), so a project that installs paritytest gets
the options and the fixture without naming the plugin. It is inert until a test uses ``parity`` or
``rank_pool``: no pool is started otherwise.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from .config import Config, ConfigError
from .layout import MeshLayout
from .pool.parent import DEFAULT_DEADLINE, DEFAULT_SIZE, CaseFailure, PoolError, shared_pool

PROPERTY = "parity"


def pytest_addoption(parser):
    group = parser.getgroup("parity", "parallel-training correctness harness")
    group.addoption("--update-golden", action="store_true",
                    help="write golden files that are missing or whose values changed, and print what moved")
    group.addoption("--strict-golden", action="store_true",
                    help="fail a cell whose golden file is missing instead of writing it (for CI)")
    group.addoption("--pool-size", type=int, default=DEFAULT_SIZE,
                    help=f"most rank processes in the warm pool of each pytest process (default {DEFAULT_SIZE}); "
                         "the pool starts only as large as the selected cells need")
    group.addoption("--backend", default="auto",
                    help="process-group backend: auto (nccl where CUDA is present, else gloo), gloo or nccl")
    group.addoption("--case-deadline", type=float, default=DEFAULT_DEADLINE,
                    help=f"seconds a cell may run before its ranks' stacks are taken and it fails (default {DEFAULT_DEADLINE:g})")
    group.addoption("--golden-dir", default=None, help="where golden files live (default: <rootdir>/golden)")
    group.addoption("--rank-logs", default=None,
                    help="under torchrun: where ranks other than 0 write their pytest output "
                         "(default: a directory in the system's temp dir, named in their closing line)")
    group.addoption("--quick", action="store_true",
                    help="the edit loop: of each component and implementation, a few cells on its smallest mesh of "
                         "more than one rank, covering every dtype and switch value, and no other test that needs "
                         "the rank pool; the whole matrix stays the gate")
    group.addoption("--full-matrix", action="store_true",
                    help="every cell of each component's product, not the gate's covering design of it (the "
                         "nightly run; also PARITYTEST_FULL_MATRIX=1)")
    group.addoption("--keep-pool", type=float, nargs="?", const=-1.0, default=None, metavar="SECONDS",
                    help="keep the pool's zygote (torch and third-party libraries imported) alive after the run, "
                         "SECONDS idle (default 900, or $PARITYTEST_KEEP_POOL), and fork the next run's ranks from it")
    group.addoption("--stop-pool", action="store_true",
                    help="stop this checkout's kept pools (--keep-pool) and exit")
    group.addoption("--explore", type=int, default=0, metavar="N",
                    help="instead of running the selected cells, explore each of their (component, implementation) "
                         "pairs with up to N configs hypothesis draws (harness.explore)")
    group.addoption("--explore-ignore", action="append", default=[], metavar="TENSOR",
                    help="with --explore: a result tensor whose divergence alone does not count (repeatable), "
                         "as python -m harness.explore --ignore, e.g. the declared 'loss'")
    group.addoption("--explore-seed", type=int, default=None, metavar="N",
                    help="with --explore: the same draws in every run, as python -m harness.explore --seed")


def _usage(option: str, value, why: str) -> pytest.UsageError:
    return pytest.UsageError(f"{option} {value}: {why}")


_KEEP = pytest.StashKey[float]()  # the kept pool's idle seconds (0: none), read once at configure


# ---- torchrun mode (harness.torchrun): each pytest process is one rank ----------------------------
_RUNNER = pytest.StashKey()
_LOG = pytest.StashKey()  # a rank other than 0: the file its output goes to
_OWN_LOG_DIR = pytest.StashKey()  # the default --rank-logs directory, which the harness made
_quiet_stderr: int | None = None  # a rank other than 0: the launcher's stderr, kept for its closing line
_launcher_stderr: int | None = None  # every rank: the launcher's stderr, whatever capture does to fd 2


# what torchrun sets for every worker (RANK..MASTER_PORT is the env:// contract); read here without
# importing harness.torchrun, so that a pool run never depends on that package
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """True when this pytest process is a rank of a torchrun job (or given the same environment)."""
    return all(os.environ.get(name) for name in TORCHRUN_ENV)


def _runner(config):
    """This rank's :class:`harness.torchrun.runner.RankRunner` under torchrun, else None."""
    return config.stash.get(_RUNNER, None)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    """Under torchrun, ranks other than 0 write their output to a log file of their own: N copies
    of the same report would bury rank 0's. Done here, before pytest's capture takes the file
    descriptors, so that capture (and the terminal reporter) write into the log."""
    global _quiet_stderr, _launcher_stderr
    if launched_by_torchrun() and _launcher_stderr is None:
        # the launcher's stderr, kept before pytest's capture replaces fd 2: a rank that exits for a
        # restart in the middle of a test still gets its failure text out there
        _launcher_stderr = os.dup(2)
    if launched_by_torchrun() and os.environ["RANK"] != "0" and _quiet_stderr is None:
        where = getattr(early_config.known_args_namespace, "rank_logs", None) or os.path.join(
            tempfile.gettempdir(),
            f"paritytest-torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}-{os.environ['MASTER_PORT']}")
        os.makedirs(where, exist_ok=True)
        path = os.path.join(where, f"rank{os.environ['RANK']}.log")
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # appended: restarts add to it
        sys.stdout.flush()
        sys.stderr.flush()
        _quiet_stderr = os.dup(2)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        early_config.stash[_LOG] = path
        if not getattr(early_config.known_args_namespace, "rank_logs", None):
            early_config.stash[_OWN_LOG_DIR] = where  # ours to remove when it has nothing to read
    yield


def _own_temp(config) -> None:
    """Under torchrun, a rank other than 0 makes its ``tmp_path`` directories in places of its own:
    under ``<temp dir>/pytest-of-<user>/paritytest-rank<N>`` (pytest's ``PYTEST_DEBUG_TEMPROOT``,
    unless the user set it), or in ``<basetemp>-rank<N>`` when ``--basetemp`` is given. Set before
    pytest's tmpdir plugin reads the option (this plugin configures first); the root is read lazily.

    The N pytest processes of a job would otherwise share ``pytest-of-<user>``, and they end at the
    same moment (the verdict reaches them together). At its end each pytest removes the dead
    symlinks of that directory (``pytest-current``, dead once a passing session removed its
    basetemp under ``tmp_path_retention_policy = "failed"``) with an unlink that fails when another
    process got there first: FileNotFoundError from ``cleanup_dead_symlinks``, and that rank exits 1
    after its tests passed (1 or 2 of 6 runs of 16 processes here; docs/notes/issue-20.md). A shared
    ``--basetemp`` is worse: pytest empties it at its start, so the ranks empty each other's. Rank 0
    keeps pytest's usual place, or the basetemp as given, where a user looks for it; pytest's
    numbering and retention apply per rank, across jobs, as they do for one pytest."""
    rank = os.environ["RANK"]
    if config.option.basetemp:
        config.option.basetemp = f"{os.path.normpath(config.option.basetemp)}-rank{rank}"
        return
    if os.environ.get("PYTEST_DEBUG_TEMPROOT"):
        return
    import getpass

    try:
        user = getpass.getuser()
    except (ImportError, OSError, KeyError):
        user = "unknown"
    root = os.path.join(tempfile.gettempdir(), f"pytest-of-{user}", f"paritytest-rank{rank}")
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
    except OSError:
        return  # pytest's own place then, as without torchrun
    os.environ["PYTEST_DEBUG_TEMPROOT"] = root


def _start_torchrun(config) -> None:
    """Under torchrun: refuse xdist, leave the junit XML to rank 0, give the other ranks temp
    directories of their own, join the job's process group."""
    if not launched_by_torchrun() or config.option.help or config.option.version:
        return
    workers = getattr(config.option, "numprocesses", None)  # xdist's -n (0 or None: no workers)
    if workers:
        raise _usage("-n", workers, "xdist cannot run under torchrun: each pytest process is already one rank "
                                    "(torchrun --nproc-per-node sets how many); drop -n")
    if os.environ["RANK"] != "0":
        config.option.xmlpath = None  # one report per job, rank 0's: the verdicts are the same on every rank
        _own_temp(config)
    from .torchrun.runner import start

    runner = start(config.getoption("--backend"), config.getoption("--case-deadline"), _launcher_stderr)
    config.stash[_RUNNER] = runner
    complete = runner.finished_before()
    if complete is not None:  # torchrun restarted a job whose every test is judged: same status again
        pytest.exit(f"[torchrun] this job finished in an earlier attempt with exit status {complete}", complete)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Reject bad option values and unresolvable implementations before anything runs: one line each.
    Under torchrun, join the job (first: so that junit XML is left to rank 0 before it configures)."""
    opt = config.getoption
    if opt("--pool-size") < 1:
        raise _usage("--pool-size", opt("--pool-size"), "must be at least 1 (ranks kept warm), e.g. --pool-size 8")
    deadline = opt("--case-deadline")
    if not deadline > 0:
        raise _usage("--case-deadline", deadline, "must be a positive number of seconds, e.g. --case-deadline 30")
    from .pool.backend import resolve

    try:
        resolve(opt("--backend"))
    except ValueError as error:
        raise _usage("--backend", opt("--backend"), str(error)) from None
    from .matrix import FULL_ENV

    if os.environ.get(FULL_ENV, "") not in ("", "0", "1"):
        raise pytest.UsageError(f"{FULL_ENV}={os.environ[FULL_ENV]}: use 1 for the full matrix, or 0 (or unset it) "
                                "for the covering design")
    if opt("--full-matrix"):  # read by harness.matrix.design when the case modules build their cells
        os.environ[FULL_ENV] = "1"
    if opt("--stop-pool"):
        from .pool.kept import stop

        stopped = stop(str(config.rootpath))
        pytest.exit(f"stopped {len(stopped)} kept pool(s) of {config.rootpath}", 0)
    config.stash[_KEEP] = keep_seconds(config)
    _check_implementations()
    _start_torchrun(config)
    if opt("--explore"):
        if opt("--explore") < 1 or launched_by_torchrun():
            raise _usage("--explore", opt("--explore"), "needs N >= 1 configs per target, and the warm pool (not torchrun)")
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
    """The library versions under test, and a warning when one is not the thirdparty extra's pin."""
    from .versions import line, mismatch_warning

    return [f"paritytest: {line()}"] + [w for w in [mismatch_warning()] if w]


def _check_implementations() -> None:
    """Every implementation a user registered must import; said once, naming the path."""
    from .registry import unresolved

    problems = unresolved()
    if problems:
        raise pytest.UsageError("; ".join(problems))


def _cell_config(item) -> Config | None:
    callspec = getattr(item, "callspec", None)
    cfg = callspec.params.get("cfg") if callspec else None
    return cfg if isinstance(cfg, Config) else None


def quick_selection(cfgs: list[Config]) -> set[Config]:
    """Per (component, implementation): cells on the smallest mesh world above one (or the only
    world there is), picked in order until every such mesh, dtype and switch value appears once.
    Small, yet every component, implementation, dtype and switch value is exercised."""
    worlds: dict[tuple[str, str], set[int]] = defaultdict(set)
    for cfg in cfgs:
        worlds[cfg.component, cfg.impl].add(cfg.world)
    smallest = {key: min([w for w in ws if w > 1] or ws) for key, ws in worlds.items()}
    keep, seen = set(), set()
    for cfg in cfgs:
        key = (cfg.component, cfg.impl)
        if cfg.world != smallest[key]:
            continue
        features = {(key, "mesh", cfg.mesh), (key, "dtype", cfg.dtype)} | {(key, k, v) for k, v in cfg.switches}
        if features - seen:
            keep.add(cfg)
            seen |= features
    return keep


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--quick"):
        return
    keep = quick_selection([cfg for cfg in map(_cell_config, items) if cfg is not None])
    selected, deselected = [], []
    for item in items:
        cfg = _cell_config(item)
        # besides the chosen cells, drop other tests that need the rank pool (mesh-layout checks)
        wanted = cfg in keep if cfg is not None else "rank_pool" not in getattr(item, "fixturenames", ())
        (selected if wanted else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def _needed_ranks(items, most: int) -> int:
    """The largest world any selected cell needs (the whole --pool-size for other pool users)."""
    from .registry import get

    need = 1
    for item in items:
        cfg = _cell_config(item)
        if cfg is None:
            need = most
            break
        try:
            extra = get(cfg.component).extra_meshes(cfg)
        except ConfigError:  # reported by the cell itself
            extra = ()
        need = max([need, cfg.world] + [MeshLayout.of(dims).world for dims in extra])
    return min(need, most)


def _cell_world(cfg: Config, component) -> int:
    """Ranks a cell needs: its mesh's and its declared extra meshes'."""
    return max([cfg.world] + [MeshLayout.of(dims).world for dims in component.extra_meshes(cfg)])


def keep_seconds(config) -> float:
    """How long a kept pool waits idle (0: none): --keep-pool [SECONDS], else $PARITYTEST_KEEP_POOL;
    a bad value is a usage error."""
    from .pool.kept import DEFAULT_IDLE, KeptPoolError, idle_from_env

    value = config.getoption("--keep-pool")
    if value is None:
        try:
            return idle_from_env()
        except KeptPoolError as error:
            raise pytest.UsageError(str(error)) from None
    if value == -1.0:  # the option without a value
        return DEFAULT_IDLE
    if value <= 0:
        raise _usage("--keep-pool", value, "must be a positive number of seconds, e.g. --keep-pool 900")
    return value


def _pool(config, size: int | None = None, preload: tuple[str, ...] | None = None):
    opt = config.getoption
    return shared_pool(size=size or opt("--pool-size"), backend=opt("--backend"), deadline=opt("--case-deadline"),
                       preload=preload, keep=config.stash[_KEEP], root=str(config.rootpath))


# ---- a -k that selects no cell ----------------------------------------------------------------
_DESELECTED_CELL = pytest.StashKey[str]()  # the id of a cell some deselection dropped: an example
_NO_CELL = pytest.StashKey[str]()  # the line that says -k matched no cell
NO_CELL_KEY = "parity_no_cell"  # the same line, from an xdist worker to the controller


def pytest_deselected(items):
    cfg = next((c for c in map(_cell_config, items) if c is not None), None)
    if cfg is not None:
        items[0].config.stash.setdefault(_DESELECTED_CELL, cfg.id)


def no_cell_matched(config, items) -> str | None:
    """One line when ``-k`` left nothing of what was collected, cells among it: the expression, and
    what an id looks like with a real one. The exit status stays pytest's 5 ("no tests ran"): the
    command line is valid, and CI scripts that run shards tell an empty selection from a usage error
    (4) by it. A ``-k`` that selects other tests only (``-k under_torchrun``) meant them: no line."""
    example = config.stash.get(_DESELECTED_CELL, None)
    keyword = config.getoption("keyword", "")
    if not keyword or example is None or items:
        return None
    from .config import ID_SHAPE

    return (f"no cell matched -k {shlex.quote(keyword)}; an id looks like {ID_SHAPE}, e.g. {example} "
            "(-k matches pieces of it: -k 'tp2 and bf16')")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: a worker's -k line (the workers collect, the controller prints)."""
    line = getattr(node, "workeroutput", {}).get(NO_CELL_KEY)
    if line:
        node.config.stash[_NO_CELL] = line


def pytest_collection_finish(session):
    """Start the pool as soon as the selection is known, sized to it: its ranks import torch while
    this process goes on. This process never needs the optimizer's lazy ``torch._dynamo`` import
    (about 1 s): the references are computed on a rank (harness.cell.reference_for)."""
    _check_implementations()  # registrations made by conftests collected late
    line = no_cell_matched(session.config, session.items)
    if line:
        session.config.stash[_NO_CELL] = line
        if hasattr(session.config, "workeroutput"):  # an xdist worker
            session.config.workeroutput[NO_CELL_KEY] = line
    runner = _runner(session.config)
    if runner is not None:  # no pool: check every rank collected the same, then resume a restarted job
        from .torchrun.session import CollectionMismatch

        try:
            runner.session.check_collection([item.nodeid for item in session.items])
        except CollectionMismatch as error:
            raise pytest.UsageError(str(error)) from None
        runner.recover()
        return
    users = [item for item in session.items if "rank_pool" in getattr(item, "fixturenames", ())]
    if users and not session.config.option.collectonly:
        from .pool.parent import default_preload

        cfgs = [_cell_config(item) for item in users]
        # the ranks import what the selected cells run, no more: one cell by id starts fast
        preload = default_preload(cfgs) if all(cfgs) else None
        _pool(session.config, _needed_ranks(users, session.config.getoption("--pool-size")), preload).launch()


@pytest.fixture(scope="session")
def rank_pool(pytestconfig):
    """This pytest process's warm pool of ranks, started on first use; under torchrun, this rank's
    runner (the same ``run``, every rank getting every rank's value)."""
    runner = _runner(pytestconfig)
    if runner is not None:
        yield runner
        return
    pool = _pool(pytestconfig)
    yield pool
    pool.close()


def rerun_command(config, nodeid: str) -> str:
    """The command that reruns one test exactly: this interpreter, from the rootdir, by node id."""
    python = sys.executable
    here = Path.cwd()
    try:
        python = os.path.relpath(python, here) if Path(python).is_relative_to(here) else python
    except ValueError:
        pass
    command = f"{shlex.quote(python)} -m pytest {shlex.quote(nodeid)}"
    root = Path(config.rootpath)
    if root.resolve() != here.resolve():
        command = f"cd {shlex.quote(str(root))} && {command}"
    return command


def cell_record(cfg: Config) -> dict:
    """What the plugin records of a cell (the ``parity`` user property, JSON): its coordinates in
    the matrix, then its outcome, filled in as the cell runs."""
    return {"cell": cfg.id, "component": cfg.component, "impl": cfg.impl,
            "mesh": ".".join(f"{k}{v}" for k, v in cfg.mesh), "dtype": cfg.dtype, "switches": dict(cfg.switches),
            "status": "failed", "kind": "", "ratio": 0.0, "tensor": "", "norm_ratio": 1.0, "golden": "",
            "moved": "", "seconds": 0.0}


def _worst(report) -> dict:
    """The worst tensor of a comparison: its err/tol ratio, name and norm ratio."""
    rows = report.rows if report else []
    if not rows:
        return {}
    row = max(rows, key=lambda r: r.ratio)
    return {"ratio": row.ratio, "tensor": row.tensor, "norm_ratio": row.norm_ratio}


@pytest.fixture
def parity(request, rank_pool, pytestconfig):
    """``parity(cfg)``: run the cell in the pool, compare with the reference and its golden file."""
    from .cell import Divergence, run_cell, run_pieces
    from .golden.store import GoldenError
    from .layout import AssemblyError
    from .model.record import model_record
    from .registry import validate

    opt = pytestconfig.getoption
    golden_dir = Path(opt("--golden-dir") or pytestconfig.rootpath / "golden")

    def check(cfg: Config):
        record = cell_record(cfg)
        try:
            return _run_checked(cfg, record)
        finally:  # one JSON property per cell, in the junit XML too: what harness.report reads
            request.node.user_properties.append((PROPERTY, json.dumps(record, sort_keys=True)))

    def _run_checked(cfg: Config, record: dict):
        start = time.perf_counter()
        runner = _runner(pytestconfig)
        outcome = None
        try:
            component = validate(cfg, None if runner else rank_pool.size)
            need = _cell_world(cfg, component)
        except ConfigError as error:
            failure, record["kind"] = f"invalid config: {error}", "invalid"
        else:
            impl = component.implementations[cfg.impl]
            reason = impl.skip_reason(cfg)
            if reason is None and runner is not None and need > runner.size:
                reason = (f"needs {need} ranks and this torchrun job has {runner.size}: launch at least {need} "
                          "(--nnodes x --nproc-per-node)")
            if reason:
                record["status"] = "skipped"
                pytest.skip(reason)
            known = impl.xfail_reason(cfg)
            if known:  # runs in full: a divergence is the expected outcome, a match means upstream changed
                record["expected"] = known
                request.applymarker(pytest.mark.xfail(
                    strict=True, reason=f"known divergence of {cfg.impl}: {known}. If this cell passes (XPASS), "
                                        f"the upstream behaviour changed: remove its entry from {impl.xfail}"))
            if runner is None:
                failure, outcome = _judge(cfg, rank_pool, record, start)
            else:
                failure, outcome = _on_ranks(cfg, component, runner, record, start)
        record["seconds"] = record.get("seconds") or round(time.perf_counter() - start, 4)
        if failure is not None:  # outside the except block: the report shows our message, no chain
            pytest.fail(failure, pytrace=False)
        return outcome

    def _judge(cfg: Config, pool, record: dict, start: float):
        """Run the cell through ``pool`` (the warm pool, or rank 0's runner) and judge it: the failure
        text or None, and the outcome; the record is filled in either way."""
        try:
            outcome = run_cell(cfg, pool, golden_dir=golden_dir, update_golden=opt("--update-golden"),
                               missing_golden="fail" if opt("--strict-golden") else "write",
                               rerun=rerun_command(pytestconfig, request.node.nodeid))
        except Divergence as error:
            record["kind"] = error.kind
            # a declared divergence (strict xfail) does not pay for the per-module re-run
            record.update(_worst(error.report), **model_record(cfg, error.report, None if "expected" in record else pool))
            return str(error), None
        except (CaseFailure, AssemblyError) as error:  # a hang or crash reruns the same way a mismatch does
            record["kind"] = getattr(error, "kind", type(error).__name__)
            return f"{error}\nreproduce: {rerun_command(pytestconfig, request.node.nodeid)}", None
        except (GoldenError, PoolError) as error:
            record["kind"] = type(error).__name__
            return str(error), None
        finally:
            record["seconds"] = round(time.perf_counter() - start, 4)
        record.update(_worst(outcome.parity), status="passed", golden=outcome.golden_status, moved=outcome.moved,
                      **model_record(cfg, outcome.parity))
        return None, outcome

    def _on_ranks(cfg: Config, component, runner, record: dict, start: float):
        """Under torchrun: every rank runs its part; rank 0 judges and shares the verdict, which the
        other ranks adopt (record included), so every rank reports the same outcome. A cell an
        earlier attempt of this job judged is not run again: its verdict is replayed."""
        nodeid = request.node.nodeid
        verdict = runner.recorded(nodeid)
        if verdict is None:
            runner.begin(nodeid, record)
            if runner.rank == 0:
                try:
                    failure, outcome = _judge(cfg, runner, record, start)
                except BaseException as error:  # not the cell's failure but ours: the others must hear too
                    record["kind"] = type(error).__name__
                    runner.share_verdict(f"{cfg.id}: the harness failed on rank 0 while judging the cell:\n"
                                         f"{traceback.format_exc()}", record)
                    raise
                runner.share_verdict(failure, record)
                return failure, outcome
            try:
                run_pieces(cfg, runner, component)
            finally:  # whatever happened here, the cell's verdict is rank 0's
                verdict = runner.await_verdict()
        record.clear()
        record.update(verdict["record"])
        return verdict["failure"], None

    return check


class _Summary:
    """Per component: outcomes, worst err/tol (failed cells included), goldens, time, skip reasons;
    and the slowest cells."""

    SLOWEST = 5  # cells listed by time at the end of a run, as --durations=5 would

    def __init__(self):
        # the golden columns are the Markdown report's (harness.report.markdown.COMPONENT_HEADERS)
        self.rows = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0, "worst err/tol": 0.0,
                                         "failed as": Counter(), "golden identical": 0, "golden within tol": 0,
                                         "golden written": 0, "seconds": 0.0})
        self.skips: dict[str, Counter] = defaultdict(Counter)
        self.moved: list[tuple[str, str]] = []
        self.written: list[str] = []
        self.times: list[tuple[float, str]] = []  # (seconds the plugin recorded, node id) of cells that ran

    def add(self, report):
        prop = dict(report.user_properties).get(PROPERTY)
        if prop is None or report.when != "call":
            return
        record = json.loads(prop)
        row = self.rows[record["component"]]
        xfailed = report.skipped and hasattr(report, "wasxfail")  # a known divergence, as declared
        status = "failed" if report.failed else "xfailed" if xfailed else "skipped" if report.skipped \
            else record["status"]
        row[status] += 1
        row["seconds"] += report.duration
        if xfailed:
            return
        if status == "skipped":
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skips[record["component"]][reason.removeprefix("Skipped: ")] += 1
            return
        if status == "failed":
            row["failed as"][record["kind"] or "error"] += 1
        row["worst err/tol"] = max(row["worst err/tol"], record["ratio"])
        row["golden identical"] += record["golden"] == "identical"
        row["golden within tol"] += record["golden"] == "within tolerance"
        row["golden written"] += record["golden"] in ("written", "updated")
        self.times.append((record["seconds"], report.nodeid))
        if record["golden"] == "written":
            self.written.append(report.nodeid)
        if record["moved"]:
            self.moved.append((report.nodeid, record["moved"]))

    def table(self) -> str:
        """One row per component, columns right-aligned under their headers, the index's name on a
        line of its own (the layout pandas' ``to_string`` gives; pandas' import alone is 0.3 s of a
        one-cell run)."""

        def text(value) -> str:
            if isinstance(value, Counter):
                return ", ".join(f"{k} {n}" for k, n in value.most_common())
            return f"{value:.3g}" if isinstance(value, float) else str(value)

        names = sorted(self.rows)
        headers = list(self.rows[names[0]])
        cells = {name: [text(self.rows[name][h]) for h in headers] for name in names}
        widths = [max([len(h)] + [len(cells[name][i]) for name in names]) for i, h in enumerate(headers)]
        first = max(len("component"), *map(len, names))
        lines = [" " * first + "".join(f"  {h:>{w}}" for h, w in zip(headers, widths)), "component"]
        lines += [f"{name:<{first}}" + "".join(f"  {c:>{w}}" for c, w in zip(cells[name], widths)) for name in names]
        return "\n".join(line.rstrip() for line in lines)

    def slowest(self) -> list[str]:
        """The slowest cells that ran, one line each, slowest first."""
        return [f"{seconds:8.2f}s  {nodeid}" for seconds, nodeid in sorted(self.times, reverse=True)[:self.SLOWEST]]


_summary = _Summary()
_timeline: "Timeline | None" = None  # made at the session's start: the workers' busy and idle phases


def pytest_runtest_setup(item):
    runner = _runner(item.config)
    if runner is not None:
        runner.enter(item.nodeid)


def pytest_sessionfinish(session, exitstatus):
    runner = _runner(session.config)
    if runner is None:
        return
    runner.finish(int(exitstatus))
    if runner.rank != 0 and runner.own_failures and _quiet_stderr is not None:
        env = runner.session.env
        os.write(_quiet_stderr, (f"rank {env.rank} (host {env.host}, local rank {env.local_rank}): its part raised or "
                                 f"hung in {runner.own_failures} cell(s); its pytest output: "
                                 f"{session.config.stash.get(_LOG, '?')}\n").encode())
    elif runner.rank != 0 and _OWN_LOG_DIR in session.config.stash:
        # nothing on this rank to read: its log, and the default directory once empty, go
        with contextlib.suppress(OSError):
            os.remove(session.config.stash[_LOG])
            os.rmdir(session.config.stash[_OWN_LOG_DIR])


def pytest_runtest_logreport(report):
    _summary.add(report)
    if _timeline is not None:
        _timeline.add(report)


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    if _NO_CELL in tr.config.stash:
        tr.write_line(tr.config.stash[_NO_CELL], yellow=True, bold=True)
    if not _summary.rows:
        return
    tr.section("parity summary")
    from .versions import line

    tr.write_line(f"versions: {line()}")
    tr.write_line(_summary.table())
    tr.write_line("(worst err/tol counts failed cells too; seconds: time spent in the component's cells)")
    for component, reasons in sorted(_summary.skips.items()):
        for reason, count in reasons.most_common(3):
            tr.write_line(f"skipped {component} x{count}: {reason}")
        if len(reasons) > 3:
            tr.write_line(f"skipped {component}: {len(reasons) - 3} other reasons")
    if _summary.written:
        tr.write_line(f"golden files written for {len(_summary.written)} cells that had none: "
                      "review and commit them (golden/)")
    for nodeid, table in _summary.moved:
        tr.write_line(f"golden updated, what moved: {nodeid}\n{table}")
    if _summary.times:
        tr.write_line("slowest cells (seconds in the cell: its ranks' run, the reference, comparison, golden):")
        for row in _summary.slowest():
            tr.write_line(row)
    if _timeline is not None and len(_timeline.workers) > 1:
        tr.write_line("workers (seconds from the session's start):")
        for row in _timeline.lines():
            tr.write_line(f"  {row}")
