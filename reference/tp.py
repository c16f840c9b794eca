"""Single-process reference for tensor parallelism: the dense layers, in fp64.

Ops (switch ``op``), each a small layer with the loss and the training step around it:

    colgather, colshard  y = x W^T + b                          W: [f, h]
    rowsplit, rowshard   y = x W^T + b                          W: [h, f], x: [b, s, f]
    mlp                  y = gelu(x W1^T + b1) W2^T + b2
    sp                   y = x + mlp(layer_norm(x))             (sequence parallel in harness/parallel/tp.py)
    embed                y = E[ids]                             E: [v, h]
    xent                 loss = cross_entropy(x H^T, labels)    H: [v, h]
    gateup               y = (silu(x Wg^T) * (x Wu^T)) Wd^T + bd  Wg, Wu packed as W_gu: [2f, h]

Every op but xent is trained on ``probe_loss``; xent on its own mean cross-entropy.
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

OPS = ("colgather", "colshard", "rowsplit", "rowshard", "mlp", "sp", "embed", "xent", "gateup")
SIZES = dict(b=4, s=8, h=16, f=32, v=40)
LN_EPS = 1e-5


@dataclass
class Problem:
    """Inputs, initial parameters (in the config's dtype) and the probe, identical on every process."""

    inputs: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    probe: torch.Tensor | None
    tokens: int
    out_shape: tuple[int, ...]


def make_problem(cfg: Config) -> Problem:
    # The problem is set by the op alone: other switches (hf's ``style``) choose how an implementation
    # parallelizes it, so every implementation of an op solves the same problem (same inputs, same
    # tolerance behaviour). For cells that have only ``op`` this is exactly cfg.problem_key.
    g = generator("tp", cfg.replace(switches={"op": cfg.switch("op")}).problem_key)
    b, s, h, f, v = (cfg.size(k) for k in "bshfv")
    op, dtype = cfg.switch("op"), TORCH_DTYPE[cfg.dtype]

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(shape, generator=g) * scale + shift).to(dtype)

    def linear(out_dim, in_dim, bias=True):
        w = randn(out_dim, in_dim, scale=in_dim**-0.5)
        return (w, randn(out_dim, scale=0.1)) if bias else (w, None)

    params: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.Tensor] = {}
    if op in ("colgather", "colshard"):
        params["w"], params["b"] = linear(f, h)
        inputs["x"], out_dim = randn(b, s, h), f
    elif op in ("rowsplit", "rowshard"):
        params["w"], params["b"] = linear(h, f)
        inputs["x"], out_dim = randn(b, s, f), h
    elif op in ("mlp", "sp"):
        if op == "sp":
            params["ln_w"], params["ln_b"] = randn(h, scale=0.1, shift=1.0), randn(h, scale=0.1)
        params["w1"], params["b1"] = linear(f, h)
        params["w2"], params["b2"] = linear(h, f)
        inputs["x"], out_dim = randn(b, s, h), h
    elif op == "embed":
        params["emb"] = randn(v, h)
        inputs["ids"], out_dim = torch.randint(v, (b, s), generator=g), h
    elif op == "xent":
        params["head"] = randn(v, h, scale=h**-0.5)
        inputs["x"], out_dim = randn(b, s, h), None
        inputs["labels"] = torch.randint(v, (b, s), generator=g)
    elif op == "gateup":
        params["w_gu"] = randn(2 * f, h, scale=h**-0.5)
        params["w_down"], params["b_down"] = linear(h, f)
        inputs["x"], out_dim = randn(b, s, h), h
    else:
        raise ValueError(f"unknown tp op {op!r}; known: {', '.join(OPS)}")
    probe = torch.randn((b, s, out_dim), generator=g) if out_dim else None
    return Problem(inputs, params, probe, b * s, (b, s, out_dim or v))


def forward(op: str, p: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The dense layer: returns ``y`` (or the logits, for xent)."""
    x = inputs.get("x")
    if op in ("colgather", "colshard", "rowsplit", "rowshard"):
        return F.linear(x, p["w"], p["b"])
    if op == "mlp":
        h = F.linear(x, p["w1"], p["b1"])
        events.op("fc1", {"x": x}, {"h": h})
        a = F.gelu(h)
        y = F.linear(a, p["w2"], p["b2"])
        events.op("fc2", {"a": a}, {"y": y})
        return y
    if op == "sp":
        normed = F.layer_norm(x, x.shape[-1:], p["ln_w"], p["ln_b"], LN_EPS)
        return x + F.linear(F.gelu(F.linear(normed, p["w1"], p["b1"])), p["w2"], p["b2"])
    if op == "embed":
        return F.embedding(inputs["ids"], p["emb"])
    if op == "xent":
        return F.linear(x, p["head"])
    if op == "gateup":
        gate, up = F.linear(x, p["w_gu"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, p["w_down"], p["b_down"])
    raise ValueError(f"unknown tp op {op!r}")


def reference(cfg: Config, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Output, loss, input and parameter gradients, and parameters after one SGD step, in fp64
    (in ``dtype``: the calibration)."""
    problem = make_problem(cfg)
    op = cfg.switch("op")
    params = {k: t.to(dtype).requires_grad_() for k, t in problem.params.items()}
    inputs = {k: t.to(dtype).requires_grad_() if t.is_floating_point() else t for k, t in problem.inputs.items()}
    out = forward(op, params, inputs)
    events.op("layer", {"x": inputs["x"]} if "x" in inputs else {}, {"out": out})
    if op == "xent":
        loss = F.cross_entropy(out.flatten(0, 1), inputs["labels"].flatten())
    else:
        loss = probe_loss(out, problem.probe.to(dtype), problem.tokens)
    loss.backward()
    result = {"out": out.detach(), "loss": loss.detach()}
    if "x" in inputs:
        result[grad_name("x")] = inputs["x"].grad
    return record_step(params, result)


calibration = in_cell_dtype(reference)


def reduction_size(cfg: Config) -> dict[str, int]:
    """Terms each result adds: a matmul's inner dim or a weight gradient's tokens; the loss sums
    every output element against the probe (or every logit, for xent)."""
    b, s, h, f, v = (cfg.size(k) for k in "bshfv")
    return {"*": max(h, f, v, b * s), "loss": b * s * max(h, f, v)}
