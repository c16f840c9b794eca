"""Single-process reference for checkpoint resharding: the unsharded model and AdamW state, in fp64.

The model is a two-layer MLP, ``y = W2 gelu(W1 x + b1) + b2`` (W1: [f, h], W2: [h, f]), trained on
``probe_loss``. A checkpoint round trip is, on one process, nothing at all: the state saved after
the first step is the state the second step starts from. So the reference is two AdamW steps:

    step 1 on (x1, probe1)  -> the state that is saved, and that every load must restore bit for bit
    step 2 on (x2, probe2)  -> the step taken after "resume"

Results (names shared with ``harness/parallel/checkpoint.py``):

    loaded/param/<p>, loaded/opt/exp_avg/<p>, loaded/opt/exp_avg_sq/<p>    state after step 1
    resumed/loss, resumed/param/<p>, resumed/opt/...                       step 2 and the state after it

One problem serves every cell (see ``make_problem``), so it is worth knowing how well conditioned it
is: AdamW's step ``lr * m / (sqrt(v) + eps)`` is steep for a gradient element within a few eps of
zero (up to lr/eps = 50 times its rounding error lands in the parameter), and the loss sums
``y * probe`` terms that partly cancel. Measured for this draw (fp32 on one process, batch whole or
split 2/3/4/8 ways, against fp64): worst err/tol 0.08. (Drawing a problem per cell, as when the
layouts were part of the generator's key, put some of the 81 draws at err/tol 1.2 to 3.5.)

The sizes are chosen so that dim 0 does not divide the FSDP degrees (f=10 over 3, 4 and 8) and one
parameter (b2, h=6) is smaller than the largest world (empty shards at 8).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness import events
from harness.config import Config
from harness.context import generator
from harness.compare.tolerance import TORCH_DTYPE
from harness.names import param_name, state_name

from .common import adamw, in_cell_dtype, probe_loss

SIZES = dict(b=24, h=6, f=10)
PARAMS = ("w1", "b1", "w2", "b2")
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Problem:
    """Initial parameters, the two steps' batches, and a different target state; identical everywhere."""

    params: dict[str, torch.Tensor]
    batches: list[tuple[torch.Tensor, torch.Tensor]]  # (x, probe) of step 1 and of the resumed step
    # what the loading side holds before it loads: other parameters trained on other batches
    target_params: dict[str, torch.Tensor]
    target_batches: list[tuple[torch.Tensor, torch.Tensor]]


def make_problem(cfg: Config) -> Problem:
    # The layouts (switches save, load) are this component's meshes: they do not change the problem,
    # so every cell of one dtype/sizes/seed trains the same model on the same batches.
    g = generator("ckpt", cfg.dtype, cfg.sizes, cfg.seed)
    b, h, f = (cfg.size(k) for k in "bhf")
    dtype = TORCH_DTYPE[cfg.dtype]

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(dtype)

    def params():
        return {"w1": randn(f, h, scale=h**-0.5), "b1": randn(f, scale=0.1),
                "w2": randn(h, f, scale=f**-0.5), "b2": randn(h, scale=0.1)}

    def batch():
        return randn(b, h), randn(b, h)

    return Problem(params(), [batch(), batch()], params(), [batch(), batch()])


def forward(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, p["w1"], p["b1"])), p["w2"], p["b2"])


def state(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, prefix: str) -> dict[str, torch.Tensor]:
    """Parameters and AdamW moments, named ``<prefix>/param/<p>`` and ``<prefix>/opt/<moment>/<p>``."""
    out = {}
    for name, p in params.items():
        out[f"{prefix}/{param_name(name)}"] = p.detach().clone()
        for key in MOMENTS:
            out[f"{prefix}/{state_name(key, name)}"] = optimizer.state[p][key].detach().clone()
    return out


def reference(cfg: Config, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """State after the saved step, and the resumed step with the state after it, in fp64
    (in ``dtype``: the calibration)."""
    problem = make_problem(cfg)
    params = {k: t.to(dtype).requires_grad_() for k, t in problem.params.items()}
    optimizer = adamw(list(params.values()))
    result = {}
    for i, (x, probe) in enumerate(problem.batches):
        loss = probe_loss(forward(params, x.to(dtype)), probe.to(dtype), x.shape[0])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if i == 0:
            result.update(state(params, optimizer, "loaded"))
    result.update(state(params, optimizer, "resumed"))
    # events: the state saved (which every load must restore) and the state after the resumed step
    saved, resumed = (_renamed(result, prefix) for prefix in ("loaded/", "resumed/"))
    events.record("checkpoint", {}, saved, phase="save")
    events.record("checkpoint", {}, saved, phase="load")
    events.record("checkpoint", {}, resumed, phase="resume")
    result["resumed/loss"] = loss.detach()
    return result


calibration = in_cell_dtype(reference)


def _renamed(result: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The state under ``prefix`` by its event names (``state/param/w1``), the tensors themselves."""
    return {"state/" + k[len(prefix):]: t for k, t in result.items() if k.startswith(prefix)}


def reduction_size(cfg: Config) -> dict[str, int]:
    """A weight gradient sums over the batch, a matmul over h or f; the loss over every output."""
    b, h, f = (cfg.size(k) for k in "bhf")
    return {"*": max(b, h, f), "resumed/loss": b * h}
