"""Single-process reference for pipeline parallelism: the whole model, gradient accumulation, in fp64.

The model (tiny on purpose; the pipeline's arithmetic is in the schedule, not in the layers)::

    x = E[ids]                                        E: [v, h]       (embedding, first stage)
    x = x + W2_l gelu(W1_l x + b1_l) + b2_l           l = 0 .. L-1    (residual MLP blocks)
    loss = cross_entropy(x H^T, labels)               H: [v, h]       (head, last stage; H = E when tied)

The global batch of ``b`` sequences is cut into ``m`` microbatches; each microbatch's mean loss is
divided by ``m`` and back-propagated (times the static loss scale ``GRAD_SCALE``), gradients
accumulating: the mean over the global batch as a user writes it. Then one AdamW step, so that the
optimizer state is checked too. Gradients are reported as AdamW sees them (of the scaled loss).

Block parameters are stacked along a leading layer dim (``w1``: [L, f, h], ...): the pipeline hands
out layers by that dim (``harness/parallel/pipeline.py``), and AdamW, elementwise, steps a stacked tensor
exactly as it steps its slices.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness import events
from harness.config import Config
from harness.context import generator
from harness.compare.tolerance import TORCH_DTYPE
from harness.names import grad_name, param_name

from .common import adamw, in_cell_dtype, record_adamw_state

SIZES = dict(s=4, h=8, f=16, v=24)  # sequence, model dim, MLP dim, vocab; b, m, l, vs set per cell
# Static loss scale: backward runs on loss * 2^-8 (a power of two: it moves exponents only, in every
# dtype). The shared AdamW has eps=1e-3 (reference/common.py); this model's cross-entropy gradients
# are ~1e-2..1e-1 (rms), where AdamW's first step is lr*sign(g): blind to a gradient's scale (a bug
# dividing by m twice would not move a parameter), and a jump of 2*lr for a near-zero gradient whose
# rounding flips its sign (measured: param/w2 at 2-8x the bf16 tolerance). Scaled to ~1e-4..1e-3,
# below eps, the step is close to lr*g/eps: a smooth function of the gradient, scale included.
GRAD_SCALE = 2.0**-8
BLOCK = ("w1", "b1", "w2", "b2")


def tied(cfg: Config) -> bool:
    return cfg.switch("tied") == "on"


@dataclass
class Problem:
    """Token ids, labels and initial parameters (in the config's dtype), identical on every process."""

    ids: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s]
    params: dict[str, torch.Tensor]


def make_problem(cfg: Config) -> Problem:
    g = generator("pipeline", cfg.problem_key)
    b, s, h, f, v, layers = (cfg.size(k) for k in "bshfvl")
    dtype = TORCH_DTYPE[cfg.dtype]

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(dtype)

    params = {
        "emb": randn(v, h),
        # small second layer: a deep residual stack stays of order one, and so do its gradients
        "w1": randn(layers, f, h, scale=h**-0.5), "b1": randn(layers, f, scale=0.1),
        "w2": randn(layers, h, f, scale=(f * layers) ** -0.5), "b2": randn(layers, h, scale=0.1),
    }
    if not tied(cfg):
        params["head"] = randn(v, h, scale=h**-0.5)
    ids = torch.randint(v, (b, s), generator=g)
    labels = torch.randint(v, (b, s), generator=g)
    return Problem(ids, labels, params)


def block(x: torch.Tensor, w1, b1, w2, b2) -> torch.Tensor:
    """One residual MLP block."""
    return x + F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def model_loss(p: dict[str, torch.Tensor], ids: torch.Tensor, labels: torch.Tensor, head_key: str,
               microbatch: int = 0) -> torch.Tensor:
    """Mean cross-entropy of one microbatch through the whole model."""
    x = F.embedding(ids, p["emb"])
    for layer in range(p["w1"].shape[0]):
        y = block(x, *(p[k][layer] for k in BLOCK))
        events.op("block", {"x": x}, {"y": y}, layer=layer, microbatch=microbatch)
        x = y
    logits = F.linear(x, p[head_key])
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    events.op("head", {"x": x}, {"token_loss": per_token}, microbatch=microbatch)
    return per_token.mean()


def microbatches(cfg: Config, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The global batch cut into ``m`` microbatches of consecutive rows. When bisect records events,
    microbatch i is the one the pipeline's dp ranks run as their i-th (each dp rank's i-th chunk of
    its own rows, in dp order), so that events compare like with like; the sum over microbatches,
    and so every result, is the same either way."""
    m, dp = cfg.size("m"), cfg.degree("dp")
    if not events.active() or dp == 1:
        return t.chunk(m)
    per_rank = [rows.chunk(m) for rows in t.chunk(dp)]
    return tuple(torch.cat([chunks[i] for chunks in per_rank]) for i in range(m))


def reference(cfg: Config, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Loss, every parameter's gradient, AdamW state and parameters after the step, in fp64
    (in ``dtype``: the calibration)."""
    problem, m = make_problem(cfg), cfg.size("m")
    params = {k: t.to(dtype).requires_grad_() for k, t in problem.params.items()}
    head_key = "emb" if tied(cfg) else "head"
    total = torch.zeros((), dtype=torch.promote_types(dtype, torch.float32))  # a loss in at least fp32
    for i, (ids, labels) in enumerate(zip(microbatches(cfg, problem.ids), microbatches(cfg, problem.labels))):
        loss = model_loss(params, ids, labels, head_key, i) / m  # mean over the global batch
        (loss * GRAD_SCALE).backward()  # gradients accumulate over microbatches
        total += loss.detach()
    result = {"loss": total.reshape(1)}
    result.update({grad_name(k): t.grad.clone() for k, t in params.items()})
    optimizer = adamw(list(params.values()))
    optimizer.step()
    record_adamw_state(optimizer, params, result)
    result.update({param_name(k): t.detach() for k, t in params.items()})
    return result


calibration = in_cell_dtype(reference)


def reduction_size(cfg: Config) -> dict[str, int]:
    """Terms each result adds: a weight gradient sums over every token of the global batch (the
    embedding's over a row's occurrences, twice when tied); activations over h, f or v features; the
    loss over every token's log-sum-exp of v logits."""
    b, s, h, f, v = (cfg.size(k) for k in "bshfv")
    return {"*": max(h, f, v, b * s), "loss": b * s * v}
