"""What a failing cell looks like, so that a smaller config can be said to fail *the same way*.

A signature is a kind and the tensors that fail:

* ``crash``: a rank raised or died, or its pieces could not be assembled;
* ``hang``: ranks were still running at the deadline;
* ``nan``: a tensor holds NaN/Inf where the reference is finite;
* ``scale``: a failing tensor is the reference scaled by a whole factor (norm ratio near 2, 1/4,
  ...): a gradient divided by the wrong group size or a microbatch count;
* ``mismatch``: any other divergence;
* ``match`` (no divergence), ``skip`` (cannot run here), ``invalid`` (a rule rejects the config).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..compare.diff import Report

FAILURES = ("crash", "hang", "nan", "scale", "mismatch", "bad")
FIT = 0.01  # a scaled tensor is within 1% (bf16 rounding and more) of factor * reference


@dataclass(frozen=True)
class Signature:
    kind: str
    tensors: tuple[str, ...] = ()  # failing tensors, worst first
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.kind in FAILURES

    @property
    def worst(self) -> str:
        return self.tensors[0] if self.tensors else ""

    def holds_in(self, other: "Signature") -> bool:
        """Does ``other`` fail the way this one does: same kind, and this worst tensor still fails?"""
        # a scaling is a kind of mismatch: a mismatch found on a bigger config still holds where
        # the smaller one happens to scale by a whole factor; a scaling must stay a scaling
        if other.kind != self.kind and not (self.kind == "mismatch" and other.kind == "scale"):
            return False
        return not self.tensors or self.worst in other.tensors

    def __str__(self) -> str:
        text = self.kind + (f" in {', '.join(self.tensors[:4])}" if self.tensors else "")
        return text + (f" ({self.detail})" if self.detail else "")


def whole_factor(ratio: float, tolerance: float = 0.02) -> int | None:
    """``k`` when ``ratio`` or ``1/ratio`` is within 2% of a whole number ``k >= 2``, else None."""
    for value in (ratio, 1 / ratio if ratio else 0.0):
        if not math.isfinite(value):  # a reference of norm 0 gives an infinite ratio: no factor
            continue
        k = round(value)
        if k >= 2 and abs(value - k) <= tolerance * k:
            return k
    return None


def of_report(report: Report) -> Signature:
    """The signature of a comparison against the reference."""
    failing = sorted(report.failing(), key=lambda r: -r.ratio)
    if not failing:
        return Signature("match")
    tensors = tuple(dict.fromkeys(r.tensor for r in failing))
    if any(r.problem == "nan/inf" for r in failing):
        return Signature("nan", tensors)
    # a tensor that is the reference times a whole factor names the bug (the parameters after the
    # step then merely differ), so it leads the signature even when another tensor is further over
    # tolerance. A scalar always fits a factor, so scalars count only when nothing else fails.
    shaped = [r for r in failing if r.problem == "mismatch" and r.numel > 1]
    candidates = shaped or [r for r in failing if r.problem == "mismatch"]
    for row in candidates:
        k = whole_factor(row.norm_ratio)
        if k is not None and row.fit_residual < FIT:
            side = f"x{k}" if row.norm_ratio > 1 else f"1/{k}"
            tensors = (row.tensor,) + tuple(t for t in tensors if t != row.tensor)
            return Signature("scale", tensors, f"{row.tensor} = reference {side}")
    worst = failing[0]
    return Signature("mismatch", tensors, f"{worst.tensor} err/tol {worst.ratio:.3g}")
