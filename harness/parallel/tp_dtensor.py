"""Tensor parallelism through PyTorch's own API: DTensor ``parallelize_module`` and ``loss_parallel``.

The same ops as ``harness/parallel/tp.py``, expressed as nn.Modules and a parallelize plan, so the cases
check PyTorch's implementation as well as ours and the two cross-check each other. Pieces carry the
placements DTensor itself reports.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)

from harness.config import Config
from harness.context import RankContext
from harness.layout import Piece, Shard
from harness.names import grad_name, param_name
from reference.common import probe_loss
from reference.tp import LN_EPS, make_problem

from .step import reduce_and_step
from .tp import BATCH, INPUT_PLAN, OUTPUT_PLAN, local_batch


def skip_reason(cfg: Config) -> str | None:
    op, tp = cfg.switch("op"), cfg.degree("tp")
    if "tp" not in cfg.dims:  # found by harness.explore: a dp-only mesh raised KeyError in DeviceMesh["tp"]
        return "the DTensor plans are laid over the mesh's tp dim: name one (tp=1 for none)"
    if op == "gateup":
        return "DTensor has no placement for packed gate/up weights (each rank holding its chunk of both halves)"
    # Plans that take an input already sharded wrap it with DTensor.from_local, which infers the
    # global size as local size * tp: wrong for torch.chunk's uneven shards (f=32 over tp=3 -> 30).
    uneven = {"rowshard": "f", "mlp": "f", "sp": "s"}.get(op)
    if uneven and cfg.size(uneven) % tp:
        return (f"DTensor.from_local assumes even shards: {op} input split unevenly "
                f"({uneven}={cfg.size(uneven)} over tp={tp}) is given the wrong global size")
    if op == "sp" and cfg.size("f") % tp:  # found by harness.explore: tp2 f17 raised in sharding propagation
        return (f"DTensor's sharding propagation fails for the sequence-parallel MLP with f={cfg.size('f')} "
                f"split unevenly over tp={tp} (aten.addmm of uneven Shard(1) and Shard(0))")
    return None


def _linear(w: torch.Tensor, b: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, dtype=w.dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
        if b is not None:
            layer.bias.copy_(b)
    return layer


class Layer(nn.Module):
    """The op of ``reference.tp.forward`` as modules, so a parallelize plan can name its parts."""

    def __init__(self, op: str, p: dict[str, torch.Tensor]):
        super().__init__()
        self.op = op
        if op in ("colgather", "colshard", "rowsplit", "rowshard"):
            self.lin = _linear(p["w"], p["b"])
        elif op in ("mlp", "sp"):
            self.w1, self.w2 = _linear(p["w1"], p["b1"]), _linear(p["w2"], p["b2"])
            if op == "sp":
                self.norm = nn.LayerNorm(p["ln_w"].shape[0], eps=LN_EPS, dtype=p["ln_w"].dtype)
                with torch.no_grad():
                    self.norm.weight.copy_(p["ln_w"])
                    self.norm.bias.copy_(p["ln_b"])
        elif op == "embed":
            self.emb = nn.Embedding.from_pretrained(p["emb"].clone(), freeze=False)
        elif op == "xent":
            self.head = _linear(p["head"], None)

    def forward(self, x, ids=None):
        if self.op in ("colgather", "colshard", "rowsplit", "rowshard"):
            return self.lin(x)
        if self.op == "mlp":
            return self.w2(F.gelu(self.w1(x)))
        if self.op == "sp":
            return x + self.w2(F.gelu(self.w1(self.norm(x))))
        if self.op == "embed":
            return self.emb(ids)
        return self.head(x)

    def parameter_names(self) -> dict[str, str]:
        """Module parameter name -> the reference's parameter name."""
        return {k: PARAMETER_NAMES[k] for k, _ in self.named_parameters()}


PARAMETER_NAMES = {"lin.weight": "w", "lin.bias": "b", "w1.weight": "w1", "w1.bias": "b1", "w2.weight": "w2",
                   "w2.bias": "b2", "norm.weight": "ln_w", "norm.bias": "ln_b", "emb.weight": "emb",
                   "head.weight": "head"}


PLANS = {
    "colgather": lambda: {"lin": ColwiseParallel(output_layouts=Replicate())},
    "colshard": lambda: {"lin": ColwiseParallel()},
    "rowsplit": lambda: {"lin": RowwiseParallel(input_layouts=Replicate())},
    "rowshard": lambda: {"lin": RowwiseParallel()},
    "mlp": lambda: {"w1": ColwiseParallel(), "w2": RowwiseParallel()},
    "sp": lambda: {"norm": SequenceParallel(), "w1": ColwiseParallel(input_layouts=DShard(1)),
                   "w2": RowwiseParallel(output_layouts=DShard(1))},
    "embed": lambda: {"emb": RowwiseParallel(input_layouts=Replicate())},
    "xent": lambda: {"head": ColwiseParallel(use_local_output=False)},
}


def _piece(t: torch.Tensor, shape, tp_placement: Shard | None = None, **extra: Shard) -> Piece:
    """A Piece from a DTensor (placements as DTensor reports them) or from a plain local tensor."""
    if isinstance(t, DTensor):
        if any(isinstance(p, Partial) for p in t.placements):
            t = t.redistribute(placements=[Replicate()] * len(t.placements))
        (placement,) = t.placements  # parallelized over the 1-D tp mesh
        tp_placement = Shard(placement.dim) if isinstance(placement, DShard) else None
        t = t.to_local()
    placements = dict(extra) | ({"tp": tp_placement} if tp_placement is not None else {})
    return Piece.sharded(t, shape, **placements)


def run(ctx: RankContext, cfg: Config) -> dict[str, Piece]:
    op, problem = cfg.switch("op"), make_problem(cfg)
    tp_mesh = ctx.device_mesh["tp"]
    dp = ctx.group("dp") if "dp" in ctx.layout.names else None


    model = parallelize_module(Layer(op, problem.params), tp_mesh, PLANS[op]())
    inputs = {k: local_batch(ctx, t) for k, t in problem.inputs.items()}
    x = local_batch(ctx, problem.inputs["x"], INPUT_PLAN.get(op)).requires_grad_() if "x" in problem.inputs else None
    out = model(x, inputs.get("ids"))
    if op == "xent":
        with loss_parallel():
            loss = F.cross_entropy(out.flatten(0, 1).float(), inputs["labels"].flatten(), reduction="sum")
            loss = loss / problem.tokens
            loss.backward()
    else:
        probe = local_batch(ctx, problem.probe, OUTPUT_PLAN.get(op))
        loss = probe_loss(out, probe, problem.tokens)
        if op in OUTPUT_PLAN:  # a sharded output gives a partial loss: sum it over tp
            loss = DTensor.from_local(loss, tp_mesh, [Partial()]).full_tensor()
        loss.backward()
    params = dict(model.named_parameters())
    total = reduce_and_step(list(params.values()), loss, [dp])
    grads = {k: p.grad for k, p in params.items()}

    pieces = {
        "out": _piece(out, problem.out_shape, OUTPUT_PLAN.get(op), dp=BATCH),
        "loss": Piece.full(total),
    }
    if x is not None:
        pieces[grad_name("x")] = _piece(x.grad, problem.inputs["x"].shape, INPUT_PLAN.get(op), dp=BATCH)
    for module_name, name in model.parameter_names().items():
        shape = problem.params[name].shape
        pieces[grad_name(name)] = _piece(grads[module_name], shape)
        pieces[param_name(name)] = _piece(params[module_name].detach(), shape)
    return pieces
