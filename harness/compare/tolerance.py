"""The one tolerance policy: by dtype and by how many values a result's reduction adds.

A value computed in ``dtype`` carries one rounding of that dtype (``eps``), plus the accumulation
error of reductions, which grows like ``sqrt(n)`` for ``n`` added terms in the accumulation type
(fp32 on CPU and in cuBLAS for bf16/fp16 inputs). So::

    rtol = SAFETY * (eps(dtype) + eps(accumulate(dtype)) * sqrt(n))

and an element passes when ``|actual - expected| <= rtol * (|expected| + rms(expected))``: the
``rms`` term is the absolute floor, so values that cancel to near zero are held to the tensor's
scale rather than to a relative bound no summation order can meet.

``SAFETY`` covers the chain of a few dependent ops (forward, backward, optimizer step). Its value
is set from measurement, not to make a cell pass: the worst error/tolerance ratio of the green
matrix is printed at the end of every run (``worst err/tol``) and must stay well below 1, while the
planted bugs in README produce ratios in the hundreds.

A whole model (:mod:`harness.model`) has no single reduction to read ``n`` from, so it is derived
(:func:`harness.model.tasks.reduction_size`): the larger of the largest fan-in of any
``nn.Linear`` (terms of one forward dot product) and the tokens of a global batch (terms of a mean
loss and of every parameter's gradient); ``ModelCase(reduction=...)`` overrides it.

A model whose forward uses a kernel with no fp64 implementation (``torch._grouped_mm`` on the CPU)
names it in ``ModelCase(fp32_ops=...)``: the reference then runs that op from its fp32 kernel and
is exact only to fp32 rounding there. Such a reference still certifies fp32, bf16 and fp16 cells
under the same ``rtol``: what it adds is at most one fp32 rounding and an fp32 accumulation per such
op, the same order as the run's own error in an fp32 cell and far below a bf16 one, inside
``SAFETY``. It cannot certify agreement finer than fp32 rounding of those ops: an fp64 cell of such
a model, or a bug whose whole effect is below that rounding, is beyond it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

EPS = {"fp64": 2.0**-52, "fp32": 2.0**-23, "bf16": 2.0**-7, "fp16": 2.0**-10}
ACCUMULATE = {"fp64": "fp64", "fp32": "fp32", "bf16": "fp32", "fp16": "fp32"}
TORCH_DTYPE = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SAFETY = 8.0


@dataclass(frozen=True)
class Tolerance:
    """Relative tolerance, with ``rms(expected) * rtol`` as the absolute floor."""

    rtol: float
    dtype: str
    reduction: int

    def allowed(self, expected: torch.Tensor) -> torch.Tensor:
        expected = expected.double()
        scale = expected.pow(2).mean().sqrt() if expected.numel() else expected.new_zeros(())
        return self.rtol * (expected.abs() + scale)

    def __str__(self) -> str:
        return f"rtol={self.rtol:.3g} ({self.dtype}, n={self.reduction})"


class Tolerances:
    """The policy applied per result: ``reduction`` maps a tensor name to its ``n`` ("*": the rest)."""

    def __init__(self, dtype: str, reduction: int | dict[str, int]):
        self.dtype = dtype
        self.sizes = dict(reduction) if isinstance(reduction, dict) else {"*": int(reduction)}
        self._default = tolerance(dtype, self.sizes["*"])

    def get(self, name: str) -> Tolerance:
        return tolerance(self.dtype, self.sizes[name]) if name in self.sizes else self._default

    def __str__(self) -> str:
        extra = ", ".join(f"{k} n={v}" for k, v in sorted(self.sizes.items()) if k != "*")
        return f"{self._default}" + (f"; {extra}" if extra else "")


def tolerance(dtype: str, reduction: int) -> Tolerance:
    """Tolerance for results computed in ``dtype`` through reductions of up to ``reduction`` terms."""
    if dtype not in EPS:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {', '.join(EPS)}")
    n = max(1, int(reduction))
    rtol = SAFETY * (EPS[dtype] + EPS[ACCUMULATE[dtype]] * math.sqrt(n))
    return Tolerance(rtol, dtype, n)
