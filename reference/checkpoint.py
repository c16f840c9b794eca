"""Single-process reference for checkpoint resharding: the unsharded model and AdamW state, in fp64.

The model is a two-layer MLP, ``y = W2 gelu(W1 x + b1) + b2`` (W1: [f, h], W2: [h, f]), trained on
``probe_loss``. A checkpoint round trip is, on one process, nothing at all: the state saved after
the first step is the state the second step starts from. So the reference is two AdamW steps:

    step 1 on (x1, probe1)  -> the state that is saved, and that every load must restore bit for bit
    step 2 on (x2, probe2)  -> the step taken after "resume"

Results (names shared with ``parallel/checkpoint.py``):

    loaded/param/<p>, loaded/opt/exp_avg/<p>, loaded/opt/exp_avg_sq/<p>    state after step 1
    resumed/loss, resumed/param/<p>, resumed/opt/...                       step 2 and the state after it

The sizes are chosen so that dim 0 does not divide the FSDP degrees (f=10 over 3, 4 and 8) and one
parameter (b2, h=6) is smaller than the largest world (empty shards at 8).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.config import Config
from harness.context import generator
from harness.tolerance import TORCH_DTYPE

from .common import adamw, param_name, probe_loss, state_name

SIZES = dict(b=24, h=6, f=10)
PARAMS = ("w1", "b1", "w2", "b2")
MOMENTS = ("exp_avg", "exp_avg_sq")
# AdamW's step is lr * m / (sqrt(v) + eps): for a gradient element g within a few eps of zero it is
# steep, and turns an fp32 rounding error of g into up to lr/eps = 50 times that error in the
# parameter. Measured on this problem (fp32 on one process, batch unsplit or split 3/4/8 ways,
# against fp64): worst err/tol of the parameters 1.5 with the probe at unit scale, 1.3 at 10x,
# 0.24 at 100x, where the smallest gradient element is ~25 eps and the step is flat. The moments
# still carry the gradients' exact values, so a wrongly scaled gradient still shows.
PROBE_SCALE = 100.0


@dataclass
class Problem:
    """Initial parameters, the two steps' batches, and a different target state; identical everywhere."""

    params: dict[str, torch.Tensor]
    batches: list[tuple[torch.Tensor, torch.Tensor]]  # (x, probe) of step 1 and of the resumed step
    # what the loading side holds before it loads: other parameters trained on other batches
    target_params: dict[str, torch.Tensor]
    target_batches: list[tuple[torch.Tensor, torch.Tensor]]


def make_problem(cfg: Config) -> Problem:
    g = generator("ckpt", cfg.problem_key)
    b, h, f = (cfg.size(k) for k in "bhf")
    dtype = TORCH_DTYPE[cfg.dtype]

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(dtype)

    def params():
        return {"w1": randn(f, h, scale=h**-0.5), "b1": randn(f, scale=0.1),
                "w2": randn(h, f, scale=f**-0.5), "b2": randn(h, scale=0.1)}

    def batch():  # the probe is scaled so that gradients sit well above AdamW's eps (see PROBE_SCALE)
        return randn(b, h), randn(b, h, scale=PROBE_SCALE)

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


def reference(cfg: Config) -> dict[str, torch.Tensor]:
    """State after the saved step, and the resumed step with the state after it, in fp64."""
    problem = make_problem(cfg)
    params = {k: t.double().requires_grad_() for k, t in problem.params.items()}
    optimizer = adamw(list(params.values()))
    result = {}
    for i, (x, probe) in enumerate(problem.batches):
        loss = probe_loss(forward(params, x.double()), probe.double(), x.shape[0])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if i == 0:
            result.update(state(params, optimizer, "loaded"))
    result["resumed/loss"] = loss.detach()
    return result | state(params, optimizer, "resumed")


def reduction_size(cfg: Config) -> dict[str, int]:
    """A weight gradient sums over the batch, a matmul over h or f; the loss over every output."""
    b, h, f = (cfg.size(k) for k in "bhf")
    return {"*": max(b, h, f), "resumed/loss": b * h}
