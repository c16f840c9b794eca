"""Run one cell: the implementation in the pool, against the reference and the golden file."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .compare.diff import Report, compare
from .compare.tolerance import Tolerances
from .config import Config
from .golden.store import GoldenError, MissingGolden, golden_path, metadata, read_golden, update_command, write_golden
from .layout import AssemblyError, MeshLayout, assemble
from .names import NOT_JUDGED, parse
from .registry import Component, Diagnosis, check_config, get
from .screen import TABLE_ROWS, WIDTH, first_line, fitted


class Divergence(AssertionError):
    """A cell whose numbers differ from the reference or from its golden file."""

    def __init__(self, message: str, report: Report | None = None, drift: bool = False, record: dict | None = None):
        super().__init__(message)
        self.report = report
        self.drift = drift  # against the golden file: the reference agreed, the stored numbers did not
        self.record = record or {}  # the component's extras for the cell's junit record

    @property
    def kind(self) -> str:
        """``drift`` when the cell matches the reference but not its golden file; ``nan`` when a
        tensor holds NaN/Inf where the reference is finite; else ``mismatch``."""
        if self.drift:
            return "drift"
        rows = self.report.failing() if self.report else []
        return "nan" if any(r.problem == "nan/inf" for r in rows) else "mismatch"


class NotJudged(Exception):
    """A cell its reference cannot judge (a model that draws random numbers in training mode): not a
    divergence and not a match. The message says why and what to change; pytest skips the cell with
    it, bisect and exploration count it as a skip."""


@dataclass
class CellOutcome:
    cfg: Config
    tol: Tolerances
    parity: Report
    golden: Report | None = None
    golden_status: str = "not checked"  # identical, within tolerance, written, updated
    moved: str = ""  # table of what an update changed
    seconds: float = 0.0
    record: dict = field(default_factory=dict)  # the component's extras for the cell's junit record
    result: dict[str, torch.Tensor] = field(default_factory=dict)


_references: dict[tuple, dict[str, torch.Tensor]] = {}


def reference_for(cfg: Config, pool=None, calibration: bool = False) -> dict[str, torch.Tensor] | None:
    """The reference result of ``cfg``'s problem (:attr:`Config.problem`), computed in a world of one
    by ``pool`` (on a rank beside its own; under torchrun on rank 0) or here without one (bisect, bench).
    Kept per process for every mesh and implementation of the problem: the reference is handed the
    problem alone and sees one process, so it is the same computation for all of them.
    ``calibration``: instead, the same on one process in the cell's dtype (``Component.calibration``;
    None where the component has none or the cell is fp64, where it is the reference itself).
    Raises :class:`NotJudged` when the reference says it cannot judge (a model that draws random numbers)."""
    component = get(cfg.component)
    path = component.calibration if calibration else component.reference
    if path is None or (calibration and cfg.dtype == "fp64"):
        return None
    key = (*cfg.problem_key, "calibration") if calibration else cfg.problem_key
    if key not in _references:
        check_config(cfg)
        if pool is None:
            _references[key] = (component.calibration_result if calibration else component.reference_result)(cfg)
        else:
            _references[key] = pool.alone("harness.pool.tasks:reference", (path, cfg.problem), cfg.problem.mesh,
                                          seed=cfg.seed, label=f"{cfg.id} (its reference)",
                                          deadline=cell_deadline(pool, component))
    result = _references[key]
    if NOT_JUDGED in result:
        raise NotJudged(result[NOT_JUDGED])
    return result


def assemble_result(cfg: Config, pieces: dict[int, dict]) -> dict:
    """Every rank's named pieces -> logical tensors (:class:`Assembled`), by name."""
    names = set(pieces[0])
    for rank, got in pieces.items():
        if set(got) != names:
            raise AssemblyError(f"rank {rank} returned {sorted(got)}, rank 0 returned {sorted(names)}")
    layout = MeshLayout.of(cfg.mesh)
    return {name: assemble(name, {r: pieces[r][name] for r in pieces}, layout) for name in sorted(names)}


def tolerances_for(cfg: Config, pool=None) -> Tolerances:
    """The tolerance policy of ``cfg``'s cell: its reduction size, its reference's families and its
    one-process rounding (:mod:`harness.compare.tolerance`), computed in ``pool`` if given."""
    return Tolerances(cfg.dtype, get(cfg.component).reduction_size(cfg), reference_for(cfg, pool),
                      reference_for(cfg, pool, calibration=True))


def parity(cfg: Config, component: Component, assembled: dict, pool=None) -> tuple[Tolerances, Report]:
    """The assembled result against the reference (computed in ``pool`` if given), under the tolerance policy."""
    tol = tolerances_for(cfg, pool)
    omits = component.implementations[cfg.impl].omits
    expected = {name: t for name, t in reference_for(cfg, pool).items() if name not in omits}
    return tol, compare(assembled, expected, tol)


def run_pieces(cfg: Config, pool, component: Component, scratch: str | None = None) -> dict[int, dict] | None:
    """Run the cell's implementation on the ranks of its mesh: each rank's named pieces.

    ``pool`` is the warm pool, or under torchrun this process's rank runner
    (:class:`harness.torchrun.runner.RankRunner`, the same ``run`` signature), which runs this
    rank's part in-process and returns the pieces on rank 0 only (None elsewhere).
    """
    run = component.implementations[cfg.impl].run
    return pool.run(run, cfg, cfg.mesh, seed=cfg.seed, label=cfg.id, extra_meshes=component.extra_meshes(cfg),
                    deadline=cell_deadline(pool, component), scratch=scratch)


def cell_deadline(pool, component: Component) -> float | None:
    """The deadline of one of ``component``'s cells in ``pool``: the pool's times the component's
    ``deadline_factor`` (None: the pool's own)."""
    deadline = getattr(pool, "deadline", None)
    return deadline * component.deadline_factor if deadline and component.deadline_factor != 1.0 else None


def outcome_of(cfg: Config, component: Component, pieces: dict[int, dict], pool=None) -> CellOutcome:
    """Every rank's pieces -> the logical result and its parity report against the reference
    (computed beside ``pool`` when given: :func:`reference_for`)."""
    assembled = assemble_result(cfg, pieces)
    outcome = CellOutcome(cfg, *parity(cfg, component, assembled, pool))
    outcome.result = {name: a.tensor for name, a in assembled.items()}
    return outcome


def execute(cfg: Config, pool, scratch: str | None = None) -> CellOutcome:
    """Run the cell in the pool and compare it with the reference, without judging: the outcome
    holds the parity report and the logical result whether or not they match. ``scratch``: the
    directory the cell's ranks share (the pool's own, removed after it, when None)."""
    check_config(cfg, pool.size)
    component = get(cfg.component)
    reference_for(cfg, pool)  # first: a reference that cannot judge the cell says so before the ranks run it
    return outcome_of(cfg, component, run_pieces(cfg, pool, component, scratch), pool)


def run_cell(cfg: Config, pool, *, golden_dir: Path | None = None, update_golden: bool = False,
             missing_golden: str = "write", rerun: str = "", diagnose: bool = True,
             scratch: str | None = None) -> CellOutcome:
    """Parity with the reference first (the gate), then the golden file (drift over time).

    ``pool``: the warm pool, or under torchrun rank 0's runner (the same ``run``).
    ``missing_golden``: ``"write"`` records a missing golden from a run that matches the reference
    (the cell passes, ``golden_status`` says ``written``); ``"fail"`` fails the cell (CI).
    ``rerun``: the command that reruns this cell, quoted in failure messages. ``diagnose``: whether a
    failing cell may be run again to say where it diverges (not for a declared divergence).
    ``scratch``: the directory the cell's ranks share (``harness.model.cell_dir()``).
    """
    start = time.perf_counter()
    outcome = execute(cfg, pool, scratch)
    diagnosis: Diagnosis = get(cfg.component).diagnosis(cfg, pool, outcome.parity, rerun=diagnose)
    outcome.record = diagnosis.record
    reproduce = f"reproduce: {rerun}" if rerun else f"config: {cfg.id}"
    if not outcome.parity.ok:
        first = _first(diagnosis.order)
        whole = outcome.parity.table(first=first)
        shown = outcome.parity.table(first=first, most=TABLE_ROWS, width=WIDTH)
        raise Divergence(fitted(f"{cfg.id} diverges from the reference ({outcome.tol}):\n{shown}\n"
                                + (f"{diagnosis.text}\n" if diagnosis.text else "") + reproduce), outcome.parity,
                         record=diagnosis.record | {"where": first_line(diagnosis.text)}
                         | ({"table": whole} if whole != shown else {}))
    if golden_dir is not None:
        try:
            check_golden(outcome, Path(golden_dir), update=update_golden, missing=missing_golden,
                         backend=pool.backend, rerun=rerun)
        except Divergence as drift:
            drift.record = outcome.record
            raise
    outcome.seconds = time.perf_counter() - start
    return outcome


def _first(params: list[str]):
    """Sort key of a failure table's rows: the tensors of ``params`` in that order, then the rest."""
    if not params:
        return None
    rank = {p: i for i, p in enumerate(params)}
    return lambda tensor: rank.get(parse(tensor).param, len(rank))


def check_golden(outcome: CellOutcome, root: Path, *, update: bool = False, missing: str = "write",
                 backend: str = "", rerun: str = "") -> None:
    """Hold ``outcome`` against its golden file; write the file when asked (or missing, if allowed)."""
    cfg, tol = outcome.cfg, outcome.tol
    path = golden_path(root, cfg)
    try:
        stored, _ = read_golden(path, cfg, rerun)
    except MissingGolden:
        if not update and missing != "write":
            raise
        stored = None
    except GoldenError:
        if not update:
            raise
        stored = None
    if stored is not None:
        outcome.golden = compare(outcome.result, stored, tol)
        same = outcome.golden.bit_identical
        outcome.golden_status = "identical" if same else "within tolerance"
        if same or (not update and outcome.golden.ok):
            return
        if not update:
            raise Divergence(f"{cfg.id} has drifted from its golden file {path} ({tol}):\n"
                             f"{outcome.golden.table()}\n"
                             f"{'reproduce: ' + rerun if rerun else 'config: ' + cfg.id}\n"
                             f"if the change is intended: {update_command(rerun)}", outcome.golden, drift=True)
        outcome.moved = outcome.golden.table(only_failing=False)
    write_golden(path, outcome.result, metadata(cfg, str(tol), backend))
    outcome.golden_status = "updated" if stored is not None else "written"
