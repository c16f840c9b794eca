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
from .names import parse
from .resolve import Cell, NotJudged, as_cell  # noqa: F401  (NotJudged: where callers have always found it)
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


def assemble_result(mesh, pieces: dict[int, dict]) -> dict:
    """Every rank's named pieces on ``mesh`` -> logical tensors (:class:`Assembled`), by name."""
    names = set(pieces[0])
    for rank, got in pieces.items():
        if set(got) != names:
            raise AssemblyError(f"rank {rank} returned {sorted(got)}, rank 0 returned {sorted(names)}")
    layout = MeshLayout.of(mesh)
    return {name: assemble(name, {r: pieces[r][name] for r in pieces}, layout) for name in sorted(names)}


def parity(cell: Cell, assembled: dict, pool=None) -> tuple[Tolerances, Report]:
    """The assembled result against the reference (computed in ``pool`` if given), under the tolerance policy."""
    tol = cell.tolerances(pool)
    omits = cell.impl.omits
    expected = {name: t for name, t in cell.reference(pool).items() if name not in omits}
    return tol, compare(assembled, expected, tol)


def run_pieces(cell: Cell, pool, scratch: str | None = None) -> dict[int, dict] | None:
    """Run the cell's implementation on the ranks of its mesh: each rank's named pieces.

    ``pool`` is the warm pool, or under torchrun this process's rank runner
    (:class:`harness.torchrun.runner.RankRunner`, the same ``run`` signature), which runs this
    rank's part in-process and returns the pieces on rank 0 only (None elsewhere).
    """
    cfg = cell.cfg
    return pool.run(cell.impl.run, cfg, cfg.mesh, seed=cfg.seed, label=cfg.id, extra_meshes=cell.meshes,
                    deadline=cell.deadline(pool), scratch=scratch, fresh=cell.component.fresh)


def outcome_of(cell: Cell, pieces: dict[int, dict], pool=None) -> CellOutcome:
    """Every rank's pieces -> the logical result and its parity report against the reference
    (computed beside ``pool`` when given)."""
    assembled = assemble_result(cell.cfg.mesh, pieces)
    outcome = CellOutcome(cell.cfg, *parity(cell, assembled, pool))
    outcome.result = {name: a.tensor for name, a in assembled.items()}
    return outcome


def execute(cell: Cell | Config, pool, scratch: str | None = None) -> CellOutcome:
    """Run the cell in the pool and compare it with the reference, without judging: the outcome
    holds the parity report and the logical result whether or not they match. ``scratch``: the
    directory the cell's ranks share (the pool's own, removed after it, when None). Raises
    :class:`ConfigError` for an invalid cell; skips and declared divergences are the caller's to decide."""
    cell = as_cell(cell, pool.size).valid()
    cell.reference(pool)  # first: a reference that cannot judge the cell says so before the ranks run it
    return outcome_of(cell, run_pieces(cell, pool, scratch), pool)


def run_cell(cell: Cell | Config, pool, *, golden_dir: Path | None = None, update_golden: bool = False,
             missing_golden: str = "write", rerun: str = "", diagnose: bool = True,
             scratch: str | None = None) -> CellOutcome:
    """Parity with the reference first (the gate), then the golden file (drift over time).

    ``cell``: resolved (:func:`harness.resolve.resolve`), or a config to resolve against the pool.
    ``pool``: the warm pool, or under torchrun rank 0's runner (the same ``run``).
    ``missing_golden``: ``"write"`` records a missing golden from a run that matches the reference
    (the cell passes, ``golden_status`` says ``written``); ``"fail"`` fails the cell (CI).
    ``rerun``: the command that reruns this cell, quoted in failure messages. ``diagnose``: whether a
    failing cell may be run again to say where it diverges (not for a declared divergence).
    ``scratch``: the directory the cell's ranks share (``harness.model.cell_dir()``).
    """
    start = time.perf_counter()
    cell = as_cell(cell, pool.size)
    cfg = cell.cfg
    outcome = execute(cell, pool, scratch)
    diagnosis = cell.diagnose(pool, outcome.parity, rerun=diagnose)
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
                         backend=pool.backend, rerun=rerun, kept=cell.in_golden)
        except Divergence as drift:
            drift.record = outcome.record
            raise
    outcome.seconds = time.perf_counter() - start
    return outcome


def _first(params: list[str]):
    """Sort key of a failure table's rows: the tensors of ``params`` in that order, each one's
    gradients first, by step, then the rest."""
    if not params:
        return None
    rank = {p: i for i, p in enumerate(params)}

    def key(tensor: str) -> tuple:
        name = parse(tensor)
        return rank.get(name.param, len(rank)), name.kind != "grad", name.step or 1
    return key


def check_golden(outcome: CellOutcome, root: Path, *, update: bool = False, missing: str = "write",
                 backend: str = "", rerun: str = "", kept=None) -> None:
    """Hold ``outcome`` against its golden file; write the file when asked (or missing, if allowed).
    ``kept(name)``: whether a result goes in the file (:meth:`harness.resolve.Cell.in_golden`; all
    when None)."""
    cfg, tol = outcome.cfg, outcome.tol
    result = outcome.result if kept is None else {n: t for n, t in outcome.result.items() if kept(n)}
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
        outcome.golden = compare(result, stored, tol)
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
    write_golden(path, result, metadata(cfg, str(tol), backend))
    outcome.golden_status = "updated" if stored is not None else "written"
