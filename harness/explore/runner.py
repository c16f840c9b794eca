"""One exploration: hypothesis draws configs, the warm pool runs them, a failure is shrunk and located.

Each drawn config is one bisect trial (:class:`harness.bisect.runner.Trials`: validated, skipped
or run in the pool, judged into a :class:`~harness.bisect.signature.Signature`). The first failure
fixes the signature to keep; hypothesis then shrinks while a smaller config still fails that way
(a different failure met on the way is noted, not chased), bisect's field-by-field search
(:class:`harness.bisect.shrink.Search`) finishes the shrink, and the minimal config goes to
bisect's localisation. The example database keeps the failing example under a key per component and
implementation, so the next run replays it before drawing anything new, until it passes.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import Unsatisfiable, UnsatisfiedAssumption

from ..bisect.localise import located
from ..bisect.runner import Trial, Trials
from ..bisect.shrink import Budget as SearchBudget
from ..bisect.shrink import Search
from ..bisect.signature import Signature
from ..commands import harness_command
from ..config import Config
from ..pool.parent import Pool
from ..screen import fitted
from .strategies import configs, within


DATABASE = Path(".hypothesis") / "explore"  # hypothesis's example database, under the project's rootdir


def database_key(component: str, impl: str) -> bytes:
    """The example database's key of one target: stable across edits of this code."""
    return f"paritytest.explore:{component}:{impl}".encode()


def database(path: Path | None) -> DirectoryBasedExampleDatabase | None:
    return DirectoryBasedExampleDatabase(str(path)) if path is not None else None


def ignored(tensor: str, names: tuple[str, ...]) -> bool:
    """``--ignore loss`` covers ``loss`` and every ``.../loss`` (``resumed/loss``)."""
    return any(tensor == name or tensor.endswith("/" + name) for name in names)


class Found(AssertionError):
    """Raised inside the hypothesis test when a config fails the way the first failure did."""


class Spent(KeyboardInterrupt):
    """The budget ran out: stops hypothesis at once. Every failing example it met is already in its
    database. A KeyboardInterrupt because that is the one exception hypothesis passes through without
    saving the example that raised it: any other BaseException's example goes into the database as a
    failure, and the next run replayed a config that passes (a shrink cut short by its seconds)."""


@dataclass
class Exploration:
    """What one target's exploration did; ``minimal`` is set when it found a divergence."""

    component: str
    impl: str
    trials: int = 0  # configs run in the pool (a config met again is not run again)
    drawn: int = 0  # examples hypothesis drew, invalid ones included
    rejected: int = 0  # of them, draws that found no config that runs here (invalid to hypothesis)
    seconds: float = 0.0
    stored: int = 0  # examples the database held for this target at the start
    minimal: Config | None = None
    signature: Signature | None = None
    first: Config | None = None  # the first failing config, before shrinking
    found_trial: int = 0  # the trial that found it, and when
    found_seconds: float = 0.0
    replayed: bool = False  # found among the stored examples
    others: dict[str, str] = field(default_factory=dict)  # other failures (and ignored ones): id -> signature
    not_judged: str = ""  # why a drawn config's reference cannot judge it (a model drawing random numbers)
    essential: list[str] = field(default_factory=list)  # fields bisect's search could not simplify
    localisation: object | None = None
    budget: str = ""  # why it stopped early, if it did

    @property
    def target(self) -> str:
        return f"{self.component}:{self.impl}"

    def summary(self, database: str, modules: list[str]) -> str:
        """The closing lines: what was found and how, where it starts, the command that reproduces
        it and the line that adds it to the fixed matrix (``modules``: the test modules with cells
        of this component); or that nothing was found."""
        if self.not_judged:
            return f"{self.target}: not explored: {self.not_judged}"
        if self.minimal is None:
            stop = f" (stopped at {self.budget})" if self.budget else ""
            ignored = f"; {len(self.others)} diverged only in --ignore tensors" if self.others else ""
            return f"{self.target}: nothing found in {self.trials} trials, {self.seconds:.1f} s{stop}{ignored}"
        cfg = self.minimal
        origin = f"replayed from the example database {database}" if self.replayed else "drawn"
        lines = [fitted(f"{self.target}: found {cfg.id} fails with {self.signature}"),
                 f"  first failure {origin} at trial {self.found_trial}, {self.found_seconds:.1f} s: {self.first.id}",
                 f"  shrunk by hypothesis, then bisect's search: {self.trials - self.found_trial} more trials, "
                 f"{self.seconds:.1f} s in all; essential: {', '.join(self.essential) or 'none'}"]
        lines += [f"  also met: {other} fails with {sig}" for other, sig in list(self.others.items())[:3]]
        if self.localisation is not None:
            lines.append("  " + self.localisation.summary().replace("\n", "\n  "))
        where = f"in {modules[0]}" if modules else "in the test module that parametrizes these cells"
        lines += [f"reproduce: {harness_command('bisect', 'check', cfg.id)}",
                  f"bisect it: {harness_command('bisect', 'run', cfg.id)}",
                  f'add it to the matrix {where}: CELLS.append(Config.parse("{cfg.id}"))  '
                  "(from harness.config import Config)"]
        return "\n".join(lines)

    def as_json(self) -> dict:
        out = {"target": self.target, "trials": self.trials, "drawn": self.drawn, "rejected draws": self.rejected,
               "seconds": round(self.seconds, 2),
               "stored examples": self.stored, "verdict": "divergence" if self.minimal else "not judged" if self.not_judged else "no divergence"}
        if self.not_judged:
            out["not judged"] = self.not_judged
        if self.budget:
            out["stopped"] = self.budget
        if self.minimal is not None:
            out |= {"minimal": self.minimal.id, "signature": str(self.signature), "kind": self.signature.kind,
                    "tensors": list(self.signature.tensors), "first": self.first.id, "essential": self.essential,
                    "found at trial": self.found_trial, "found after seconds": round(self.found_seconds, 2),
                    "replayed from the database": self.replayed, "other failures": self.others}
            if self.localisation is not None:
                out["localisation"] = self.localisation.as_json()
        return out


@dataclass
class Budget:
    """Examples and seconds for drawing; shrinking gets its own seconds once a failure is found."""

    max_examples: int = 100
    max_seconds: float = 300.0
    shrink_seconds: float = 120.0


def explore(component: str, impl: str, pool: Pool, budget: Budget, *, db_path: Path | None = None,
            log: TextIO | None = None, progress: Callable[[str], None] | None = None,
            ignore: tuple[str, ...] = (), seed: int | None = None) -> Exploration:
    """Explore one implementation of one component; see the module docstring. ``progress`` gets
    one line per trial (default: stderr). A failure in none but the ``ignore`` tensors is noted
    in ``others`` and explored past (a divergence already known and declared). ``seed``: draw the
    same examples in every run (hypothesis's ``seed``), for a search whose trials must not vary."""
    progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    result = Exploration(component, impl)
    db = database(db_path)
    result.stored = len(list(db.fetch(database_key(component, impl)))) if db else 0
    trials = Trials(pool, log, max_trials=math.inf, max_seconds=math.inf, quiet=True)
    seen: dict[Config, Trial] = {}
    # the clock measures exploring, not the ranks' start (a few seconds, once per process), the pool
    # of one the references run in included
    pool.start(alone=True)
    start = time.monotonic()
    found_at: list[float] = []

    def say(trial: Trial, phase: str) -> None:
        elapsed = time.monotonic() - start
        progress(f"[explore {result.target}] {phase:<6} trial {result.trials:>4} {elapsed:6.1f}s "
                 f"{trial.signature.kind:<9}{trial.cfg.id}")

    def run(cfg: Config, phase: str = "") -> Trial:
        if cfg not in seen:
            result.trials += 1
            seen[cfg] = trials.run(cfg)
            phase = phase or ("replay" if result.trials <= result.stored and not found_at else
                              "shrink" if found_at else "search")
            say(seen[cfg], phase)
        return seen[cfg]

    @given(st.data())
    def trial(data):
        result.drawn += 1
        try:
            cfg = data.draw(configs(component, impl, pool.size), label="config")
        except UnsatisfiedAssumption:
            result.rejected += 1
            raise
        now = time.monotonic()  # checked after the draw: hypothesis must see every example draw alike
        if not found_at and now - start > budget.max_seconds:
            result.budget = f"{budget.max_seconds:g} s of search (--max-seconds)"
            raise Spent()
        if found_at and now - found_at[0] > budget.shrink_seconds / 2:  # the rest is bisect's search's
            result.budget = f"{budget.shrink_seconds / 2:g} s of hypothesis's shrinking (half of --shrink-seconds)"
            raise Spent()  # result.minimal is the smallest failure so far
        got = run(cfg)
        if got.signature.kind == "skip" and not found_at:
            # drawn configs are ones that run here, so a skip is a reference that cannot judge: the
            # model draws random numbers, and every config of it would say so again
            result.not_judged = got.signature.detail
            raise Spent()
        if got.signature.kind in ("skip", "invalid"):
            reject()
        if not got.signature.failed:
            return
        if got.signature.tensors and all(ignored(tensor, ignore) for tensor in got.signature.tensors):
            result.others.setdefault(cfg.id, f"{got.signature} (ignored: --ignore)")
            return
        if result.signature is None:
            result.signature, result.first = got.signature, cfg
            result.found_trial, result.found_seconds = result.trials, time.monotonic() - start
            result.replayed = result.trials <= result.stored
            found_at.append(time.monotonic())
        if result.signature.holds_in(got.signature):
            result.minimal = cfg
            raise Found(f"{cfg.id}: {got.signature}")
        result.others.setdefault(cfg.id, str(got.signature))

    trial = settings(max_examples=budget.max_examples, deadline=None, database=db, derandomize=False,
                     suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet, report_multiple_bugs=False,
                     phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink))(trial)
    if seed is not None:
        trial = hypothesis_seed(seed)(trial)
    trial._hypothesis_internal_database_key = database_key(component, impl)
    try:
        trial()
    except (Found, Spent):
        pass
    except Unsatisfiable:
        pass  # no config could run (all skipped here, or the budget ended before the first)
    if result.minimal is not None:
        # hypothesis shrinks one choice at a time, so two fields that fail only together (tp and a
        # size it must not divide) can stay large; bisect's field-by-field search takes them on
        def holds(cfg: Config) -> bool | None:
            if time.monotonic() - found_at[0] > budget.shrink_seconds:
                raise SearchBudget(f"{budget.shrink_seconds:g} s of shrinking (--shrink-seconds)")
            if not within(cfg):
                return None
            got = run(cfg, "bisect")
            return None if got.signature.kind in ("skip", "invalid") else result.signature.holds_in(got.signature)

        search = Search(result.minimal)
        try:
            result.minimal = search.run(holds)
        except SearchBudget as spent:
            result.minimal, result.budget = search.best, str(spent)
        result.essential = search.fields()["essential"]
        result.signature = seen[result.minimal].signature
        result.localisation = located(result.minimal, pool)
    result.seconds = time.monotonic() - start
    return result


def write_result(out: Path, results: list[Exploration]) -> None:
    (out / "result.json").write_text(json.dumps([r.as_json() for r in results], indent=2) + "\n")
