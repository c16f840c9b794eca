"""Cells under torchrun: the implementation runs in-process on this rank, rank 0 judges.

:class:`RankRunner` has the warm pool's ``run(fn, payload, mesh, ...)`` signature, so
``harness.cell`` runs a cell through it unchanged: the cell's first ranks make a world of the
cell's size (:mod:`harness.world`; the job's other ranks idle), build the cell's meshes, run their
part and publish their outcome in the store; rank 0 gathers the pieces and, through the same ``run_cell`` as the pool path,
computes the reference once, compares and checks the golden file. The verdict goes back through
the store so that every rank's pytest reports the same outcome.

A hang cannot be undone in-process: a rank blocked in a gloo collective cannot be woken, and the
pairs of a group that lost a rank mid-collective are out of step. So at the deadline every rank's
watchdog publishes its stack, rank 0 writes the failure (with those stacks) into the record that
outlives the workers, and every rank exits; torchrun's ``--max-restarts`` starts them again with a
fresh process group, and the new attempt replays the judged cells from the record and goes on
after the failed one. A rank that dies is found the same way at the next attempt: it left neither
an outcome nor the note a rank stopped by torchrun leaves. That judgement, and the end of an attempt
and of the job, is :mod:`harness.torchrun.attempts`.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import tempfile
import time
import warnings
from typing import Any

from ..pool import wire
from ..pool.parent import FAILURE_GRACE, CaseFailure, LeftChanged, Outcome, failure_reason, fitting
from .attempts import POLL, RESTART_EXIT, STACK_GRACE, Attempts  # noqa: F401  (RESTART_EXIT, STACK_GRACE: re-exported)
from .session import Session
from .watchdog import Watchdog


class RankRunner(Attempts):
    """This rank's runner of cells: the pool's interface, in-process."""

    # a failing cell runs again to localise it: the other ranks follow rank 0's rounds (follow())
    can_rerun = True

    def __init__(self, session: Session, scratch_root: str | None = None):
        self.session = session
        self.rank, self.size, self.backend = session.rank, session.world, session.backend
        self.deadline = session.deadline
        self._meshes: dict[tuple, Any] = {}
        self._functions: dict[str, Any] = {}
        self._test = "none"  # hash of the running test's node id (see enter)
        self._task = 0  # rounds of run() within that test
        self._key = ""  # "<test>/<n>": the keys of the round running now
        self._current: dict | None = None  # nodeid and record of the cell running now
        self._gathered = False
        self.own_failures = 0  # cells in which this rank raised or hung (for its closing line)
        self.stderr: int | None = None  # fd of the launcher's stderr (see harness.plugin)
        root = scratch_root or os.environ.get("PARITYTEST_SCRATCH") or tempfile.gettempdir()
        self._job_scratch = os.path.join(root, f"paritytest-{session.env.run_id}-{session.env.master_port}")
        self._scratch = f"{self._job_scratch}-attempt{session.env.attempt}"
        self.watchdog = Watchdog()
        self._baseline = None  # what every cell must find in this process (harness.pool.state)
        self._last_key: str | None = None  # the last round's key, whose "disturbed" flag the next reads

    # ---- the pool's interface ------------------------------------------------------------
    def run(self, fn: str, payload: Any, mesh: tuple[tuple[str, int], ...], *, seed: int = 0,
            deadline: float | None = None, label: str = "", extra_meshes=(), gather: str | None = None,
            scratch: str | None = None, fresh: bool = False):
        """Run ``fn(ctx, payload)`` on this rank if it lies in ``mesh``; every rank must call it.

        ``gather="all"``: every rank returns every mesh rank's value (the pool's contract, for
        tests that use ``rank_pool`` directly); ``"first"``: rank 0 gets them, the others None
        (cells: only rank 0 judges). ``scratch`` is ignored: a rank's pytest ``tmp_path`` is its
        own, so the ranks share a directory under the job's scratch. ``fresh`` is ignored: a job's
        ranks cannot be replaced (they put back what the clean-start check can). Default: ``"first"`` inside a
        cell (:meth:`begin` with a record), else ``"all"``. Inside a cell, rank 0 announces each
        round and the other ranks run it when they see it (:meth:`follow`), so rank 0 may run more
        than one (a failing cell's localisation). Raises :class:`CaseFailure` on the gathering ranks
        when a rank raised; a rank that hangs ends the attempt (see the module docstring).
        """
        in_cell = bool(self._current and self._current.get("record") is not None)
        if gather is None:
            gather = "first" if in_cell else "all"
        if in_cell and self.rank == 0:
            self.session.set(f"{self._test}/{self._task + 1}/request",
                             {"fn": fn, "payload": payload, "mesh": mesh, "seed": seed, "deadline": deadline,
                              "label": label, "extra_meshes": tuple(extra_meshes)})
        mesh, extra, size = fitting(mesh, extra_meshes, self.size,
                                    "this torchrun job has {size}: launch at least {need} ranks")
        world = mesh.world
        deadline = self.deadline if deadline is None else deadline
        scratch = self._enter_round(mesh, extra, size, world, label, deadline)
        start = time.monotonic()
        key = self._key
        # early: rank 0 asks for the stacks before the deadline when a rank raised and the others hang
        self.watchdog.arm(deadline, lambda: self._expired(world, label, deadline, start),
                          early=lambda: self.rank != 0 and self.session.store.check([f"{key}/dump"]))
        self._publish(self._run_here(fn, payload, mesh, extra, seed, scratch, world, size, label))
        if gather == "first" and self.rank != 0:
            return None
        try:
            return self._gather(world, label, deadline, start)
        finally:
            if gather == "all":
                self.watchdog.disarm()

    def _enter_round(self, mesh: tuple, extra: tuple, size: int, world: int, label: str, deadline: float) -> str:
        """A round's setup on every rank: its world, its key, its meshes (collective over the world),
        its scratch directory, and on rank 0 what the next attempt must judge if this one dies in it."""
        from ..pool.groups import next_task, release
        from ..pool.rank import build_meshes

        cells = self.session.cell_world
        # every rank runs every round: the same generations everywhere. A world the last round's code
        # left disturbed on some rank (its default group destroyed or replaced, groups of its own
        # left) is made anew, as in the pool: every rank reads the same flag, published before rank
        # 0 judged that round
        disturbed = self._last_key is not None and self.session.store.check([f"{self._last_key}/disturbed"])
        if cells.current[0] != size or disturbed:
            cells.enter(size, cells.current[1] + 1)
            release(self._meshes, self.backend)
            if self._baseline is not None:
                self._baseline.rebase()
        self._task += 1
        # keyed by the test and the call's number within it, not a job-wide count: a rank that
        # skipped a round for any reason cannot read another test's outcomes or verdict as its own
        self._key, self._gathered = f"{self._test}/{self._task}", False
        next_task()
        # Collective over the cell's world, as in the pool's mesh build round: setup, not the case.
        if self.rank < size:
            with cells.inside(size):
                if build_meshes(self._meshes, (mesh, *extra), self.backend) and self._baseline is not None:
                    self._baseline.rebase()  # what torch installs lazily as it makes groups
        scratch = os.path.join(self._scratch, self._key)
        if self.rank < world:
            # only the ranks that run the task: one idle in it may reach this line after rank 0 has
            # judged the cell and every rank but the late ones has removed the job's scratch at its end
            os.makedirs(scratch, exist_ok=True)
        if self.rank == 0:  # what the next attempt must judge if this one dies inside the cell
            self.session.set("inflight", {"attempt": self.session.env.attempt, "key": self._key, "world": world,
                                          "label": label, "deadline": deadline, **(self._current or {})},
                             self.session.record)
        return scratch

    def _run_here(self, fn: str, payload: Any, mesh: tuple, extra: tuple, seed: int, scratch: str, world: int,
                  size: int, label: str = "") -> tuple:
        """This rank's part of the round, the pool's rank body (:func:`harness.pool.rank.run_task`):
        its reply, ``("idle", None)`` beyond the cell's world."""
        from ..pool.rank import run_task

        from ..pool.rank import Before
        from ..pool.state import Baseline

        self._last_key = self._key
        if self.rank >= world:
            return "idle", None
        if self._baseline is None:  # taken once, at the first cell: the session and its groups made
            self._baseline = Baseline.take()
        before = Before.now()
        out = run_task(self._functions, fn, payload, self.rank, mesh, extra, self._meshes, self.session.device,
                       self.backend, scratch, seed, size, inside=self.session.cell_world.inside(size))
        if out[0] == "raised":
            self.own_failures += 1
        # this process serves the next cell as it is: settings and code are put back in place
        left = before.left(self._baseline, self.session.cell_world, put_back_code=True)
        if left["world"]:
            self.session.store.set(f"{self._key}/disturbed", b"1")
        if left["told"]:
            warnings.warn(LeftChanged(f"{label or 'a task'} on rank {self.rank}: its code left its process "
                                      f"changed: {'; '.join(left['told'])}; put back before the next cell"),
                          stacklevel=3)
        return out

    def new_scratch(self, fresh: bool = False) -> None:
        """None: a rank's pytest ``tmp_path`` is its own, so the ranks share a directory under the
        job's scratch instead (:meth:`run`). ``fresh`` is ignored: a job's ranks cannot be replaced."""
        return None

    def alone(self, fn: str, payload: Any, mesh: tuple[tuple[str, int], ...], *, seed: int = 0,
              deadline: float | None = None, label: str = "") -> Any:
        """``fn(ctx, payload)`` on ``mesh`` (every degree 1) in a world of one, as the pool's
        :meth:`~harness.pool.parent.Pool.alone`: on rank 0, the job's other ranks following the round
        and idling. Rank 0's value there, None on the other ranks."""
        values = self.run(fn, payload, mesh, seed=seed, label=label, deadline=deadline)
        return None if values is None else values[0]

    def _publish(self, out: tuple) -> None:
        try:
            data = wire.dumps(out)
        except Exception as error:  # noqa: BLE001  e.g. a result holding a process group
            why = f"its result cannot be pickled for rank 0 ({type(error).__name__}: {error}); " \
                  "return tensors, Pieces and plain Python values"
            data = pickle.dumps(("raised", why))
        self.session.store.set(f"{self._key}/out/{self.rank}", data)

    def _gather(self, world: int, label: str, deadline: float, start: float) -> dict[int, Any]:
        """Every mesh rank's value, waiting as long as the watchdog lets this rank live."""
        store, pending, outs = self.session.store, set(range(world)), {}
        raised_at = None
        while pending:
            for r in sorted(pending):
                if store.check([f"{self._key}/out/{r}"]):
                    outs[r] = self.session.get(f"{self._key}/out/{r}")
                    pending.discard(r)
                    if outs[r][0] == "raised" and raised_at is None:
                        raised_at = time.monotonic()
            if not pending:
                break
            self._exit_if_restarting()
            # one rank raised and the others did not finish soon after: they wait in a collective it
            # never joined, so do not sit out the whole deadline (the pool's FAILURE_GRACE)
            if self.rank == 0 and raised_at is not None and time.monotonic() - raised_at > FAILURE_GRACE:
                self.watchdog.disarm()
                self.session.store.set(f"{self._key}/dump", b"1")  # the stuck ranks' watchdogs fire now
                self._expired(world, label, deadline, start)
            time.sleep(POLL)
        self._gathered = True
        outcomes = {r: Outcome.of_reply(r, status, value) for r, (status, value) in outs.items()}
        if all(o.status in ("ok", "idle") for o in outcomes.values()):
            return {r: outcomes[r].value for r in range(world)}
        raised = [r for r, o in sorted(outcomes.items()) if o.status == "raised"]
        raise CaseFailure(failure_reason(label, time.monotonic() - start, [("raised", raised)]), outcomes, world)

    # ---- verdicts ------------------------------------------------------------------------
    def enter(self, nodeid: str) -> None:
        """A test starts (every rank, from the plugin's setup hook): its rounds are numbered from 1."""
        self._test = hashlib.sha1(nodeid.encode()).hexdigest()[:16]
        self._task = 0
        self._key = f"{self._test}/0"

    def begin(self, nodeid: str, record: dict | None) -> None:
        """The test about to call :meth:`run`: its record is what a hang or death is reported in."""
        self._current = {"nodeid": nodeid, "record": dict(record) if record is not None else None}

    def recorded(self, nodeid: str) -> dict | None:
        """The verdict an earlier attempt of this job gave ``nodeid`` (then it is not run again).

        Only an earlier attempt's: in this attempt rank 0 may already have judged a cell that a slow
        rank, idle in it, has not reached yet; that rank must still run the cell's round (mesh
        build, outcome) or its task numbering would fall one behind the others'."""
        key = f"verdict/{nodeid}"
        if not self.session.has(key, self.session.record):
            return None
        verdict = self.session.get(key, self.session.record)
        return verdict if verdict.get("attempt", -1) < self.session.env.attempt else None

    def share_verdict(self, failure: str | None, record: dict) -> None:
        """Rank 0: publish the cell's verdict to the other ranks and into the job's record."""
        verdict = {"failure": failure, "record": record, "restart": False, "attempt": self.session.env.attempt}
        self.session.set(f"{self._key}/verdict", verdict)
        if self._current:
            self.session.set(f"verdict/{self._current['nodeid']}", verdict, self.session.record)
        self._done()

    def follow(self) -> dict:
        """Other ranks, in a cell: run every round rank 0 announces (the cell, then its localisation
        when it fails), in order, until rank 0's verdict of the cell."""
        while True:
            request = f"{self._test}/{self._task + 1}/request"
            if self.session.has(request):
                self.run(**self.session.get(request))
                continue
            key = f"{self._key}/verdict"
            if self.session.has(key):
                verdict = self.session.get(key)
                if verdict["restart"]:
                    self._exit_for_restart()
                self._done()
                return verdict
            time.sleep(POLL)

    def _done(self) -> None:
        self.watchdog.disarm()
        if self.rank == 0:
            self.session.record.delete_key("inflight")
            shutil.rmtree(os.path.join(self._scratch, self._key), ignore_errors=True)
        self._current = None



def start(backend: str = "auto", deadline: float = 30.0, stderr: int | None = None) -> RankRunner:
    """This process's session and runner, from torchrun's environment: SIGTERM blocked before any
    thread exists, then the store and the process group, then the SIGTERM thread."""
    from .session import LaunchEnv
    from .watchdog import block_sigterm

    from ..pool.rank import warm_up

    block_sigterm()
    session = Session(LaunchEnv.from_env(), backend, deadline)
    runner = RankRunner(session)
    runner.stderr = stderr
    runner.install_sigterm_note()
    # the lazy imports a first cell would pay inside its deadline (as the pool's zygote does)
    warm_up()
    return runner
