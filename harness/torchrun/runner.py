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
an outcome nor the note a rank stopped by torchrun leaves.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

from ..world import explained
from ..pool.parent import FAILURE_GRACE, CaseFailure, Outcome, fitting, summarize_stack
from .session import SETUP_TIMEOUT, Session
from .watchdog import Watchdog, main_stack, on_sigterm

# torchrun restarts the workers on any non-zero exit; this one says "exited to replace the group"
RESTART_EXIT = 75
# How long rank 0 waits, after the deadline, for the stacks of the ranks still running the cell.
STACK_GRACE = 5.0
POLL = 0.02


class RankRunner:
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

    # ---- the pool's interface ------------------------------------------------------------
    def run(self, fn: str, payload: Any, mesh: tuple[tuple[str, int], ...], *, seed: int = 0,
            deadline: float | None = None, label: str = "", extra_meshes=(), gather: str | None = None,
            scratch: str | None = None):
        """Run ``fn(ctx, payload)`` on this rank if it lies in ``mesh``; every rank must call it.

        ``gather="all"``: every rank returns every mesh rank's value (the pool's contract, for
        tests that use ``rank_pool`` directly); ``"first"``: rank 0 gets them, the others None
        (cells: only rank 0 judges). ``scratch`` is ignored: a rank's pytest ``tmp_path`` is its
        own, so the ranks share a directory under the job's scratch. Default: ``"first"`` inside a
        cell (:meth:`begin` with a record), else ``"all"``. Inside a cell, rank 0 announces each
        round and the other ranks run it when they see it (:meth:`follow`), so rank 0 may run more
        than one (a failing cell's localisation). Raises :class:`CaseFailure` on the gathering ranks
        when a rank raised; a rank that hangs ends the attempt (see the module docstring).
        """
        from ..paths import load
        from ..pool.rank import build_meshes, context, seed_rank

        in_cell = bool(self._current and self._current.get("record") is not None)
        if gather is None:
            gather = "first" if in_cell else "all"
        if in_cell and self.rank == 0:
            self.session.set(f"{self._test}/{self._task + 1}/request",
                             {"fn": fn, "payload": payload, "mesh": mesh, "seed": seed, "deadline": deadline,
                              "label": label, "extra_meshes": tuple(extra_meshes)})
        mesh = tuple(mesh)
        world, size, extra = fitting(mesh, extra_meshes, self.size,
                                     "this torchrun job has {size}: launch at least {need} ranks")
        cells = self.session.cell_world
        if cells.current[0] != size:  # every rank runs every round: the same generations everywhere
            cells.enter(size, cells.current[1] + 1)
            self._meshes.clear()
        deadline = self.deadline if deadline is None else deadline
        self._task += 1
        # keyed by the test and the call's number within it, not a job-wide count: a rank that
        # skipped a round for any reason cannot read another test's outcomes or verdict as its own
        self._key, self._gathered = f"{self._test}/{self._task}", False
        # Collective over the cell's world, as in the pool's mesh build round: setup, not the case.
        if self.rank < size:
            with cells.inside(size):
                build_meshes(self._meshes, (mesh, *extra), self.backend)
        scratch = os.path.join(self._scratch, self._key)
        os.makedirs(scratch, exist_ok=True)
        if self.rank == 0:  # what the next attempt must judge if this one dies inside the cell
            self.session.set("inflight", {"attempt": self.session.env.attempt, "key": self._key, "world": world,
                                          "label": label, "deadline": deadline, **(self._current or {})},
                             self.session.record)
        start = time.monotonic()
        key = self._key
        # early: rank 0 asks for the stacks before the deadline when a rank raised and the others hang
        self.watchdog.arm(deadline, lambda: self._expired(world, label, deadline, start),
                          early=lambda: self.rank != 0 and self.session.store.check([f"{key}/dump"]))
        if self.rank < world:
            try:
                if fn not in self._functions:
                    self._functions[fn] = load(fn)
                seed_rank(seed, self.rank)
                ctx = context(self.rank, mesh, extra, self._meshes, self.session.device, self.backend, scratch)
                with cells.inside(size):
                    out = ("ok", self._functions[fn](ctx, payload))
            except BaseException as error:  # noqa: BLE001  goes to rank 0 with its traceback, as in the pool
                out = ("raised", explained(error, size) or traceback.format_exc())
                self.own_failures += 1
        else:
            out = ("idle", None)
        self._publish(out)
        if gather == "first" and self.rank != 0:
            return None
        try:
            return self._gather(world, label, deadline, start)
        finally:
            if gather == "all":
                self.watchdog.disarm()

    def new_scratch(self) -> None:
        """None: a rank's pytest ``tmp_path`` is its own, so the ranks share a directory under the
        job's scratch instead (:meth:`run`)."""
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
            data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
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
        outcomes = {r: Outcome(r, status, value=value) if status != "raised" else
                    Outcome(r, "raised", detail=value, summary=(value.strip().splitlines() or ["exception"])[-1])
                    for r, (status, value) in outs.items()}
        if all(o.status in ("ok", "idle") for o in outcomes.values()):
            return {r: outcomes[r].value for r in range(world)}
        elapsed = time.monotonic() - start
        what = f"case {label} " if label else "case "
        raise CaseFailure(f"{what}failed after {elapsed:.1f} s: raised on ranks "
                          f"{[r for r, o in sorted(outcomes.items()) if o.status == 'raised']}", outcomes, world)

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

    # ---- hangs -----------------------------------------------------------------------------
    def _expired(self, world: int, label: str, deadline: float, start: float) -> None:
        """The deadline passed (watchdog thread), or on rank 0 a rank raised and others are stuck.
        Whatever goes wrong in here, rank 0 still ends the attempt: the others wait for it."""
        try:
            self._judge_stuck(world, label, deadline, start)
        except BaseException:  # noqa: BLE001
            if self.rank == 0 and not self._gathered:
                self._end_attempt(f"case {label} passed its deadline of {deadline:.1f} s, and gathering the "
                                  f"ranks' stacks failed:\n{traceback.format_exc()}", "hang")
            raise

    def _judge_stuck(self, world: int, label: str, deadline: float, start: float) -> None:
        key, store = self._key, self.session.store
        if not store.check([f"{key}/out/{self.rank}"]):  # this rank is still in the cell: say where
            self.own_failures += 1
            self.session.set(f"{key}/stack/{self.rank}", main_stack(outermost=os.path.join("harness", "torchrun", "runner.py")))
        elif self.rank != 0:
            return  # done with its part: its main thread waits for the verdict and acts on it
        if self.rank != 0:
            # late or stuck: rank 0 decides. A restart verdict ends this process; a normal verdict, or
            # the main thread moving on to the next task (a slow rank, not a stuck one), ends the wait.
            while self._key == key and not store.check([f"{key}/verdict"]):
                self._exit_if_restarting()
                time.sleep(POLL)
            self._exit_if_restarting(key)
            return
        if self._gathered:
            return
        outcomes: dict[int, Outcome] = {}
        stuck = []
        for r in range(world):
            if store.check([f"{key}/out/{r}"]):
                status, value = self.session.get(f"{key}/out/{r}")
                outcomes[r] = Outcome(r, status, detail=value if status == "raised" else "",
                                      summary=(str(value).strip().splitlines() or [""])[-1] if status == "raised" else "")
            else:
                stuck.append(r)
        self.session.wait_all([f"{key}/stack/{r}" for r in stuck], STACK_GRACE)
        who = self.session.who()
        for r in stuck:
            if self.session.has(f"{key}/stack/{r}"):
                summary, stack = summarize_stack(self.session.get(f"{key}/stack/{r}"), os.getcwd())
                outcomes[r] = Outcome(r, "hung", detail=stack, summary=f"{summary} [{self._where(r, who)}]")
            else:
                outcomes[r] = Outcome(r, "died", summary=f"no outcome and no stack: the process is gone "
                                                         f"[{self._where(r, who)}]")
        what = f"case {label} " if label else "case "
        raised = [r for r, o in sorted(outcomes.items()) if o.status == "raised"]
        if not raised:
            reason = f"{what}passed its deadline of {deadline:.1f} s: ranks {stuck} still running"
        else:
            reason = f"{what}failed after {time.monotonic() - start:.1f} s: raised on ranks {raised}, " \
                     f"still running on ranks {stuck}"
        failure = CaseFailure(reason, outcomes, world)
        self._end_attempt(str(failure), failure.kind)

    def _end_attempt(self, text: str, kind: str) -> None:
        """Rank 0: record the failed cell, tell every rank, and exit so torchrun replaces the group."""
        note = (f"\n[torchrun] attempt {self.session.env.attempt} ends here: a rank is stuck, so the process group "
                "cannot be trusted; every rank exits and, with torchrun --max-restarts, the next attempt "
                "resumes after this cell")
        current = self._current or {}
        record = dict(current.get("record") or {})
        record.update(status="failed", kind=kind)
        verdict = {"failure": text + note, "record": record, "restart": True, "attempt": self.session.env.attempt}
        if current.get("nodeid") and record:
            self.session.set(f"verdict/{current['nodeid']}", verdict, self.session.record)
        self.session.record.delete_key("inflight")
        self.session.set(f"{self._key}/verdict", verdict)
        self._say(f"\n{text}{note}\n")
        self._exit_for_restart()

    def _say(self, text: str) -> None:
        """Write to the launcher's stderr: pytest's capture may hold fd 2 when a rank must exit."""
        if self.stderr is not None:
            os.write(self.stderr, text.encode())
        else:
            print(text, file=sys.__stderr__, flush=True)

    def _exit_if_restarting(self, task: str | None = None) -> None:
        key = f"{task or self._key}/verdict"
        if self.session.has(key) and self.session.get(key)["restart"]:
            self._exit_for_restart()

    def _exit_for_restart(self) -> None:
        sys.stdout.flush()
        sys.__stderr__.flush()
        os._exit(RESTART_EXIT)

    def _where(self, rank: int, who: dict | None = None) -> str:
        info = (who if who is not None else self.session.who()).get(rank)
        if not info:
            return "host unknown"
        return f"host {info['host']}, local rank {info['local_rank']}, node {info['node']}, pid {info['pid']}"

    # ---- after a restart ---------------------------------------------------------------------
    def recover(self) -> None:
        """Before any cell of a restarted attempt: rank 0 judges the cell the previous attempt died
        in (a rank that left no outcome, no stack and no SIGTERM note died), then every rank goes on."""
        session = self.session
        if self.rank == 0 and session.has("inflight", session.record):
            info = session.get("inflight", session.record)
            if info.get("record") is not None and not session.has(f"verdict/{info['nodeid']}", session.record):
                self._judge_death(info)
            session.record.delete_key("inflight")
        if self.rank == 0:
            session.set("recovered", True)
        elif session.wait_all(["recovered"], SETUP_TIMEOUT):
            raise RuntimeError(f"rank 0 did not finish recovering the previous attempt within {SETUP_TIMEOUT:g} s")

    def _judge_death(self, info: dict) -> None:
        session = self.session
        store = session.attempt_store(info["attempt"])
        who = session.who(info["attempt"])
        outcomes, dead = {}, []
        for r in range(info["world"]):
            key = f"{info['key']}/out/{r}"
            if session.has(key, store):
                status, value = session.get(key, store)
                outcomes[r] = Outcome(r, status, detail=value if status == "raised" else "",
                                      summary=(str(value).strip().splitlines() or [""])[-1] if status == "raised" else "")
            elif session.has(f"{info['key']}/term/{r}", store):
                outcomes[r] = Outcome(r, "stopped", summary=f"stopped by torchrun (SIGTERM) [{self._where(r, who)}]")
            else:
                dead.append(r)
                outcomes[r] = Outcome(r, "died", summary=f"process died inside the cell [{self._where(r, who)}]")
        label = info.get("label") or info["nodeid"]
        named = "; ".join(f"rank {r} ({self._where(r, who)})" for r in dead) or "no rank left a record"
        reason = (f"case {label} failed: a rank died during it, torchrun stopped the job and restarted it "
                  f"(attempt {info['attempt']} -> {session.env.attempt}); died: {named}")
        failure = CaseFailure(reason, outcomes, info["world"])
        record = dict(info["record"])
        record.update(status="failed", kind="crash")
        # judged now, for the attempt that died: replayed from here on
        verdict = {"failure": str(failure), "record": record, "restart": False, "attempt": info["attempt"]}
        session.set(f"verdict/{info['nodeid']}", verdict, session.record)

    def install_sigterm_note(self) -> None:
        """When torchrun stops this rank, note it in the store: at the next attempt a rank without
        that note, without an outcome, is the one that died."""

        def note() -> None:
            if self._key:
                self.session.store.set(f"{self._key}/term/{self.rank}", b"1")

        def bounded() -> None:  # torchrun's SIGKILL follows after 30 s: never spend them on the store
            writer = threading.Thread(target=note, daemon=True)
            writer.start()
            writer.join(2.0)

        on_sigterm(bounded)

    # ---- the end of the job -------------------------------------------------------------------
    def finish(self, status: int) -> None:
        """Every rank says it is done; rank 0 waits for all (a rank-0-hosted store must outlive the
        others' last reads) and records the exit status of a job whose tests all ran, so that a
        restart torchrun makes because of that status only repeats it."""
        session = self.session
        session.set(f"finished/{self.rank}", status)
        if self.rank == 0:
            session.wait_all([f"finished/{r}" for r in range(self.size)], 60.0)
            if status in (0, 1, 5):  # passed, failed, nothing collected: not an interrupted run
                session.set("complete", status, session.record)
        # this attempt's, and those of earlier attempts that ended at a hang or a death
        for attempt in range(session.env.attempt + 1):
            shutil.rmtree(f"{self._job_scratch}-attempt{attempt}", ignore_errors=True)

    def finished_before(self) -> int | None:
        """The exit status an earlier attempt of this job finished with, or None."""
        if self.session.env.attempt == 0 or not self.session.has("complete", self.session.record):
            return None
        return int(self.session.get("complete", self.session.record))


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
