"""Ring attention over the ``cp`` mesh dim, with heads split over ``tp`` and the batch over ``dp``.

Read beside ``reference/ring_attention.py``. Each cp rank keeps its queries and passes its key/value
block around the ring; after cp steps every query has met every key. Per step:

* forward: start sending the current K/V block to the next rank and receiving the next one
  (``batch_isend_irecv``), compute on the current block meanwhile, then merge its result into the
  running output with the online-softmax (log-sum-exp) update, in fp32;
* backward (explicit, in :class:`RingAttention`): K/V rotate the same way, and a dK/dV accumulator
  travels with each block, one more shift than K/V, so that it ends at the rank that owns the block.
  Every rank makes the same sends and receives at every step whatever it computes, so a rank that
  skips a masked block cannot leave the others waiting.

Layouts of the sequence over cp: ``contig`` (rank r holds chunk r) and ``zigzag`` (2·cp chunks, rank
r holds chunks r and 2·cp-1-r, which evens out causal work). Masks are built from the global token
positions each rank holds, and only the rows and columns of a block that can see each other are
computed: contig skips blocks from later ranks, zigzag computes half of each off-diagonal block.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from harness import events
from harness.config import Config, ConfigError, require_divides
from harness.context import RankContext
from harness.events import At
from harness.layout import Piece, Shard, shard_indices, take
from harness.names import grad_name, param_name
from reference.common import probe_loss
from reference.ring_attention import PARAMS, kv_heads, make_problem, merge_heads, split_heads

from .collectives import copy_to_group, group_rank, group_size, reduce_from_group
from .step import reduce_and_step

LAYOUTS = ("contig", "zigzag")
MASKS = ("causal", "full")


def validate(cfg: Config) -> None:
    extra = [name for name, _ in cfg.mesh if name not in ("dp", "cp", "tp")]
    if extra:
        raise ConfigError(f"ringattn cells take mesh dims dp, cp and tp, not {extra}")
    layout, mask, gqa = cfg.switch("layout"), cfg.switch("mask"), cfg.switch("gqa")
    if layout not in LAYOUTS or mask not in MASKS or gqa not in ("on", "off"):
        raise ConfigError(f"ringattn switches: layout in {LAYOUTS}, mask in {MASKS}, gqa in (on, off); "
                          f"got layout={layout} mask={mask} gqa={gqa}")
    cp, s = cfg.degree("cp"), cfg.size("s")
    chunks = 2 * cp if layout == "zigzag" else cp
    if s % chunks:
        what = f"2·cp={chunks} zigzag chunks" if layout == "zigzag" else f"cp={cp} chunks"
        raise ConfigError(f"sequence s={s} does not split into {what}: choose s a multiple of {chunks}")
    hq = cfg.size("q")
    if gqa == "on" and hq % 2:
        raise ConfigError(f"gqa_on shares each K/V head between 2 query heads: query heads q={hq} must be even")
    require_divides(cfg, "tp", "q", what="query heads q")
    if kv_heads(cfg) % cfg.degree("tp"):
        raise ConfigError(f"tp={cfg.degree('tp')} does not divide the K/V heads ({kv_heads(cfg)}): "
                          f"choose tp dividing q/2 with gqa_on, or gqa_off")
    require_divides(cfg, "dp", "b", what="batch b")


def sequence_shard(layout: str, dim: int) -> Shard:
    return Shard(dim, zigzag=layout == "zigzag")


def positions(layout: str, s: int, n: int, rank: int) -> torch.Tensor:
    """Global positions of the tokens that cp rank ``rank`` of ``n`` holds."""
    return shard_indices(torch.arange(s), sequence_shard(layout, 0), n, rank)


def _visible(pos_q: torch.Tensor, pos_k: torch.Tensor, causal: bool) -> torch.Tensor:
    if not causal:
        return torch.ones(len(pos_q), len(pos_k), dtype=torch.bool)
    return pos_k.unsqueeze(0) <= pos_q.unsqueeze(1)


def _shift(t: torch.Tensor, group) -> tuple[torch.Tensor, list]:
    """Start sending ``t`` to the next rank of the ring and receiving the previous rank's."""
    n, r = group_size(group), group_rank(group)
    buf = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, (r + 1) % n), group),
           dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, (r - 1) % n), group)]
    return buf, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _block(q, k, v, visible):
    """Rows, columns, mask and scores of the part of a block that is not fully masked (None: skip)."""
    rows = visible.any(1).nonzero().squeeze(1)
    if rows.numel() == 0:
        return None
    cols = visible.any(0).nonzero().squeeze(1)
    group = q.shape[1] // k.shape[1]
    ks = k[:, :, cols].repeat_interleave(group, dim=1)
    vs = v[:, :, cols].repeat_interleave(group, dim=1)
    qs = q[:, :, rows]
    scores = (qs @ ks.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible[rows][:, cols], float("-inf"))
    return rows, cols, qs, ks, vs, scores


def _merge(out, lse, rows, block_out, block_lse) -> None:
    """Online softmax: fold a block's normalised output and log-sum-exp into the running ones."""
    old = lse[..., rows]
    new = torch.logaddexp(old, block_lse)
    out[:, :, rows] = out[:, :, rows] * torch.exp(old - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1)
    lse[..., rows] = new


class RingAttention(torch.autograd.Function):
    """Forward: ring of K/V blocks with an online-softmax merge. Backward: ring of K/V and of dK/dV."""

    @staticmethod
    def forward(ctx, q, k, v, group, pos, causal: bool, at: At | None):
        n, me = group_size(group), group_rank(group)
        qf = q.float()
        out = torch.zeros(qf.shape, dtype=torch.float32)
        lse = torch.full(qf.shape[:-1], float("-inf"))
        kv = torch.stack([k, v])
        for step in range(n):
            if step < n - 1:
                incoming, works = _shift(kv, group)  # overlaps with this block's compute
            src = (me - step) % n
            part = _block(qf, kv[0].float(), kv[1].float(), _visible(pos[me], pos[src], causal))
            before = out.clone() if events.active() else None
            if part is not None:
                rows, _, _, _, vs, scores = part
                block_lse = scores.logsumexp(dim=-1)
                _merge(out, lse, rows, torch.exp(scores - block_lse.unsqueeze(-1)) @ vs, block_lse)
            events.record("ring", {"before": (before, at)}, {"after": (out, at)}, ring_step=step)
            if step < n - 1:
                _wait(works)
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.pos, ctx.causal, ctx.n, ctx.me = group, pos, causal, n, me
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, pos, causal, n, me = ctx.group, ctx.pos, ctx.causal, ctx.n, ctx.me
        qf, do = q.float(), dout.float()
        delta = (do * out).sum(-1)  # D_i = dO_i . O_i
        dq = torch.zeros(qf.shape)
        kv = torch.stack([k, v])
        dkv = torch.zeros((2, *k.shape))  # travels with the block it belongs to
        hkv = k.shape[1]
        for step in range(n):
            if step < n - 1:
                incoming, works = _shift(kv, group)
            src = (me - step) % n
            part = _block(qf, kv[0].float(), kv[1].float(), _visible(pos[me], pos[src], causal))
            if part is not None:
                rows, cols, qs, ks, vs, scores = part
                p = torch.exp(scores - lse[..., rows].unsqueeze(-1))
                d_o = do[:, :, rows]
                ds = p * (d_o @ vs.transpose(-1, -2) - delta[..., rows].unsqueeze(-1)) * q.shape[-1] ** -0.5
                dq[:, :, rows] += ds @ ks
                b, hq, c, d = ks.shape  # fold GQA groups back onto their K/V head
                dkv[0][:, :, cols] += (ds.transpose(-1, -2) @ qs).view(b, hkv, hq // hkv, c, d).sum(2)
                dkv[1][:, :, cols] += (p.transpose(-1, -2) @ d_o).view(b, hkv, hq // hkv, c, d).sum(2)
            if n > 1:  # pass the accumulator on; the last shift lands it on the block's owner
                dkv, dworks = _shift(dkv, group)
                _wait(dworks)
            if step < n - 1:
                _wait(works)
                kv = incoming
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(q, k, v, group, pos: list[torch.Tensor], causal: bool, at: At | None = None):
    """Attention of local queries over the keys of every rank in ``group``: (output, log-sum-exp).
    ``at``: where the local queries' output sits in the logical one, for the ring-step events."""
    return RingAttention.apply(q, k, v, group, pos, causal, at)


def run(ctx: RankContext, cfg: Config) -> dict[str, Piece]:
    problem = make_problem(cfg)
    names = ctx.layout.names
    cp, tp, dp = (ctx.group(d) if d in names else None for d in ("cp", "tp", "dp"))
    layout, causal = cfg.switch("layout"), cfg.switch("mask") == "causal"
    n_cp, n_tp = ctx.degree("cp"), ctx.degree("tp")
    hq, hkv = cfg.size("q") // n_tp, kv_heads(cfg) // n_tp  # heads on this rank
    batch, seq, heads = Shard(0), sequence_shard(layout, 1), Shard(1)
    plan = {"wq": Shard(0), "wk": Shard(0), "wv": Shard(0), "wo": Shard(1)}  # heads split over tp

    def local(t):  # this rank's batch rows, then its sequence shard
        return take(take(t, batch, ctx.degree("dp"), ctx.coord("dp")), seq, n_cp, ctx.coord("cp"))

    params = {k: take(problem.params[k], plan[k], n_tp, ctx.coord("tp")).requires_grad_() for k in PARAMS}
    x = local(problem.x).requires_grad_()
    xin = copy_to_group(x, tp)  # each tp rank's heads contribute part of dx
    q, k, v = (split_heads(xin @ params[w].T, h) for w, h in (("wq", hq), ("wk", hkv), ("wv", hkv)))
    for t in (q, k, v):
        t.retain_grad()
    pos = [positions(layout, cfg.size("s"), n_cp, r) for r in range(n_cp)]
    b, s = problem.x.shape[:2]
    d = cfg.size("d")
    by_head = dict(dp=batch, tp=heads, cp=sequence_shard(layout, 2))
    queries, keys = At((b, cfg.size("q"), s, d), **by_head), At((b, kv_heads(cfg), s, d), **by_head)
    attn, lse = ring_attention(q, k, v, cp, pos, causal, queries)
    events.op("attention", {"q": (q, queries), "k": (k, keys), "v": (v, keys)}, {"attn": (attn, queries)})
    out = reduce_from_group(merge_heads(attn) @ params["wo"].T, tp)
    # each cp rank holds some tokens: its loss is partial, and so are its parameter gradients
    loss = probe_loss(out, local(problem.probe), problem.tokens)
    loss.backward()
    total = reduce_and_step(list(params.values()), loss, [cp, dp])

    pieces = {
        "out": Piece.sharded(out, problem.x.shape, dp=batch, cp=seq),
        "loss": Piece.full(total),
        "attn": Piece.sharded(attn, (b, cfg.size("q"), s, d), **by_head),
        "lse": Piece.sharded(lse, (b, cfg.size("q"), s), **by_head),
        grad_name("x"): Piece.sharded(x.grad, problem.x.shape, dp=batch, cp=seq),
        grad_name("q"): Piece.sharded(q.grad, (b, cfg.size("q"), s, d), **by_head),
        grad_name("k"): Piece.sharded(k.grad, (b, kv_heads(cfg), s, d), **by_head),
        grad_name("v"): Piece.sharded(v.grad, (b, kv_heads(cfg), s, d), **by_head),
    }
    for name, t in params.items():
        pieces[grad_name(name)] = Piece.sharded(t.grad, problem.params[name].shape, tp=plan[name])
        pieces[param_name(name)] = Piece.sharded(t, problem.params[name].shape, tp=plan[name])
    return pieces
