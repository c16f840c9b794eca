"""The one tolerance policy: by dtype, by how many values a result's reduction adds, and by how far
the same computation on one process in the cell's dtype lies from the fp64 reference.

An element passes when ``|actual - expected| <= rtol * (1 + ROUNDING * growth) * (|expected| + scale)``,
from three parts:

1. **Rounding of the cell's dtype.** A value computed in ``dtype`` carries one rounding of that
   dtype (``eps``), plus the accumulation error of reductions, which grows like ``sqrt(n)`` for
   ``n`` added terms in the accumulation type (fp32 on CPU and in cuBLAS for bf16/fp16 inputs)::

       rtol = SAFETY * (eps(dtype) + eps(accumulate(dtype)) * sqrt(n))
       allowed = rtol * (|expected| + scale)

   ``scale`` is ``rms(expected)``, the absolute floor: values that cancel to near zero are held to
   the tensor's scale rather than to a relative bound no summation order can meet. ``SAFETY``
   covers the chain of a few dependent ops (forward, backward, optimizer step).

2. **A tensor that is zero to the cell's precision.** Rounding is relative to the terms a value is
   computed from, not to the value: a gradient that vanishes by symmetry (1e-21 in fp64) comes out
   as rounding of terms on the scale of the other gradients (1e-11 in fp32). A tensor whose rms is
   below ``rtol`` times its family's scale (the median rms of the results of its kind at its step:
   every gradient, every parameter, one optimizer state of every parameter, every loss;
   :func:`family`) is zero to the cell's precision, and that scale is its ``scale``.

3. **Rounding one process makes** (every component with a ``calibration``: every built-in one and
   every whole model). Some computations amplify rounding beyond (1) with no parallelism at all.
   Layer norm's input gradient divides by a row's spread: over h=4 features in bf16 (tp's ``sp``
   layer, found by exploration) one process lies 2.0 times beyond (1). A model has no single
   ``n``, and AdamW divides each gradient by its own running rms, so an element whose gradient
   cancels to a few roundings moves by a step as wrong as that cancellation; over more steps
   training amplifies rounding further. After two steps a few elements of embeddings and small
   weights of real models (tiny GLM-4, OLMo-2) lie 1 to 4 times beyond (1) on one process in fp32;
   after ten, hundreds of times. So the same computation runs on one process in the cell's dtype,
   from the same start on the same batches (a component's reference in that dtype, a model's
   training on one process), and each tensor's ``growth`` is that run's worst error over (1) in it:
   how much this computation amplifies rounding there. The parallel run is another sample of the
   same rounding (other summation orders and partitions of the same sums), amplified by the same
   computation, so its allowance is multiplied by ``1 + ROUNDING * growth``. Per tensor, not per
   element: which elements rounding moves most differs between two samples (measured: up to 36
   times one run's element error plus its rms), how far it moves a tensor much less (up to 7
   times). A tensor whose rounding is not amplified has a ``growth`` of a few tenths: its
   allowance is (1) times a few (fp64 cells have no calibration: ``growth`` 0).

What a green certifies: every element of every result lies within these allowances of the fp64
reference. It cannot tell a divergence smaller than that from rounding: one below ``rtol`` of a
tensor's scale times ``1 + ROUNDING * growth`` (a failure's header names the largest ``growth``); nor a
tensor that is zero to the cell's precision from another such. A wrong parallel plan (a partial sum
never reduced, a gradient scaled by a group size) moves whole tensors by O(1) of their scale: 1e4 to
1e7 times these allowances in tests/. Both the reference and the one-process run are the case's own
code on one process: what they share (a bug in the model or the reference itself) parity cannot see.

``SAFETY`` and ``ROUNDING`` are set from measurement, not to make a cell pass: the worst
error/tolerance ratio of the green matrix is printed at the end of every run (``worst err/tol``)
and must stay well below 1, while the planted bugs in tests/ stay at 1e4 and beyond.

A whole model's ``n`` (:func:`harness.model.tasks.reduction_size`) is the larger of the largest
fan-in of any ``nn.Linear`` (terms of one forward dot product) and the tokens of a global batch
(terms of a mean loss and of every parameter's gradient); ``ModelCase(reduction=...)`` overrides it.

A model whose forward uses a kernel with no fp64 implementation (``torch._grouped_mm`` on the CPU)
names it in ``ModelCase(fp32_ops=...)``: the reference then runs that op from its fp32 kernel and
is exact only to fp32 rounding there. Such a reference still certifies fp32, bf16 and fp16 cells
under the same policy: what it adds is at most one fp32 rounding and an fp32 accumulation per such
op, the same order as the run's own error in an fp32 cell and far below a bf16 one. It cannot
certify agreement finer than fp32 rounding of those ops: an fp64 cell of such a model, or a bug
whose whole effect is below that rounding, is beyond it. The same holds where the model asks for
fp32 itself (``x.float()`` against an fp64 weight in a router): the op that fails on those mixed
inputs runs from its fp32 kernel in the reference (``harness.model.train.Fp32Ops``).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from ..names import parse

EPS = {"fp64": 2.0**-52, "fp32": 2.0**-23, "bf16": 2.0**-7, "fp16": 2.0**-10}
ACCUMULATE = {"fp64": "fp64", "fp32": "fp32", "bf16": "fp32", "fp16": "fp32"}
TORCH_DTYPE = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SAFETY = 8.0
# how many times one process's amplification of rounding a parallel run may show (3. above): right
# code needed up to 7.1 over 30 cells of tiny GLM-4 and OLMo-2 (5 seeds; fp32 and bf16, 3 and 10
# steps), planted bugs stay at 1e4 and beyond (docs/architecture.md#tolerances)
ROUNDING = 16.0


def _rms(t: torch.Tensor) -> torch.Tensor:
    return t.pow(2).mean().sqrt() if t.numel() else t.new_zeros(())


@dataclass(frozen=True)
class Tolerance:
    """One tensor's allowance (see the module docstring): ``rtol`` times its value and its scale
    (``scale``: its family's when the tensor is zero to the cell's precision, else None: its own),
    times ``1 + ROUNDING * growth`` (``growth``: one process's worst error over that in the cell's
    dtype, 0 where not measured)."""

    rtol: float
    dtype: str
    reduction: int
    scale: float | None = None
    growth: float = 0.0

    def allowed(self, expected: torch.Tensor) -> torch.Tensor:
        expected = expected.double()
        scale = _rms(expected) if self.scale is None else expected.new_tensor(self.scale)
        return self.rtol * (1 + ROUNDING * self.growth) * (expected.abs() + scale)

    def __str__(self) -> str:
        grown = f" x (1 + {ROUNDING:g} x {self.growth:.3g})" if self.growth else ""
        return f"rtol={self.rtol:.3g} ({self.dtype}, n={self.reduction}){grown}"


def family(name: str) -> tuple:
    """The results a tensor's near-zero scale is read from: those of its kind (and optimizer state)
    at its step; a result of no kind (``out``, ``lse``) is a family of its own."""
    parts = parse(name)
    return (parts.step, parts.kind, parts.state) if parts.kind in ("grad", "param", "opt", "loss") else (name,)


class Tolerances:
    """The policy applied per result: ``reduction`` maps a tensor name to its ``n`` ("*": the rest).

    ``reference``: the expected results, which give each tensor's family scale (2. in the module
    docstring); ``one_process``: the same results computed on one process in the cell's dtype,
    which give each tensor its ``growth`` (3.)."""

    def __init__(self, dtype: str, reduction: int | dict[str, int],
                 reference: dict[str, torch.Tensor] | None = None,
                 one_process: dict[str, torch.Tensor] | None = None):
        self.dtype = dtype
        self.sizes = dict(reduction) if isinstance(reduction, dict) else {"*": int(reduction)}
        self._default = tolerance(dtype, self.sizes["*"])
        self.scales: dict[str, float] = _zero_scales(reference, self._base) if reference else {}
        self.growth: dict[str, float] = {}
        for name, want in (reference or {}).items():
            got = (one_process or {}).get(name)
            if got is not None and got.shape == want.shape and want.is_floating_point() and want.numel():
                err = (got.double() - want.double()).abs()
                allowed = self._static(name).allowed(want)
                self.growth[name] = float((err / allowed.clamp_min(torch.finfo(torch.float64).tiny)).max())

    def _base(self, name: str) -> Tolerance:
        return tolerance(self.dtype, self.sizes[name]) if name in self.sizes else self._default

    def _static(self, name: str) -> Tolerance:
        """(1) and (2): the allowance before one process's growth."""
        base = self._base(name)
        return Tolerance(base.rtol, base.dtype, base.reduction, self.scales.get(name)) if name in self.scales else base

    def get(self, name: str) -> Tolerance:
        static = self._static(name)
        growth = self.growth.get(name, 0.0)
        return Tolerance(static.rtol, static.dtype, static.reduction, static.scale, growth) if growth else static

    def __str__(self) -> str:
        extra = ", ".join(f"{k} n={v}" for k, v in sorted(self.sizes.items()) if k != "*")
        text = f"{self._default}" + (f"; {extra}" if extra else "")
        if self.growth:
            name, most = max(self.growth.items(), key=lambda item: item[1])
            text += (f"; per tensor x (1 + {ROUNDING:g} x one process's {self.dtype} err/tol there), "
                     f"the most {most:.3g} at {name}")
        return text


def _zero_scales(reference: dict[str, torch.Tensor], base) -> dict[str, float]:
    """Each tensor that is zero to the cell's precision (``base(name)``'s ``rtol``) -> its family's
    scale: the median of its tensors' rms (one outlier, a gradient of 1e6 beside ones of 1e-2, must
    not make the others look zero)."""
    rms: dict[tuple, list[float]] = {}
    for name, t in reference.items():
        if t.is_floating_point() and t.numel():
            rms.setdefault(family(name), []).append(float(_rms(t.double())))
    out = {}
    for name, t in reference.items():
        if not t.is_floating_point() or not t.numel():
            continue
        scale = statistics.median(rms[family(name)])
        if float(_rms(t.double())) < base(name).rtol * scale:
            out[name] = scale
    return out


def tolerance(dtype: str, reduction: int) -> Tolerance:
    """Tolerance for results computed in ``dtype`` through reductions of up to ``reduction`` terms."""
    if dtype not in EPS:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {', '.join(EPS)}")
    n = max(1, int(reduction))
    rtol = SAFETY * (EPS[dtype] + EPS[ACCUMULATE[dtype]] * math.sqrt(n))
    return Tolerance(rtol, dtype, n)
