"""Tensor parallelism on torch.distributed: Megatron-style layers from the conjugate collectives.

Read beside ``reference/tp.py``: the same ops, with weights split over the ``tp`` mesh dim
(``torch.chunk`` semantics, so tp=3 gives uneven shards) and the batch split over ``dp``.

* column-parallel: W [out, in] split on out (dim 0); input through copy_to_group, whose backward
  all-reduces the input gradient; output gathered, or left sharded for a row-parallel layer.
* row-parallel: W split on in (dim 1); input split (or already sharded); partial products summed by
  reduce_from_group; the bias added once, after the sum.
* sequence parallel: activations split on the sequence dim; all-gather before the column layer,
  reduce-scatter after the row layer; the replicated norm weights and the last bias see only a
  sequence shard, so their gradients are all-reduced over tp (copy_to_group).
* vocab-parallel embedding and cross-entropy: each rank holds a vocab chunk; lookups masked to it.
* packed gate/up: W_gu [2f, h] with each rank holding its chunk of both halves.

Data parallel: each rank's loss is normalised by the global token count, so parameter gradients
are summed over dp and input gradients need no rescaling.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import events
from harness.config import Config, ConfigError, require_divides
from harness.context import RankContext
from harness.events import At
from harness.layout import Piece, Shard, chunk_bounds, empty_chunk_rule, take
from harness.names import grad_name, param_name
from reference.common import probe_loss
from reference.tp import LN_EPS, OPS, make_problem

from .collectives import (all_gather_dim, copy_to_group, gather_from_group, group_rank, group_size,
                          reduce_from_group, reduce_scatter_dim, split_to_group)
from .step import reduce_and_step

COL, ROW = Shard(0), Shard(1)  # weight [out, in]: column-parallel splits out, row-parallel splits in
MLP_PLAN = {"w1": COL, "b1": COL, "w2": ROW, "b2": None}
# How each op's parameters are split over tp (None: replicated).
PARAM_PLAN = {
    "colgather": {"w": COL, "b": COL},
    "colshard": {"w": COL, "b": COL},
    "rowsplit": {"w": ROW, "b": None},
    "rowshard": {"w": ROW, "b": None},
    "mlp": MLP_PLAN,
    "sp": {"ln_w": None, "ln_b": None, **MLP_PLAN},
    "embed": {"emb": COL},
    "xent": {"head": COL},
    "gateup": {"w_gu": Shard(0, packs=2), "w_down": ROW, "b_down": None},
}
# How the input x and the output are split over tp (the batch is always split over dp).
INPUT_PLAN = {"rowshard": Shard(2), "sp": Shard(1)}
OUTPUT_PLAN = {"colshard": Shard(2), "sp": Shard(1), "xent": Shard(2)}


BATCH = Shard(0)  # every tp cell splits the batch over dp


def local_batch(ctx: RankContext, t: torch.Tensor, tp_shard: Shard | None = None) -> torch.Tensor:
    """This rank's rows of the batch (over dp), then its shard over tp (None: all of it).

    Every implementation of the tp component cuts its inputs and probe this way."""
    return take(take(t, BATCH, ctx.degree("dp"), ctx.coord("dp")), tp_shard, ctx.degree("tp"), ctx.coord("tp"))


def validate(cfg: Config) -> None:
    """Rules of the tp component, checked before any rank runs."""
    op = cfg.switch("op")
    if op not in OPS:
        raise ConfigError(f"unknown tp op {op!r}; known: {', '.join(OPS)}")
    extra = [name for name, _ in cfg.mesh if name not in ("dp", "tp")]
    if extra:
        raise ConfigError(f"tp cells take mesh dims dp and tp, not {extra}")
    require_divides(cfg, "dp", "b", what="batch b")
    tp = cfg.degree("tp")
    for key in ("h", "f", "v", "s"):
        if not empty_chunk_rule(cfg.size(key), tp):
            raise ConfigError(
                f"tp={tp} leaves a rank an empty chunk of {key}={cfg.size(key)} under torch.chunk: "
                f"choose {key} with ceil({key}/tp)*(tp-1) < {key}"
            )


def column_parallel(x, w, b, tp):
    """Column-parallel linear: this rank's output features. Backward all-reduces dx."""
    return F.linear(copy_to_group(x, tp), w, b)


def row_parallel(x_shard, w, b, tp):
    """Row-parallel linear on an input sharded along features; bias added once, after the sum."""
    out = reduce_from_group(F.linear(x_shard, w), tp)
    return out if b is None else out + b


def vocab_parallel_embedding(ids, emb, tp, vocab: int):
    n, c = group_size(tp), group_rank(tp)
    lo, hi = chunk_bounds(vocab, n, c)
    mine = (ids >= lo) & (ids < hi)
    local = F.embedding((ids - lo).clamp(0, hi - lo - 1), emb) * mine.unsqueeze(-1).to(emb.dtype)
    return reduce_from_group(local, tp)


def vocab_parallel_cross_entropy(logits, labels, tp, vocab: int):
    """Per-token cross-entropy of logits split on vocab, computed in fp32 without gathering them."""
    n, c = group_size(tp), group_rank(tp)
    lo, hi = chunk_bounds(vocab, n, c)
    logits = logits.float()
    with torch.no_grad():  # the max only stabilises exp(); it cancels out of the loss and its gradient
        top = logits.max(dim=-1).values
        if n > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp)
    shifted = logits - top.unsqueeze(-1)
    sum_exp = reduce_from_group(shifted.exp().sum(dim=-1), tp)
    mine = (labels >= lo) & (labels < hi)
    picked = shifted.gather(-1, (labels - lo).clamp(0, hi - lo - 1).unsqueeze(-1)).squeeze(-1)
    target = reduce_from_group(picked * mine, tp)
    return sum_exp.log() - target


def forward(op: str, p: dict, x, inputs: dict, tp, cfg: Config):
    """The tensor-parallel layer on this rank's pieces; mirrors ``reference.tp.forward``."""
    if op in ("colgather", "colshard"):
        y = column_parallel(x, p["w"], p["b"], tp)
        return gather_from_group(y, -1, tp, cfg.size("f")) if op == "colgather" else y
    if op == "rowsplit":
        return row_parallel(split_to_group(x, -1, tp), p["w"], p["b"], tp)
    if op == "rowshard":
        return row_parallel(x, p["w"], p["b"], tp)
    if op == "mlp":
        # events name logical tensors: the batch is split over dp, the hidden features over tp
        (b, s, h), f = x.shape, cfg.size("f")
        b *= cfg.degree("dp")
        hidden = At((b, s, f), dp=BATCH, tp=Shard(2))
        pre = column_parallel(x, p["w1"], p["b1"], tp)
        events.op("fc1", {"x": (x, At((b, s, h), dp=BATCH))}, {"h": (pre, hidden)})
        a = F.gelu(pre)
        y = row_parallel(a, p["w2"], p["b2"], tp)
        events.op("fc2", {"a": (a, hidden)}, {"y": (y, At((b, s, h), dp=BATCH))})
        return y
    if op == "sp":
        # replicated weights applied to a sequence shard: partial gradients, all-reduced over tp
        ln_w, ln_b, b2 = (copy_to_group(p[k], tp) for k in ("ln_w", "ln_b", "b2"))
        normed = F.layer_norm(x, x.shape[-1:], ln_w, ln_b, LN_EPS)
        full = all_gather_dim(normed, 1, tp, cfg.size("s"))  # backward: reduce-scatter
        hidden = F.gelu(F.linear(full, p["w1"], p["b1"]))
        return x + reduce_scatter_dim(F.linear(hidden, p["w2"]), 1, tp) + b2
    if op == "embed":
        return vocab_parallel_embedding(inputs["ids"], p["emb"], tp, cfg.size("v"))
    if op == "xent":
        return F.linear(copy_to_group(x, tp), p["head"])
    if op == "gateup":
        gate, up = F.linear(copy_to_group(x, tp), p["w_gu"]).chunk(2, dim=-1)
        return row_parallel(F.silu(gate) * up, p["w_down"], p["b_down"], tp)
    raise ValueError(f"unknown tp op {op!r}")


def run(ctx: RankContext, cfg: Config) -> dict[str, Piece]:
    """One training step of the op on this rank; returns local pieces placed on the mesh."""
    op, problem = cfg.switch("op"), make_problem(cfg)
    tp = ctx.group("tp") if "tp" in ctx.layout.names else None
    dp = ctx.group("dp") if "dp" in ctx.layout.names else None
    n, c = ctx.degree("tp"), ctx.coord("tp")


    plan = PARAM_PLAN[op]
    params = {k: take(t, plan[k], n, c).requires_grad_() for k, t in problem.params.items()}
    inputs = {k: local_batch(ctx, t) for k, t in problem.inputs.items()}
    x = None
    if "x" in problem.inputs:
        x = local_batch(ctx, problem.inputs["x"], INPUT_PLAN.get(op)).requires_grad_()
    out = forward(op, params, x, inputs, tp, cfg)
    mesh_x = {"dp": BATCH} | ({"tp": INPUT_PLAN[op]} if op in INPUT_PLAN else {})
    mesh_out = {"dp": BATCH} | ({"tp": OUTPUT_PLAN[op]} if op in OUTPUT_PLAN else {})
    events.op("layer", {"x": (x, At(problem.inputs["x"].shape, **mesh_x))} if x is not None else {},
              {"out": (out, At(problem.out_shape, **mesh_out))})
    if op == "xent":
        per_token = vocab_parallel_cross_entropy(out, inputs["labels"], tp, cfg.size("v"))
        loss = per_token.sum() / problem.tokens
    else:
        probe = local_batch(ctx, problem.probe, OUTPUT_PLAN.get(op))
        loss = probe_loss(out, probe, problem.tokens)
        if op in OUTPUT_PLAN:  # each tp rank saw part of the output: its loss is partial
            loss = reduce_from_group(loss, tp)
    loss.backward()
    total = reduce_and_step(list(params.values()), loss, [dp])

    pieces = {
        "out": Piece.sharded(out, problem.out_shape, **mesh_out),
        "loss": Piece.full(total),
    }
    if x is not None:
        pieces[grad_name("x")] = Piece.sharded(x.grad, problem.inputs["x"].shape, **mesh_x)
    for k, t in params.items():
        placement = {"tp": plan[k]} if plan[k] is not None else {}
        pieces[grad_name(k)] = Piece.sharded(t.grad, problem.params[k].shape, **placement)
        pieces[param_name(k)] = Piece.sharded(t, problem.params[k].shape, **placement)
    return pieces
