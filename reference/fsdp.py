"""Single-process reference for FSDP/HSDP: a small MLP trained for three AdamW steps, in fp64.

The model (sizes chosen so that sharding is awkward: see ``SIZES``)::

    out = gelu(x W1^T + b1) W2^T + b2        W1: [f, h], b1: [f], W2: [o, f], b2: [o]

Each step takes a fresh batch ``x[k]`` of ``b`` rows and trains on ``probe_loss`` (the mean over the
batch), then clips the global gradient norm to ``MAX_NORM`` and takes an AdamW step
(``reference.common.adamw``). Every step is recorded under ``step<k>/``: the loss, the gradient norm
before clipping, every parameter's gradient (before clipping), the parameters after the step and
the AdamW moments. Gradient accumulation (size ``m``, microbatches) does not change these numbers:
the reference takes the whole batch at once.

Mixed precision (dtype ``bf16``) changes only the problem's values here (parameters and inputs are
bf16 numbers); the reference still computes in fp64.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness import events
from harness.config import Config
from harness.context import generator
from harness.compare.tolerance import TORCH_DTYPE
from harness.names import grad_name, param_name, state_name, step_name

from .common import adamw, in_cell_dtype, probe_loss

# f=13 divides none of the dp degrees 2, 3, 4, 8 (uneven torch.chunk shards, 13 over 4 is 4/4/4/1);
# o=5 is smaller than 8 (and 5 over 4 is 2/2/1/-), so some ranks hold an empty shard of W2 and b2.
# b=72 rows split over any data-parallel world of 1, 2, 3, 4, 8 ranks times 1 or 3 microbatches.
SIZES = dict(b=72, h=6, f=13, o=5)
PARAMS = ("w1", "b1", "w2", "b2")
STEPS = 3
# Below the gradient norm of every step, so clipping is active: the norm then moves the parameters.
MAX_NORM = 0.05
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6)


@dataclass
class Problem:
    """Initial parameters, per-step inputs and probes (in the config's dtype), identical everywhere."""

    params: dict[str, torch.Tensor]
    x: torch.Tensor  # [STEPS, b, h]
    probe: torch.Tensor  # [STEPS, b, o]


def make_problem(cfg: Config) -> Problem:
    """The problem of ``cfg``; independent of the microbatch count ``m`` (it only splits the work)."""
    sizes = {k: v for k, v in cfg.sizes if k != "m"}
    g = generator("fsdp", cfg.replace(sizes=sizes).problem_key)
    b, h, f, o = (cfg.size(k) for k in "bhfo")
    dtype = TORCH_DTYPE[cfg.dtype]

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(dtype)

    params = {"w1": randn(f, h, scale=h**-0.5), "b1": randn(f, scale=0.1),
              "w2": randn(o, f, scale=f**-0.5), "b2": randn(o, scale=0.1)}
    return Problem(params, randn(STEPS, b, h), torch.randn((STEPS, b, o), generator=g))


def forward(p: dict[str, torch.Tensor], x: torch.Tensor, step: int = 0) -> torch.Tensor:
    """The MLP; events per layer: the weights it used at optimizer step ``step`` and its activations."""
    events.record("weights", {}, {"w1": p["w1"], "b1": p["b1"]}, layer=0, step=step)
    h = F.gelu(F.linear(x, p["w1"], p["b1"]))
    events.op("layer", {"x": x}, {"y": h}, layer=0, step=step)
    events.record("weights", {}, {"w2": p["w2"], "b2": p["b2"]}, layer=1, step=step)
    out = F.linear(h, p["w2"], p["b2"])
    events.op("layer", {"x": h}, {"y": out}, layer=1, step=step)
    return out



def reference(cfg: Config, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Three steps: per step the loss, gradient norm, gradients, parameters and AdamW moments, in fp64
    (in ``dtype``: the calibration)."""
    problem = make_problem(cfg)
    params = {k: t.to(dtype).requires_grad_() for k, t in problem.params.items()}
    optimizer = adamw(list(params.values()))
    result: dict[str, torch.Tensor] = {}
    for k in range(STEPS):
        out = forward(params, problem.x[k].to(dtype), k + 1)
        loss = probe_loss(out, problem.probe[k].to(dtype), cfg.size("b"))
        loss.backward()
        grads = {name: p.grad.clone() for name, p in params.items()}
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), MAX_NORM, foreach=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        s = k + 1
        result[step_name(s, "loss")] = loss.detach()
        result[step_name(s, "gradnorm")] = norm.detach()
        for name, p in params.items():
            result[step_name(s, grad_name(name))] = grads[name]
            result[step_name(s, param_name(name))] = p.detach().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                result[step_name(s, state_name(key, name))] = optimizer.state[p][key].clone()
    return result


calibration = in_cell_dtype(reference)


def reduction_size(cfg: Config) -> dict[str, int]:
    """Terms each result adds: a weight gradient sums over the batch's rows; the loss over every
    output element; the gradient norm over every parameter element."""
    b, h, f, o = (cfg.size(k) for k in "bhfo")
    numel = f * h + f + o * f + o
    sizes = {"*": max(b, h, f)}
    for s in range(1, STEPS + 1):
        sizes[step_name(s, "loss")] = b * o
        sizes[step_name(s, "gradnorm")] = numel
    return sizes
