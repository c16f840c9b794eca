"""The pytest side of torchrun mode: a plugin of its own, registered by :mod:`harness.plugin` only
when the launcher's environment is present (its earliest hook, before the conftests load).

* ranks other than 0 write their pytest output to ``--rank-logs`` (N copies of one report would
  bury rank 0's), and make their ``tmp_path`` directories in places of their own;
* at configure: refuse xdist, leave the junit XML to rank 0, join the job's process group;
* after collection: check every rank collected the same tests, resume a restarted job;
* each cell: every rank runs its part, rank 0 judges and shares the verdict (:func:`on_ranks`).
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import traceback

import pytest

# what torchrun sets for every worker (RANK..MASTER_PORT is the env:// contract)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
RUNNER = pytest.StashKey()  # this rank's harness.torchrun.runner.RankRunner
_LOG = pytest.StashKey()  # a rank other than 0: the file its output goes to
_PENDING_LOG = pytest.StashKey()  # where that file moves once every rank has joined (see redirect_output)
_OWN_LOG_DIR = pytest.StashKey()  # the default --rank-logs directory, which the harness made


def launched_by_torchrun() -> bool:
    """True when this pytest process is a rank of a torchrun job (or given the same environment)."""
    return all(os.environ.get(name) for name in TORCHRUN_ENV)


def runner_of(config):
    """This rank's :class:`harness.torchrun.runner.RankRunner` under torchrun, else None."""
    return config.stash.get(RUNNER, None)


class TorchrunPlugin:
    """The hooks of torchrun mode (see the module docstring)."""

    def __init__(self):
        self.quiet_stderr: int | None = None  # a rank other than 0: the launcher's stderr, for its closing line
        self.launcher_stderr: int | None = None  # every rank: the launcher's stderr, whatever capture does to fd 2
        self.failed: dict[str, str] = {}  # node id -> its failure's headline, on this rank

    def redirect_output(self, early_config) -> None:
        """Ranks other than 0 write to a log file of their own; done before pytest's capture takes
        the file descriptors, so that capture (and the terminal reporter) write into the log."""
        # the launcher's stderr, kept before pytest's capture replaces fd 2: a rank that exits for a
        # restart in the middle of a test still gets its failure text out there
        self.launcher_stderr = os.dup(2)
        if os.environ["RANK"] == "0":
            return
        given = getattr(early_config.known_args_namespace, "rank_logs", None)
        where = given or os.path.join(
            tempfile.gettempdir(),
            f"paritytest-torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}-{os.environ['MASTER_PORT']}")
        path = os.path.join(where, f"rank{os.environ['RANK']}.log")
        if given and not os.path.isdir(given):
            # pytest chooses its rootdir before this plugin loads, counting the value of an option it
            # does not know yet (``--rank-logs DIR``) when DIR exists: made now, while another rank of
            # this host is still starting, it would give that rank another rootdir and other node ids
            # (the collection check then stops the job). So the log starts beside it and moves in
            # once every rank has joined the job (:meth:`settle_log`).
            early_config.stash[_PENDING_LOG] = path
            parent, name = os.path.split(os.path.abspath(where))
            os.makedirs(parent, exist_ok=True)
            path = os.path.join(parent, f".{name}-rank{os.environ['RANK']}.log")
        else:
            os.makedirs(where, exist_ok=True)
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # appended: restarts add to it
        sys.stdout.flush()
        sys.stderr.flush()
        self.quiet_stderr = os.dup(2)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        early_config.stash[_LOG] = path
        if not getattr(early_config.known_args_namespace, "rank_logs", None):
            early_config.stash[_OWN_LOG_DIR] = where  # ours to remove when it has nothing to read

    def pytest_configure(self, config):
        """Refuse xdist, leave the junit XML to rank 0 (before junitxml configures), give the other
        ranks temp directories of their own, join the job's process group."""
        if config.option.help or config.option.version:
            self.settle_log(config)
            return
        workers = getattr(config.option, "numprocesses", None)  # xdist's -n (0 or None: no workers)
        if workers:
            self.settle_log(config)
            raise pytest.UsageError(f"-n {workers}: xdist cannot run under torchrun: each pytest process is already "
                                    "one rank (torchrun --nproc-per-node sets how many); drop -n")
        if os.environ["RANK"] != "0":
            config.option.xmlpath = None  # one report per job, rank 0's: the verdicts are the same on every rank
            own_temp(config)
        from .runner import start

        try:
            runner = start(config.getoption("--backend"), config.getoption("--case-deadline"), self.launcher_stderr)
        finally:
            self.settle_log(config)
        config.stash[RUNNER] = runner
        complete = runner.finished_before()
        if complete is not None:  # torchrun restarted a job whose every test is judged: same status again
            pytest.exit(f"[torchrun] this job finished in an earlier attempt with exit status {complete}", complete)

    @staticmethod
    def settle_log(config) -> None:
        """Once every rank has joined the job (each has chosen its rootdir), or this rank goes no
        further: a log begun beside the ``--rank-logs`` directory (:meth:`redirect_output`) moves into
        it, the same file, still open."""
        final = config.stash.get(_PENDING_LOG, None)
        if final is None:
            return
        del config.stash[_PENDING_LOG]
        os.makedirs(os.path.dirname(final), exist_ok=True)
        os.replace(config.stash[_LOG], final)
        config.stash[_LOG] = final

    def pytest_collection_finish(self, session):
        """Every rank collected the same tests (else stop, naming the first difference); resume a
        restarted job where the last attempt stopped."""
        from .session import CollectionMismatch

        runner = runner_of(session.config)
        try:
            runner.session.check_collection([item.nodeid for item in session.items])
        except CollectionMismatch as error:
            raise pytest.UsageError(str(error)) from None
        runner.recover()

    def pytest_runtest_setup(self, item):
        runner_of(item.config).enter(item.nodeid)

    def pytest_runtest_logreport(self, report):
        if report.failed:  # to tell rank 0 which tests failed here (see _finish)
            self.failed[report.nodeid] = f"{report.when}: {headline(report.longreprtext)}"

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_sessionfinish(self, session):
        """The job's end, outermost around every plugin's hook so that it sees how this rank's
        pytest ends: an exception from one of them ends it too (Python then exits with 1)."""
        error = None
        try:
            return (yield)
        except BaseException:
            error = traceback.format_exc()
            raise
        finally:
            runner = runner_of(session.config)
            if runner is not None:
                ending = {"status": 1 if error else int(session.exitstatus), "error": error, "failed": self.failed}
                self._finish(session.config, runner, ending)

    def _finish(self, config, runner, ending: dict) -> None:
        """Tell the job how this rank ends. Rank 0 names each rank that ended otherwise (its report
        is the job's, and shows rank 0's verdicts only); such a rank, or one whose part of a cell
        raised or hung, keeps its log and names it on the launcher's stderr; the other ranks' logs go."""
        odd = runner.finish(ending)
        env, stash = runner.session.env, config.stash
        if runner.rank == 0:
            who = runner.session.who() if odd else {}
            for r, end in sorted(odd.items()):
                runner.say(f"[torchrun] rank {r} ({runner.where(r, who)}) ended its pytest with exit status "
                           f"{end['status']} where rank 0 ended with {ending['status']}: "
                           f"{'; '.join(unlike_rank0(end, ending))}. Its output: its rank log (--rank-logs, rank{r}.log)\n")
            return
        if self.quiet_stderr is not None and (runner.own_failures or odd):
            why = (f"its part raised or hung in {runner.own_failures} cell(s)" if runner.own_failures else
                   f"its pytest ended with exit status {ending['status']}, otherwise than rank 0's")
            os.write(self.quiet_stderr, (f"rank {env.rank} (host {env.host}, local rank {env.local_rank}): {why}; "
                                         f"its pytest output: {stash.get(_LOG, '?')}\n").encode())
        elif _OWN_LOG_DIR in stash:
            # nothing on this rank to read: its log, and the default directory once empty, go
            with contextlib.suppress(OSError):
                os.remove(stash[_LOG])
                os.rmdir(stash[_OWN_LOG_DIR])


def headline(text: str) -> str:
    """A failure's one line: its traceback's first ``E`` line (the exception), else its first line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    raised = [line[1:].strip() for line in lines if line.startswith("E ")]
    return ((raised or lines or [""])[0])[:300]


def unlike_rank0(end: dict, first: dict) -> list[str]:
    """What a rank's ending (:meth:`harness.torchrun.attempts.Attempts.finish`) has that rank 0's
    has not, in words."""
    said = [f"{nodeid} failed there and not on rank 0 ({line})"
            for nodeid, line in end["failed"].items() if nodeid not in first["failed"]]
    if end["error"]:
        said.append(f"an exception ended its pytest after the tests ({end['error'].strip().splitlines()[-1]})")
    return said or ["it failed outside the tests (the verdicts of the cells are rank 0's, the same on every rank)"]


def own_temp(config) -> None:
    """A rank other than 0 makes its ``tmp_path`` directories in places of its own: under
    ``<temp dir>/pytest-of-<user>/paritytest-rank<N>`` (pytest's ``PYTEST_DEBUG_TEMPROOT``, unless
    the user set it), or in ``<basetemp>-rank<N>`` when ``--basetemp`` is given. Set before pytest's
    tmpdir plugin reads the option; the root is read lazily.

    The N pytest processes of a job would otherwise share ``pytest-of-<user>``, and they end at the
    same moment (the verdict reaches them together). At its end each pytest removes the dead
    symlinks of that directory (``pytest-current``, dead once a passing session removed its
    basetemp under ``tmp_path_retention_policy = "failed"``) with an unlink that fails when another
    process got there first: FileNotFoundError from ``cleanup_dead_symlinks``, and that rank exits 1
    after its tests passed. A shared ``--basetemp`` is worse: pytest empties it at its start, so the
    ranks empty each other's. Rank 0 keeps pytest's usual place, or the basetemp as given, where a
    user looks for it; pytest's numbering and retention apply per rank, across jobs, as they do for
    one pytest."""
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


def on_ranks(check, cell, runner, record: dict, start: float):
    """A resolved cell (:class:`harness.resolve.Cell`) under torchrun: rank 0 judges (``check.judge``), running the cell (and, when it fails,
    its localisation) on every rank: the others follow its rounds. It shares the verdict, which the
    other ranks adopt (record included), so every rank reports the same outcome and the same
    diagnosis as a pool run. A cell an earlier attempt of this job judged is not run again: its
    verdict is replayed. Returns the failure text or None, and the outcome (rank 0's)."""
    nodeid = check.nodeid
    verdict = runner.recorded(nodeid)
    if verdict is None:
        runner.begin(nodeid, record)
        if runner.rank == 0:
            try:
                failure, outcome = check.judge(cell, runner, record, start)
            except BaseException as error:  # not the cell's failure but ours: the others must hear too
                record["kind"] = type(error).__name__
                runner.share_verdict(f"{cell.id}: the harness failed on rank 0 while judging the cell:\n"
                                     f"{traceback.format_exc()}", record)
                raise
            runner.share_verdict(failure, record)
            return failure, outcome
        verdict = runner.follow()  # rank 0's rounds: the cell, and its localisation if it fails
    record.clear()
    record.update(verdict["record"])
    return verdict["failure"], None
