"""Deadlines and last words of a torchrun rank, on threads that a hung main thread cannot block.

* :class:`Watchdog`: armed for each cell; at the deadline it takes the main thread's Python stack
  (``sys._current_frames``, readable while the main thread sits in a gloo wait, which releases the
  GIL) and hands it to a callback that publishes it through the store.
* :func:`on_sigterm`: torchrun stops the surviving workers with SIGTERM when one dies. A Python
  signal handler would only run once the main thread returns to the interpreter, which a rank
  blocked in a collective never does; so SIGTERM is blocked in every thread and taken by a thread of
  its own with ``sigwait``, which records that this rank was stopped (not dead) before it exits.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable


def main_stack(thread_id: int | None = None, outermost: str = "") -> str:
    """The main thread's stack in faulthandler's layout (innermost first), so that
    :func:`harness.pool.summarize_stack` reads it as it reads a pool rank's dump.

    ``outermost``: a file path suffix; frames outside the first frame in that file are left out
    (pytest's and the plugin's plumbing, the same on every rank and in every cell).
    """
    ident = threading.main_thread().ident if thread_id is None else thread_id
    frame = sys._current_frames().get(ident)
    lines = [f"Thread 0x{ident:016x} (most recent call first):"]
    while frame is not None:
        code = frame.f_code
        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}')
        if outermost and code.co_filename.endswith(outermost):
            break
        frame = frame.f_back
    return "\n".join(lines)


EARLY_POLL = 0.25


class Watchdog:
    """One daemon thread; :meth:`arm` before a cell, :meth:`disarm` once its verdict is known."""

    def __init__(self):
        self._lock = threading.Condition()
        self._due: float | None = None
        self._fire: Callable[[], None] | None = None
        self._early: Callable[[], bool] | None = None
        self._generation = 0
        threading.Thread(target=self._loop, name="paritytest-watchdog", daemon=True).start()

    def arm(self, seconds: float, fire: Callable[[], None], early: Callable[[], bool] | None = None) -> None:
        """Call ``fire()`` on the watchdog thread if :meth:`disarm` has not come ``seconds`` from now,
        or as soon as ``early()`` (asked every ``EARLY_POLL`` s) says so."""
        with self._lock:
            self._due, self._fire, self._early = time.monotonic() + seconds, fire, early
            self._generation += 1
            self._lock.notify()

    def disarm(self) -> None:
        with self._lock:
            self._due, self._fire = None, None
            self._generation += 1
            self._lock.notify()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self._due is None or time.monotonic() < self._due:
                    if self._due is not None and self._early is not None and self._early():
                        break
                    wait = None if self._due is None else max(0.0, self._due - time.monotonic())
                    self._lock.wait(wait if self._early is None or wait is None else min(wait, EARLY_POLL))
                fire, self._due, self._fire, self._early = self._fire, None, None, None
            if fire is not None:
                try:
                    fire()
                except BaseException as error:  # noqa: BLE001  a dying watchdog must still say why
                    print(f"paritytest watchdog: {type(error).__name__}: {error}", file=sys.__stderr__, flush=True)


def block_sigterm() -> None:
    """Block SIGTERM in this (main) thread, and so in every thread started after it (the process
    group's, the watchdog): only :func:`on_sigterm`'s thread will take it. Call it first."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def on_sigterm(last_words: Callable[[], None]) -> None:
    """Run ``last_words()`` then exit when torchrun sends SIGTERM, whatever the main thread is doing
    (after :func:`block_sigterm`; without ``pthread_sigmask`` Python's default handling stays)."""
    if not hasattr(signal, "pthread_sigmask"):
        return

    def wait() -> None:
        signal.sigwait({signal.SIGTERM})
        try:
            last_words()
        finally:
            sys.__stderr__.flush()
            os._exit(128 + signal.SIGTERM)

    threading.Thread(target=wait, name="paritytest-sigterm", daemon=True).start()
