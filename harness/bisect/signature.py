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
from itertools import combinations

from ..compare.diff import Report
from ..names import DEGREES, unstepped

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
        """Does ``other`` fail the way this one does: same kind, and this worst tensor still fails
        (a result of one step: the same result of any step, as a config of fewer steps has)?"""
        # a scaling is a kind of mismatch: a mismatch found on a bigger config still holds where
        # the smaller one happens to scale by a whole factor; a scaling must stay a scaling
        if other.kind != self.kind and not (self.kind == "mismatch" and other.kind == "scale"):
            return False
        return not self.tensors or unstepped(self.worst) in {unstepped(t) for t in other.tensors}

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


def groups_of_size(k: int, mesh=()) -> list[str]:
    """The mesh dims of ``mesh`` (``(name, degree)`` pairs), alone or together in mesh order
    (``dp·tp``), whose groups hold ``k`` ranks: the group sizes a gradient may have been divided by."""
    dims = [(name, degree) for name, degree in mesh if degree > 1]
    return ["·".join(name for name, _ in combo) for size in range(1, len(dims) + 1)
            for combo in combinations(dims, size) if math.prod(d for _, d in combo) == k]


def factor_text(ratio: float, fit_residual: float, mesh=()) -> str | None:
    """``x 1/2 = 1/dp``: a tensor of norm ``ratio`` times the reference's that is the reference times
    a whole factor (``fit_residual`` below :data:`FIT`), or one over it, named with the groups of
    ``mesh`` of that size (it may name a step's ``microbatches`` too) (``= 1/dp or 1/tp`` where two are; ``= 1/rep·dp (the world)`` where the
    dims that make it are every dim of the world: a division by the world size); None when it is no
    such multiple."""
    k = whole_factor(ratio)
    if k is None or not fit_residual < FIT:
        return None
    over = "" if ratio > 1 else "1/"
    groups = groups_of_size(k, mesh)
    split = [degree for name, degree in mesh if degree > 1 and name in DEGREES]  # not a step's microbatches
    world = " (the world)" if len(split) > 1 and k == math.prod(split) else ""
    return f"x {over}{k}" + (" = " + " or ".join(over + g for g in groups) if groups else "") + world


def of_report(report: Report, mesh=()) -> Signature:
    """The signature of a comparison against the reference (``mesh``: the cell's, to name a factor's group)."""
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
        factor = factor_text(row.norm_ratio, row.fit_residual, mesh)
        if factor is not None:
            tensors = (row.tensor,) + tuple(t for t in tensors if t != row.tensor)
            return Signature("scale", tensors, f"{row.tensor} = reference {factor}")
    worst = failing[0]
    return Signature("mismatch", tensors, f"{worst.tensor} err/tol {worst.ratio:.3g}")
