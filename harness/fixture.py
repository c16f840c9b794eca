"""The ``parity`` fixture's callable: one cell, checked and recorded.

``parity(cfg)`` checks the config's rules, skips what the implementation cannot run here, marks a
declared divergence as strict xfail, runs the cell (:func:`harness.cell.run_cell`, in the warm pool;
under torchrun on every rank, :func:`harness.torchrun.plugin.on_ranks`) and fails with its table; a
cell its reference cannot judge (:class:`harness.resolve.NotJudged`) is skipped with the reason.
Each cell leaves one JSON property in the junit XML (:func:`harness.record.cell_record`): what
``harness.report`` and the run's summary read.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path

import pytest

from .commands import rerun_command
from .config import Config
from .known import headline
from .record import PROPERTY, cell_record, worst

class KnownFailure(pytest.fail.Exception):
    """A declared divergence's cell that failed as declared: the only failure its xfail expects."""


def told(record: dict, judge, *args):
    """``judge(*args)`` -> ``(failure, outcome)``, with what the cell's code left changed in its
    processes (:class:`harness.pool.parent.LeftChanged`, said by the pool, or a torchrun rank, as its
    tasks end) in ``record`` (``left_changed``) and, where the cell failed, in its failure: maybe the
    very cause. The warnings stay warnings: pytest's summary shows them on the cell."""
    from .pool.parent import LeftChanged

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        failure, outcome = judge(*args)
    lines = [str(w.message) for w in caught if issubclass(w.category, LeftChanged)]
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    if lines:
        record["left_changed"] = "\n".join(lines)
        if failure is not None:
            failure = "\n".join([failure, *(line for line in lines if line not in failure)])
    return failure, outcome


class CellCheck:
    """``parity(cfg)`` for one test: runs the cell through ``pool`` (the warm pool, or under torchrun
    this rank's runner, ``runner``)."""

    def __init__(self, request, pool, runner=None):
        self.request, self.pool, self.runner = request, pool, runner
        self.config = request.config
        self.nodeid = request.node.nodeid
        self.golden_dir = Path(self.config.getoption("--golden-dir") or self.config.rootpath / "golden")

    def __call__(self, cfg: Config):
        record = cell_record(cfg)
        try:
            return self._checked(cfg, record)
        finally:  # one JSON property per cell, in the junit XML too: what harness.report reads
            self.request.node.user_properties.append((PROPERTY, json.dumps(record, sort_keys=True)))

    def _checked(self, cfg: Config, record: dict):
        from .resolve import resolve

        start = time.perf_counter()
        outcome = None
        pool_size, job_size = (None, self.runner.size) if self.runner else (self.pool.size, None)
        cell = resolve(cfg, pool_size, job_size)
        disposition = cell.disposition
        if disposition.kind == "invalid":
            failure, record["kind"] = f"invalid config: {disposition.reason}", "invalid"
        else:
            if disposition.kind == "skip":
                record["status"] = "skipped"
                pytest.skip(disposition.reason)
            if disposition.kind == "xfail":  # runs in full: a divergence is expected, a match means upstream changed
                record["expected"] = disposition.reason
                if not disposition.strict:  # it may match on this machine's kernels: a pass, not a fix
                    record["strict"] = False
                after = (f"If this cell passes (XPASS), the upstream behaviour changed: remove its entry from "
                         f"{cell.impl.xfail}" if disposition.strict
                         else "Whether it shows depends on this machine's kernels: it may pass here (XPASS)")
                # only the declared failure is expected (KnownFailure, raised below); another one fails
                self.request.applymarker(pytest.mark.xfail(
                    strict=disposition.strict, raises=KnownFailure,
                    reason=f"known divergence of {cfg.impl}: {disposition.reason}. {after}"))
            if self.runner is None:
                failure, outcome = told(record, self.judge, cell, self.pool, record, start)
            else:
                from .torchrun.plugin import on_ranks

                failure, outcome = told(record, on_ranks, self, cell, self.runner, record, start)
        record["seconds"] = record.get("seconds") or round(time.perf_counter() - start, 4)
        if failure is not None:  # outside the except block: the report shows our message, no chain
            if disposition.kind == "xfail":
                failure = self._as_declared(disposition.known, failure, record)
            pytest.fail(failure, pytrace=False)
        if record["status"] == "skipped":  # judged on rank 0 under torchrun: every rank skips alike
            pytest.skip(record["reason"])
        return outcome

    @staticmethod
    def _as_declared(known, failure: str, record: dict) -> str:
        """A declared cell's failure: raised as :class:`KnownFailure` (the xfail) when it is the
        declared one; else the failure it is, saying what was declared instead (``record``'s
        ``declared``: ``holds`` or ``differs``)."""
        line = record.get("where") or headline(failure)
        if known.holds(line, failure):
            record["declared"] = "holds"
            raise KnownFailure(failure, pytrace=False)
        record["declared"] = "differs"
        return (f"{failure}\nnot the declared divergence: it was declared to fail showing {known.shows!r}, which "
                f"this failure does not; its first line is {line!r}. The declared reason: {known}")

    def judge(self, cell, pool, record: dict, start: float):
        """Run the resolved ``cell`` (:class:`harness.resolve.Cell`) through ``pool`` (the warm pool, or rank 0's runner) and judge it: the failure
        text or None, and the outcome; the record is filled in either way."""
        from .cell import Divergence, NotJudged, run_cell
        from .golden.store import GoldenError
        from .layout import AssemblyError
        from .pool.parent import CaseFailure, PoolError
        from .world import split_nothing, vacuous_kind

        opt = self.config.getoption
        rerun = rerun_command(self.config.rootpath, self.nodeid)
        scratch = None  # the cell's directory (harness.model.cell_dir()), kept if it fails
        try:
            scratch = pool.new_scratch(fresh=cell.component.fresh)
            # a declared divergence does not pay for the re-run that localises it, and has no golden file:
            # where it matches (a non-strict one on this machine's kernels) it would record numbers that
            # another machine's run of it does not reach
            # (unless its declaration names the line it must fail with: then that line is found)
            declared = cell.disposition.kind == "xfail"
            localised = bool(cell.disposition.known.shows) if declared else not opt("--no-localise")
            outcome = run_cell(cell, pool, golden_dir=None if declared else self.golden_dir,
                               update_golden=opt("--update-golden"),
                               missing_golden="fail" if opt("--strict-golden") else "write", rerun=rerun,
                               diagnose=localised, scratch=scratch)
        except Divergence as error:
            record["kind"] = error.kind
            record.update(worst(error.report), **error.record)
            unlocalised = "" if localised or error.drift else \
                "\nnot run again to find where it starts (--no-localise): its reproduce command does"
            return str(error) + unlocalised + self._keep(scratch), None
        except (CaseFailure, AssemblyError) as error:  # a hang or crash reruns the same way a mismatch does
            vacuous = split_nothing(error) if isinstance(error, CaseFailure) else None
            if vacuous:  # not a crash: the cell has no verdict on its numbers to give
                record["kind"] = vacuous_kind(vacuous)
                return f"{vacuous}{self._keep(scratch)}\nreproduce: {rerun}", None
            record["kind"] = getattr(error, "kind", type(error).__name__)
            return f"{error}{self._keep(scratch)}\nreproduce: {rerun}", None
        except (GoldenError, PoolError) as error:
            record["kind"] = type(error).__name__
            return str(error), None
        except NotJudged as error:  # nothing diverged and nothing was compared: neither red nor green
            record.update(status="skipped", kind="not judged", reason=str(error))
            return None, None
        finally:
            record["seconds"] = round(time.perf_counter() - start, 4)
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        record.update(worst(outcome.parity), status="passed", golden=outcome.golden_status, moved=outcome.moved,
                      **outcome.record)
        return None, outcome

    def _keep(self, scratch: str | None) -> str:
        """A failing cell's directory, moved into the test's ``tmp_path`` (pytest keeps it as it keeps
        a failed test's); the line that says where, or "" when it held nothing."""
        if scratch is None or not os.path.isdir(scratch) or not os.listdir(scratch):
            return ""
        kept = self.request.getfixturevalue("tmp_path") / "cell"
        shutil.move(scratch, kept)
        return f"\nthe cell's directory (harness.model.cell_dir()) is kept: {kept}"
