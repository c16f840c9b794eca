"""The pytest plugin: options, the ``parity`` fixture that runs a cell, and a summary per component."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from .cell import Divergence, run_cell
from .config import Config, ConfigError
from .golden import GoldenError
from .layout import AssemblyError
from .pool import DEFAULT_DEADLINE, DEFAULT_SIZE, CaseFailure, PoolError, shared_pool
from .registry import validate

PROPERTY = "parity"


def pytest_addoption(parser):
    group = parser.getgroup("parity", "parallel-training correctness harness")
    group.addoption("--update-golden", action="store_true",
                    help="write golden files that are missing or whose values changed, and print what moved")
    group.addoption("--pool-size", type=int, default=DEFAULT_SIZE,
                    help=f"rank processes in the warm pool of each pytest process (default {DEFAULT_SIZE})")
    group.addoption("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                    help="process-group backend: auto picks nccl where CUDA is present, else gloo")
    group.addoption("--case-deadline", type=float, default=DEFAULT_DEADLINE,
                    help=f"seconds a cell may run before its ranks' stacks are taken and it fails (default {DEFAULT_DEADLINE:g})")
    group.addoption("--golden-dir", default=None, help="where golden files live (default: <rootdir>/golden)")


def _pool(config):
    opt = config.getoption
    return shared_pool(size=opt("--pool-size"), backend=opt("--backend"), deadline=opt("--case-deadline"))


def pytest_collection_finish(session):
    """Launch the pool as soon as we know a selected test needs it: ranks import torch meanwhile."""
    if any("rank_pool" in getattr(item, "fixturenames", ()) for item in session.items):
        _pool(session.config).launch()


@pytest.fixture(scope="session")
def rank_pool(pytestconfig):
    """This pytest process's warm pool of ranks, started on first use."""
    pool = _pool(pytestconfig)
    yield pool
    pool.close()


@pytest.fixture
def parity(request, rank_pool, pytestconfig):
    """``parity(cfg)``: run the cell in the pool, compare with the reference and its golden file."""
    opt = pytestconfig.getoption
    golden_dir = Path(opt("--golden-dir") or pytestconfig.rootpath / "golden")

    def check(cfg: Config):
        record = {"component": cfg.component, "status": "failed", "ratio": 0.0, "golden": "", "moved": ""}
        request.node.user_properties.append((PROPERTY, record))
        try:
            component = validate(cfg, rank_pool.size)
        except ConfigError as error:
            failure = f"invalid config: {error}"
        else:
            reason = component.implementations[cfg.impl].skip_reason(cfg)
            if reason:
                record["status"] = "skipped"
                pytest.skip(reason)
            try:
                outcome = run_cell(cfg, rank_pool, golden_dir=golden_dir, update_golden=opt("--update-golden"),
                                   nodeid=request.node.nodeid)
                failure = None
            except (Divergence, CaseFailure, AssemblyError, GoldenError, PoolError) as error:
                failure = str(error)
        if failure is not None:  # outside the except block: the report shows our message, no chain
            pytest.fail(failure, pytrace=False)
        record.update(status="passed", ratio=outcome.parity.worst_ratio, golden=outcome.golden_status,
                      moved=outcome.moved)
        return outcome

    return check


class _Summary:
    def __init__(self):
        self.rows = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0, "worst err/tol": 0.0,
                                         "golden identical": 0, "golden written": 0})
        self.moved: list[tuple[str, str]] = []

    def add(self, report):
        record = dict(report.user_properties).get(PROPERTY)
        if record is None or report.when != "call":
            return
        row = self.rows[record["component"]]
        status = "failed" if report.failed else record["status"]
        row[status] += 1
        row["worst err/tol"] = max(row["worst err/tol"], record["ratio"])
        row["golden identical"] += record["golden"] == "identical"
        row["golden written"] += record["golden"] in ("written", "updated")
        if record["moved"]:
            self.moved.append((report.nodeid, record["moved"]))


_summary = _Summary()


def pytest_runtest_logreport(report):
    _summary.add(report)


def pytest_terminal_summary(terminalreporter):
    if not _summary.rows:
        return
    import pandas as pd

    tr = terminalreporter
    tr.section("parity summary")
    frame = pd.DataFrame.from_dict(_summary.rows, orient="index")
    frame.index.name = "component"
    tr.write_line(frame.to_string(float_format=lambda v: f"{v:.3g}"))
    for nodeid, table in _summary.moved:
        tr.write_line(f"golden updated, what moved: {nodeid}\n{table}")
