"""Restart judgement under torchrun: what ends an attempt and what the next one makes of it.

A hang cannot be undone in-process (:mod:`harness.torchrun.runner`): at the deadline rank 0 gathers
the stuck ranks' stacks, writes the failure into the record that outlives the workers and every
rank exits with :data:`RESTART_EXIT`; torchrun's ``--max-restarts`` starts them again, and the next
attempt replays the judged cells. A rank that died is judged at the next attempt (:meth:`recover`):
it left neither an outcome nor the note a rank stopped by torchrun leaves. :class:`Attempts` is
:class:`~harness.torchrun.runner.RankRunner`'s half that does this, on its state.
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import traceback

from ..pool.parent import CaseFailure, Outcome, deadline_reason, failure_reason, summarize_stack
from .session import SETUP_TIMEOUT
from .watchdog import main_stack, on_sigterm

# torchrun restarts the workers on any non-zero exit; this one says "exited to replace the group"
RESTART_EXIT = 75
# How long rank 0 waits, after the deadline, for the stacks of the ranks still running the cell.
STACK_GRACE = 5.0
POLL = 0.02


class Attempts:
    """A rank's judgement of hangs and deaths, the end of an attempt and of the job: mixed into
    :class:`harness.torchrun.runner.RankRunner`, whose state (``session``, ``rank``, ``_key``,
    ``_current``, ``_gathered``, ...) it reads."""

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
                outcomes[r] = Outcome.of_reply(r, *self.session.get(f"{key}/out/{r}"))
            else:
                stuck.append(r)
        self.session.wait_all([f"{key}/stack/{r}" for r in stuck], STACK_GRACE)
        who = self.session.who()
        for r in stuck:
            if self.session.has(f"{key}/stack/{r}"):
                summary, stack = summarize_stack(self.session.get(f"{key}/stack/{r}"), os.getcwd())
                outcomes[r] = Outcome(r, "hung", detail=stack, summary=f"{summary} [{self.where(r, who)}]")
            else:
                outcomes[r] = Outcome(r, "died", summary=f"no outcome and no stack: the process is gone "
                                                         f"[{self.where(r, who)}]")
        raised = [r for r, o in sorted(outcomes.items()) if o.status == "raised"]
        if not raised:
            reason = deadline_reason(label, deadline, stuck)
        else:
            reason = failure_reason(label, time.monotonic() - start, [("raised", raised), ("still running", stuck)])
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
        self.say(f"\n{text}{note}\n")
        self._exit_for_restart()

    def say(self, text: str) -> None:
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

    def where(self, rank: int, who: dict | None = None) -> str:
        """Where ``rank`` runs (host, local rank, node, pid), from ``who`` or the store."""
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
                outcomes[r] = Outcome.of_reply(r, *session.get(key, store))
            elif session.has(f"{info['key']}/term/{r}", store):
                outcomes[r] = Outcome(r, "stopped", summary=f"stopped by torchrun (SIGTERM) [{self.where(r, who)}]")
            else:
                dead.append(r)
                outcomes[r] = Outcome(r, "died", summary=f"process died inside the cell [{self.where(r, who)}]")
        label = info.get("label") or info["nodeid"]
        named = "; ".join(f"rank {r} ({self.where(r, who)})" for r in dead) or "no rank left a record"
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
    def finish(self, ending: dict) -> dict[int, dict]:
        """Every rank says how its pytest ends: ``ending`` is ``{"status": exit status, "error": the
        traceback of an exception that ends it or None, "failed": {node id: the failure's
        headline}}``. Rank 0 waits for all (a rank-0-hosted store must outlive the others' last reads)
        and records the exit status of a job whose tests all ran, so that a restart torchrun makes
        because of that status only repeats it.

        Returns the endings that differ from rank 0's, by rank: on rank 0 every such rank's; on
        another rank, its own when it differs. The verdicts are rank 0's on every rank, so such a
        rank failed where rank 0's report cannot see it: outside the cells (a fixture, a plugin's
        hook) or in a test of its own."""
        session = self.session
        session.set(f"finished/{self.rank}", ending)
        if self.rank == 0:
            session.wait_all([f"finished/{r}" for r in range(self.size)], 60.0)
            if ending["status"] in (0, 1, 5):  # passed, failed, nothing collected: not an interrupted run
                session.set("complete", ending["status"], session.record)
            theirs = {r: session.get(f"finished/{r}") for r in range(1, self.size) if session.has(f"finished/{r}")}
            odd = {r: end for r, end in theirs.items() if differs(end, ending)}
        else:  # rank 0 ends with the same verdicts at about the same moment
            session.wait_all(["finished/0"], 30.0)
            first = session.get("finished/0") if session.has("finished/0") else None
            odd = {self.rank: ending} if ending["error"] or (first is not None and differs(ending, first)) else {}
        # this attempt's, and those of earlier attempts that ended at a hang or a death
        for attempt in range(session.env.attempt + 1):
            shutil.rmtree(f"{self._job_scratch}-attempt{attempt}", ignore_errors=True)
        return odd

    def finished_before(self) -> int | None:
        """The exit status an earlier attempt of this job finished with, or None."""
        if self.session.env.attempt == 0 or not self.session.has("complete", self.session.record):
            return None
        return int(self.session.get("complete", self.session.record))


def differs(ending: dict, first: dict) -> bool:
    """A rank's ending (see :meth:`Attempts.finish`) is worse than rank 0's: an exception, a test that
    failed there and not on rank 0, or another exit status than rank 0's that is not a success."""
    return bool(ending["error"] or set(ending["failed"]) - set(first["failed"])
                or (ending["status"] not in (0, 5) and ending["status"] != first["status"]))
