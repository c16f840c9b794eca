"""Trials: one config run in the warm pool (or by an oracle command), judged, logged, budgeted."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from ..cell import CellOutcome, NotJudged, execute
from ..compare.diff import compare
from ..config import Config
from ..layout import AssemblyError
from ..pool.parent import CaseFailure, Pool, PoolError
from ..resolve import resolve
from ..screen import WIDTH, fitted
from ..world import split_nothing
from .shrink import Budget
from .signature import Signature, of_report

# git bisect's conventions, and ours beyond them
EXIT = {"good": 0, "bad": 1, "usage": 2, "nondeterministic": 3, "budget": 4, "skip": 125}


@dataclass
class Trial:
    cfg: Config
    signature: Signature
    seconds: float
    outcome: CellOutcome | None = None


@dataclass
class Trials:
    """Runs trials against a budget, logs each as a JSON line and shows progress on stderr."""

    pool: Pool | None
    log: TextIO | None = None
    max_trials: int = 40
    max_seconds: float = 120.0
    oracle: list[str] | None = None  # a command instead of the pool
    quiet: bool = False
    count: int = 0
    start: float = field(default_factory=time.monotonic)
    best: Config | None = None

    def run(self, cfg: Config, *, counted: bool = True) -> Trial:
        if counted:
            if self.count >= self.max_trials:
                raise Budget(f"{self.max_trials} trials (--max-trials)")
            if time.monotonic() - self.start > self.max_seconds:
                raise Budget(f"{self.max_seconds:g} s (--max-seconds)")
            self.count += 1
        begin = time.perf_counter()
        trial = self._oracle(cfg) if self.oracle else self._in_pool(cfg)
        trial.seconds = time.perf_counter() - begin
        self._record(trial)
        return trial

    def _in_pool(self, cfg: Config) -> Trial:
        cell = resolve(cfg, self.pool.size)  # a declared divergence is run: it is what bisect looks for
        if cell.disposition.kind in ("invalid", "skip"):
            return Trial(cfg, Signature(cell.disposition.kind, detail=cell.disposition.reason), 0.0)
        try:
            outcome = execute(cell, self.pool)
        except NotJudged as error:
            return Trial(cfg, Signature("skip", detail=str(error)), 0.0)
        except CaseFailure as error:
            vacuous = split_nothing(error)
            if vacuous:  # a config whose mesh the implementation does not use: no verdict to find
                return Trial(cfg, Signature("invalid", detail=vacuous), 0.0)
            return Trial(cfg, Signature(error.kind, detail=_first_failure(error)), 0.0)
        except (AssemblyError, PoolError) as error:
            return Trial(cfg, Signature("crash", detail=str(error).splitlines()[0]), 0.0)
        return Trial(cfg, of_report(outcome.parity, cfg.mesh), 0.0, outcome)

    def _oracle(self, cfg: Config) -> Trial:
        command = [part.replace("{}", cfg.id) for part in self.oracle]
        done = subprocess.run(command, env=dict(os.environ, PARITY_CONFIG=cfg.id), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        code = done.returncode
        if code == 0:
            return Trial(cfg, Signature("match"), 0.0)
        if code == EXIT["skip"]:
            return Trial(cfg, Signature("skip", detail="the oracle exited 125"), 0.0)
        if 0 < code < 128:
            return Trial(cfg, Signature("bad", detail=f"the oracle exited {code}"), 0.0)
        raise RuntimeError(f"the oracle {shlex.join(command)} exited {code} (128 or more: killed or aborted)")

    def _record(self, trial: Trial) -> None:
        elapsed = time.monotonic() - self.start
        if self.log:
            self.log.write(json.dumps({"trial": self.count, "config": trial.cfg.id, "kind": trial.signature.kind,
                                       "tensors": list(trial.signature.tensors), "detail": trial.signature.detail,
                                       "seconds": round(trial.seconds, 3), "elapsed": round(elapsed, 3)}) + "\n")
            self.log.flush()
        if not self.quiet:
            width = 24
            done = min(width, round(width * self.count / max(1, self.max_trials)))
            bar = "#" * done + "." * (width - done)
            line = (f"[{bar}] {self.count:>3}/{self.max_trials} {elapsed:6.1f}s {trial.signature.kind:<9}"
                    f"{trial.cfg.id}")
            best = f"best: {self.best.id}" if self.best else ""
            if best:  # on the same line where both fit the screen, else on its own, as fitted() continues one
                line += f" {best}" if len(line) + 1 + len(best) <= WIDTH else f"\n  {best}"
            print("\r" + fitted(line), file=sys.stderr, flush=True)

    def same(self, first: Trial, second: Trial) -> bool:
        """Two runs of one config agree: the same kind of failure in the same tensors, and results
        equal within tolerance (details such as a crash's timing may differ)."""
        if (first.signature.kind, first.signature.tensors) != (second.signature.kind, second.signature.tensors):
            return False
        if first.outcome is None or second.outcome is None:
            return True
        return compare(first.outcome.result, second.outcome.result, first.outcome.tol).ok


def _first_failure(error: CaseFailure) -> str:
    """The first rank that raised, hung or died, in one line: what is the same from run to run
    (the case's own message carries its timing)."""
    for rank in sorted(error.outcomes):
        outcome = error.outcomes[rank]
        if outcome.status in ("raised", "hung", "died"):
            return outcome.line()
    return error.reason
