"""Compare a result (logical tensors) against an expectation and explain any divergence.

A mismatch reads as a table, one row per tensor that fails: the worst element, both values, the
absolute and relative error, the tolerance there, how far over it is, the ratio of norms (about
``tp``, ``1/dp`` or the microbatch count names a scaling bug) and which ranks' shards hold bad values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..layout import Assembled, grid
from .tolerance import Tolerance, Tolerances


@dataclass
class Row:
    tensor: str
    ok: bool
    problem: str = ""  # "mismatch", "nan", "missing", "shape", "replicas"
    worst_index: tuple = ()
    actual: float = math.nan
    expected: float = math.nan
    abs_err: float = 0.0
    rel_err: float = 0.0
    tol: float = 0.0
    ratio: float = 0.0  # abs_err / tol at the worst element; > 1 fails
    norm_ratio: float = 1.0
    # how far actual is from its best fit c * expected (|actual - c expected| / |actual|): near 0
    # when the tensor is the reference scaled, as a gradient divided by the wrong group size is
    fit_residual: float = math.nan
    numel: int = 0
    bad: str = ""  # "k/n" elements over tolerance
    ranks: str = ""  # ranks whose local shards hold bad elements


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    bit_identical: bool = True

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def worst_ratio(self) -> float:
        return max((r.ratio for r in self.rows), default=0.0)

    def failing(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]

    def table(self, only_failing: bool = True, first: Callable[[str], int] | None = None,
              most: int | None = None, width: int | None = None) -> str:
        """The rows as a table: the failing ones (``only_failing``), sorted by ``first(tensor)``
        (stable: the comparison's order otherwise), at most ``most`` of them, and at most ``width``
        columns wide (dropping :data:`SPARE_COLUMNS`, in that order, then shortening tensor names),
        with a last line that says what was left out."""
        import pandas as pd

        rows = self.failing() if only_failing else self.rows
        if first is not None:
            rows = sorted(rows, key=lambda r: first(r.tensor))
        more = len(rows) - most if most is not None and len(rows) > most else 0
        rows = rows[:len(rows) - more]
        frame = pd.DataFrame([_columns(r) for r in rows], columns=COLUMNS)
        text, dropped, shortened = _text(frame), [], False
        for column in SPARE_COLUMNS:
            if width is None or _width(text) <= width:
                break
            dropped.append(column)
            text = _text(frame.drop(columns=dropped))
        if width is not None and _width(text) > width:  # then tensor names
            keep = max(frame["tensor"].map(len).max() - (_width(text) - width), 32)
            names = frame["tensor"].map(lambda t: _shortened(t, keep))
            text, shortened = _text(frame.drop(columns=dropped).assign(tensor=names)), True
        left = [f"{more} more rows"] * bool(more) + dropped + ["whole names"] * shortened
        return f"{text}\n... {', '.join(left)}: {WHOLE_TABLE}" if left else text


# the columns of :meth:`Report.table`, and those a narrow table leaves out first: each follows from
# the others (abs err = |actual - expected|, tol = abs err / err/tol)
COLUMNS = ("tensor", "problem", "worst index", "actual", "expected", "abs err", "rel err", "tol", "err/tol",
           "norm ratio", "bad", "bad ranks")
SPARE_COLUMNS = ("rel err", "abs err", "tol", "worst index")
WHOLE_TABLE = "in its junit record (python -m harness.report)"  # where a shortened table is whole


def _columns(r: Row) -> dict:
    return {"tensor": r.tensor, "problem": r.problem or "ok",
            "worst index": "(" + ",".join(map(str, r.worst_index)) + ")" if r.worst_index else "",
            "actual": r.actual, "expected": r.expected, "abs err": r.abs_err, "rel err": r.rel_err, "tol": r.tol,
            "err/tol": r.ratio, "norm ratio": r.norm_ratio, "bad": r.bad, "bad ranks": r.ranks}


def _shortened(tensor: str, most: int) -> str:
    """``opt/exp_avg/...layers.1.attn.q_norm.weight``: the kind of result kept, the parameter's path
    losing its start (its end names the parameter)."""
    if len(tensor) <= most:
        return tensor
    kind, _, param = tensor.rpartition("/")
    kind = kind + "/" if kind else ""
    return kind + "..." + param[len(kind) + 3 - most:] if len(kind) + 8 < most else tensor[:most - 3] + "..."


def _text(frame) -> str:
    import pandas as pd

    with pd.option_context("display.width", 1000, "display.max_columns", 20, "display.max_colwidth", 1000):
        return frame.to_string(index=False, na_rep="", float_format=lambda v: f"{v:.4g}")


def _width(text: str) -> int:
    return max(map(len, text.splitlines()), default=0)


def _as_assembled(value) -> Assembled:
    if isinstance(value, Assembled):
        return value
    return Assembled(value, {}, 0.0, None)


def compare(actual: dict, expected: dict[str, torch.Tensor], tol: Tolerance | Tolerances) -> Report:
    """Hold every tensor of ``actual`` (logical tensors or :class:`Assembled`) against ``expected``.

    ``tol`` is one tolerance for all, or :class:`Tolerances` giving each tensor its own reduction size.
    """
    report = Report()
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            report.rows.append(Row(name, False, "missing", bad="not in result"))
            report.bit_identical = False
            continue
        if name not in expected:
            report.rows.append(Row(name, False, "missing", bad="not in expectation"))
            report.bit_identical = False
            continue
        got = _as_assembled(actual[name])
        one = tol.get(name) if isinstance(tol, Tolerances) else tol
        report.rows.extend(_compare_one(name, got, expected[name], one, report))
    return report


def unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index of element ``flat`` of a row-major tensor of ``shape`` (() for a scalar): what
    ``torch.unravel_index`` gives, without the import of torch's symbolic shapes (sympy, about
    0.4 s) that its argument checks pay on first use."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def _compare_one(name: str, got: Assembled, want: torch.Tensor, tol: Tolerance, report: Report) -> list[Row]:
    a, b = got.tensor, want
    if tuple(a.shape) != tuple(b.shape):
        report.bit_identical = False
        return [Row(name, False, "shape", bad=f"{tuple(a.shape)} vs {tuple(b.shape)}")]
    if a.dtype != b.dtype or not torch.equal(a, b):
        report.bit_identical = False
    a64, b64 = a.double(), b.double()
    allowed = tol.allowed(b64)
    err = (a64 - b64).abs()
    # NaN/Inf where the expectation is finite is the worst possible error.
    nonfinite = ~torch.isfinite(a64) & torch.isfinite(b64)
    err = torch.where(nonfinite, torch.full_like(err, math.inf), err.nan_to_num(nan=0.0))
    ratio = err / allowed.clamp_min(torch.finfo(torch.float64).tiny)
    bad = ratio > 1
    rows = []
    if a.numel():
        worst = int(ratio.flatten().argmax())
        idx = unravel(worst, tuple(a.shape))
        norm_b = float(b64.norm())
        norm_ratio = float(a64.norm()) / norm_b if norm_b else (1.0 if float(a64.norm()) == 0 else math.inf)
        fit_residual = math.nan
        if norm_b and torch.isfinite(a64).all():
            c = float((a64 * b64).sum()) / norm_b**2
            norm_a = float(a64.norm())
            fit_residual = float((a64 - c * b64).norm()) / norm_a if norm_a else 0.0
        bad_ranks = [
            r for r, index in sorted(got.index.items()) if bad[grid(index)].any()
        ] if bad.any() else []
        rows.append(
            Row(
                tensor=name,
                ok=not bool(bad.any()),
                problem="" if not bad.any() else ("nan/inf" if bool(nonfinite.any()) else "mismatch"),
                worst_index=idx,
                actual=float(a64.flatten()[worst]),
                expected=float(b64.flatten()[worst]),
                abs_err=float(err.flatten()[worst]),
                rel_err=float(err.flatten()[worst] / b64.flatten()[worst].abs()) if float(b64.flatten()[worst]) else math.inf,
                tol=float(allowed.flatten()[worst]),
                ratio=float(ratio.flatten()[worst]),
                norm_ratio=norm_ratio,
                fit_residual=fit_residual,
                numel=a.numel(),
                bad=f"{int(bad.sum())}/{a.numel()}",
                ranks=",".join(map(str, bad_ranks)),
            )
        )
    else:
        rows.append(Row(name, True, bad="0/0"))
    # Replicas of one element must agree: a gap beyond tolerance is a bug even if one copy is right.
    floor = float(allowed.min()) if allowed.numel() else 0.0
    if got.replica_gap > floor:
        i, j = got.replica_gap_ranks
        rows.append(
            Row(
                tensor=name,
                ok=False,
                problem="replicas",
                abs_err=got.replica_gap,
                tol=floor,
                ratio=got.replica_gap / floor if floor else math.inf,
                bad="copies differ",
                ranks=f"{i},{j}",
            )
        )
    return rows
