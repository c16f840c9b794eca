"""How busy each pytest-xdist worker was: its first test's start, its last test's end, and the seconds
in between that it spent in tests.

A matrix run on two cores is only as fast as its emptiest worker: one that starts late (collection,
the pool's start) or ends early (the other still has a long cell) leaves a core idle. The run's
summary prints one line per worker so that those phases are measured, not guessed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Worker:
    first: float = float("inf")  # epoch seconds: the start of its first test phase
    last: float = 0.0  # the end of its last
    busy: float = 0.0  # seconds in setup, call and teardown of its tests


class Timeline:
    """Collects test reports (on the xdist controller, or the one process without xdist)."""

    def __init__(self):
        self.start = time.time()
        self.workers: dict[str, Worker] = {}

    def add(self, report) -> None:
        start, stop = getattr(report, "start", None), getattr(report, "stop", None)
        if start is None or stop is None:
            return
        gateway = getattr(getattr(report, "node", None), "gateway", None)
        worker = self.workers.setdefault(getattr(gateway, "id", "main"), Worker())
        worker.first, worker.last = min(worker.first, start), max(worker.last, stop)
        worker.busy += stop - start

    def lines(self) -> list[str]:
        """One line per worker, times from the session's start to now; empty without reports."""
        end = time.time()
        wall = end - self.start
        return [f"{name}: in tests {w.busy:.1f} s of {wall:.1f} s wall ({w.busy / wall:.0%}); first test at "
                f"{w.first - self.start:.1f} s, last ended at {w.last - self.start:.1f} s "
                f"(idle {w.first - self.start:.1f} s at the start, {end - w.last:.1f} s at the end)"
                for name, w in sorted(self.workers.items())]
