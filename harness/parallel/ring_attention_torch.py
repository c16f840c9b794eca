"""Context parallelism through PyTorch's own ``context_parallel`` (experimental DTensor attention).

The same layer as ``harness/parallel/ring_attention.py``, with torch sharding the sequence (``contig``, or
its head-tail load balancer, which is our ``zigzag``) and dispatching SDPA to its ring attention.
SDPA does not return the log-sum-exp, so this implementation omits ``lse`` (see OMITS).

It runs where torch supports it: CUDA. On CPU, context_parallel has no sharding strategy for the
CPU SDPA kernel, and the cells skip with that reason; a GPU machine runs them (--backend nccl).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.config import Config
from harness.context import RankContext
from harness.layout import Piece, Shard, take
from harness.names import grad_name, param_name
from reference.common import probe_loss
from reference.ring_attention import PARAMS, kv_heads, make_problem, merge_heads, split_heads

from .step import reduce_and_step
from .ring_attention import sequence_shard

OMITS = ("lse",)


def skip_reason(cfg: Config) -> str | None:
    if not torch.cuda.is_available():
        return ("torch context_parallel runs on CUDA only: on CPU it has no sharding strategy for the "
                "CPU SDPA kernel (aten._scaled_dot_product_flash_attention_for_cpu)")
    if cfg.degree("tp") > 1:
        return "heads split over tp are not wired into the context_parallel implementation"
    return None


def run(ctx: RankContext, cfg: Config) -> dict[str, Piece]:
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    problem, dev = make_problem(cfg), ctx.device
    cp = ctx.group("cp") if "cp" in ctx.layout.names else None
    dp = ctx.group("dp") if "dp" in ctx.layout.names else None
    layout, causal = cfg.switch("layout"), cfg.switch("mask") == "causal"
    hq, hkv = cfg.size("q"), kv_heads(cfg)
    batch, seq = Shard(0), sequence_shard(layout, 1)
    _cp_options.enable_load_balance = layout == "zigzag"  # torch's head-tail balancer is zigzag

    def local_batch(t):
        return take(t, batch, ctx.degree("dp"), ctx.coord("dp")).to(dev)

    params = {k: problem.params[k].to(dev).requires_grad_() for k in PARAMS}
    x, probe = local_batch(problem.x), local_batch(problem.probe)
    with context_parallel(ctx.device_mesh["cp"], buffers=[x, probe], buffer_seq_dims=[1, 1],
                          no_restore_buffers={x, probe}):
        xs = x.detach().requires_grad_()  # this rank's sequence shard, as torch cut it
        q, k, v = (split_heads(xs @ params[w].T, h) for w, h in (("wq", hq), ("wk", hkv), ("wv", hkv)))
        for t in (q, k, v):
            t.retain_grad()
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != hq)
        out = merge_heads(attn) @ params["wo"].T
        loss = probe_loss(out, probe, problem.tokens)
        loss.backward()
    total = reduce_and_step(list(params.values()), loss, [cp, dp])

    b, s = problem.x.shape[:2]
    d = cfg.size("d")
    by_head = dict(dp=batch, cp=sequence_shard(layout, 2))
    cpu = lambda t: t.detach().cpu()  # noqa: E731
    pieces = {
        "out": Piece.sharded(cpu(out), problem.x.shape, dp=batch, cp=seq),
        "loss": Piece.full(cpu(total)),
        "attn": Piece.sharded(cpu(attn), (b, hq, s, d), **by_head),
        grad_name("x"): Piece.sharded(cpu(xs.grad), problem.x.shape, dp=batch, cp=seq),
        grad_name("q"): Piece.sharded(cpu(q.grad), (b, hq, s, d), **by_head),
        grad_name("k"): Piece.sharded(cpu(k.grad), (b, hkv, s, d), **by_head),
        grad_name("v"): Piece.sharded(cpu(v.grad), (b, hkv, s, d), **by_head),
    }
    for name, t in params.items():
        pieces[grad_name(name)] = Piece.full(cpu(t.grad))
        pieces[param_name(name)] = Piece.full(cpu(t))
    return pieces
