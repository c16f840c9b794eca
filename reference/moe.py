"""Single-process reference for expert parallelism: a mixture-of-experts layer, in fp64.

Written as a plain loop over experts, so that it can be checked by eye::

    scores = softmax(x R^T) or sigmoid(x R^T)                    R: [e, h], scores: [t, e]
    gates, route = top-k of scores per token                     [t, k], best first
    gates /= gates.sum(-1)                                       only with switch norm_on
    kept = capacity rule below (everything in dropless mode)     [t, k]
    out[i] = sum over chosen j, kept: gates[i, j] * expert_{route[i, j]}(x[i])
    expert_e(x) = (silu(x Wg_e^T) * (x Wu_e^T)) Wd_e^T           SwiGLU: Wg, Wu [e, f, h], Wd [e, h, f]
    aux = e * sum_e frac_e * prob_e                              Switch-style load balancing
    loss = probe_loss(out) + AUX_WEIGHT * aux                     aux_off: loss = probe_loss(out), no aux result

The gradient reaches the router through the gates (in ``out``) and through ``prob_e`` (in ``aux``).

Switch ``aux`` (optional; absent = ``on``): ``aux_off`` is a layer without a load-balancing loss (a
choice of the model, as transformers' MoE blocks make: their aux loss lives in the ``*ForCausalLM``
head and only with ``output_router_logits``): the loss is the probe loss alone and there is no
``aux`` result, so a layer that has none is compared rather than failed for a missing term.

Capacity (switch ``cap``: ``none`` = dropless, else the capacity factor in percent): every expert
takes at most ``C = ceil(cap/100 * t * k / e)`` of the token slots (token, choice) routed to it,
counted **over the whole global batch**, first come first served in token order: slot (i, j) is
kept when fewer than C slots of earlier tokens chose the same expert. (A token chooses an expert at
most once, so the order of choices within a token does not matter.) Counting over the global batch
makes the result independent of the mesh; the parallel side counts the same way across its ranks
(``harness/parallel/moe.py``). A dropped slot contributes nothing to ``out`` and ``dropped`` reports it.

The auxiliary loss is Switch's: ``frac_e`` is the share of all t·k slots routed to expert e (before
capacity drops; no gradient), ``prob_e`` the mean over tokens of the router's probability for e
(softmax scores; sigmoid scores normalised to sum to one per token).

Routing switch ``route`` builds edge cases deterministically: ``rand`` (plain random problem),
``one`` (every token's best choice is expert 0), ``skew`` (the last half of the experts, and so the
last ep rank, receive no token). Both set feature 0 of every token to 1, use router column 0 as a
routing bias of +-BIAS and scale the random part of the logits down to ~0.25, which the bias
outweighs for every token. The bias is kept moderate on purpose: a saturated softmax (p = 1 - 1e-3)
is ill-conditioned in fp32 (1 - p loses digits), which no parallel algorithm can be blamed for.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness import events
from harness.config import Config
from harness.context import generator
from harness.compare.tolerance import TORCH_DTYPE
from harness.names import grad_name

from .common import in_cell_dtype, probe_loss, record_step

SIZES = dict(t=24, h=8, f=16)  # tokens, model dim, expert FFN dim; e (experts) and k (top-k) are swept
PARAMS = ("router", "w_gate", "w_up", "w_down")
EXPERT_PARAMS = ("w_gate", "w_up", "w_down")
AUX_WEIGHT = 1.0  # large on purpose: the aux loss's share of the router gradient is as large as out's
BIAS = 3.0
QUIET = 0.25  # the random part of the router for route one/skew


@dataclass
class Problem:
    """Inputs, initial parameters (in the config's dtype) and the probe, identical on every process."""

    x: torch.Tensor
    params: dict[str, torch.Tensor]
    probe: torch.Tensor
    tokens: int


def make_problem(cfg: Config) -> Problem:
    g = generator("moe", cfg.problem_key)
    t, h, f, e = (cfg.size(k) for k in "thfe")
    dtype = TORCH_DTYPE[cfg.dtype]

    def randn(*shape, scale=1.0):
        return torch.randn(shape, generator=g) * scale

    x = randn(t, h)
    params = {"router": randn(e, h, scale=h**-0.5), "w_gate": randn(e, f, h, scale=h**-0.5),
              "w_up": randn(e, f, h, scale=h**-0.5), "w_down": randn(e, h, f, scale=f**-0.5)}
    probe = randn(t, h)
    route = cfg.switch("route")
    if route in ("one", "skew"):
        x[:, 0] = 1.0
        params["router"] *= QUIET
        bias = params["router"][:, 0]
        bias.zero_()
        if route == "one":
            bias[0] = BIAS
        else:
            bias[e // 2:] = -BIAS
    return Problem(x.to(dtype), {k: v.to(dtype) for k, v in params.items()}, probe, t)


def has_aux(cfg: Config) -> bool:
    """Whether the layer adds its Switch aux loss to the loss (switch ``aux``, absent = on)."""
    return dict(cfg.switches).get("aux", "on") == "on"


def capacity(cfg: Config) -> int | None:
    """Slots each expert takes over the global batch (None: dropless)."""
    cap = cfg.switch("cap")
    if cap == "none":
        return None
    t, k, e = cfg.size("t"), cfg.size("k"), cfg.size("e")
    return -(-int(cap) * t * k // (100 * e))  # ceil(cap/100 * t * k / e)


def scores_of(logits: torch.Tensor, score: str) -> torch.Tensor:
    return logits.softmax(-1) if score == "softmax" else logits.sigmoid()


def probs_of(scores: torch.Tensor, score: str) -> torch.Tensor:
    """Per-token distribution over experts for the aux loss."""
    return scores if score == "softmax" else scores / scores.sum(-1, keepdim=True)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def keep_mask(route: torch.Tensor, experts: int, cap: int | None) -> torch.Tensor:
    """[t, k] bool: slot (i, j) is kept when fewer than ``cap`` earlier tokens chose its expert."""
    kept = torch.ones(route.shape, dtype=torch.bool)
    if cap is None:
        return kept
    taken = [0] * experts
    for i in range(route.shape[0]):
        for j in range(route.shape[1]):
            e = int(route[i, j])
            kept[i, j] = taken[e] < cap
            taken[e] += 1
    return kept


def moe(cfg: Config, x: torch.Tensor, p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MoE layer: output, aux loss, the chosen experts and which slots were dropped."""
    e, k, score = cfg.size("e"), cfg.size("k"), cfg.switch("score")
    scores = scores_of(F.linear(x, p["router"]), score)
    events.op("router", {"x": x}, {"scores": scores})
    gates, route = scores.topk(k, dim=-1)
    if cfg.switch("norm") == "on":
        gates = gates / gates.sum(-1, keepdim=True)
    kept = keep_mask(route, e, capacity(cfg))
    out = torch.zeros_like(x)
    for expert in range(e):
        token, slot = ((route == expert) & kept).nonzero(as_tuple=True)
        rows = x[token]
        y = swiglu(rows, p["w_gate"][expert], p["w_up"][expert], p["w_down"][expert])
        events.record("expert", {"x": rows}, {"y": y}, expert=expert)
        out = out.index_add(0, token, gates[token, slot].unsqueeze(-1) * y)
    frac = torch.bincount(route.flatten(), minlength=e).to(x.dtype) / route.numel()
    aux = e * (frac * probs_of(scores, score).mean(0)).sum()
    return {"out": out, "aux": aux, "route": route.to(x.dtype), "dropped": (~kept).to(x.dtype)}


def reference(cfg: Config, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Output, aux and total loss, input and parameter gradients, parameters after one SGD step, in fp64
    (in ``dtype``: the calibration)."""
    problem = make_problem(cfg)
    params = {k: problem.params[k].to(dtype).requires_grad_() for k in PARAMS}
    x = problem.x.to(dtype).requires_grad_()
    result = moe(cfg, x, params)
    loss = probe_loss(result["out"], problem.probe.to(dtype), problem.tokens)
    if has_aux(cfg):
        loss = loss + AUX_WEIGHT * result["aux"]
    else:
        del result["aux"]  # a layer without an aux loss has no such result
    loss.backward()
    result = {name: t.detach() for name, t in result.items()}
    result.update({"loss": loss.detach(), grad_name("x"): x.grad})
    return record_step(params, result)


calibration = in_cell_dtype(reference)


def reduction_size(cfg: Config) -> dict[str, int]:
    """Terms each result adds: a matmul's inner dim (h, f) or the top-k sum, a weight gradient sums
    over the tokens (at most t) routed to its expert, the router's over all t tokens; the loss sums
    every output element against the probe, the aux loss every token's probability."""
    t, h, f, e = (cfg.size(k) for k in "thfe")
    return {"*": max(t, h, f, e), "loss": t * h, "aux": t * e}
