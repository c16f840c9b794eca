"""Planted bugs that the fixed matrix never meets and exploration does (tests/test_explore.py).

Each wraps a real implementation and breaks one thing for the duration of its own call only (the
rank processes are shared with other cells), through ``tests.planted.patched``. Each docstring says
where the bug shows and why no matrix cell has that shape.
"""
import torch

import harness.parallel.moe as moe
import harness.parallel.pipeline as pipeline
import harness.parallel.pipeline_schedule as schedule
import harness.parallel.ring_attention as ring
import harness.parallel.tp as tp
from harness.layout import Shard, chunk_bounds
from tests.planted import patched


def tp_row_offsets_array_split(ctx, cfg):
    """Row-parallel weights (split on their input features f) cut at ``numpy.array_split`` offsets,
    the remainder spread over the first ranks, while the activations they meet follow torch.chunk.

    The two agree whenever f % tp is 0 or tp-1, so at tp=2 always, and at tp=3 only the split where
    the last shard is one short; with f ≡ 1 (mod 3) (the last shard two short: f=7 as 3,3,1) rank 2
    multiplies the wrong rows. The matrix's f=32 is 32 % 3 = 2 at tp=3 and even at tp 2, 4 and 8.
    Under ``op=sp`` the sequence-parallel input and output are cut on dim 1 too, so the same offsets
    misplace the sequence s wherever s % tp is neither 0 nor tp-1.
    """
    real = tp.take

    def take(t, shard, n, c):
        if shard != Shard(1) or n == 1:
            return real(t, shard, n, c)
        size = t.shape[1]
        lo = c * (size // n) + min(c, size % n)  # array_split's offset
        length = chunk_bounds(size, n, c)[1] - chunk_bounds(size, n, c)[0]  # torch.chunk's length
        return t.narrow(1, min(lo, size - length), length).clone()

    with patched(tp, "take", take):
        return tp.run(ctx, cfg)


def moe_first_rank_idle_counts_aux_twice(ctx, cfg):
    """Dropless MoE whose *first* ep rank, when routing sends its experts no token, takes an idle
    path that adds its share of the aux loss a second time.

    In the matrix's dropless cells the starved ranks are never the first: route_skew starves the
    last half of the experts, route_one sends every first choice to expert 0 (on ep rank 0); the
    first rank of an ep group goes without tokens only through capacity drops (dp=4 ep2 route_one
    cap_100), another path. Random routing over few tokens starves ep rank 0 at some seeds, which
    only a drawn seed meets; so does route_skew over few tokens at ep >= 3 (ep rank 0 then holds a
    part of the first half only: exploration found ep=7 e=14 k=1 t=14).
    """
    starved = []
    real_plan, real_moe = moe.plan_exchange, moe.moe
    dropless = cfg.switch("cap") == "none"

    def plan_exchange(route, kept, experts, group):
        plan = real_plan(route, kept, experts, group)
        starved.append(dropless and sum(plan.recv) == 0 and moe.group_rank(group) == 0)
        return plan

    def layer(*args, **kwargs):
        out, aux, route, dropped = real_moe(*args, **kwargs)
        return out, aux * 2 if starved and starved[-1] else aux, route, dropped

    with patched(moe, "plan_exchange", plan_exchange), patched(moe, "moe", layer):
        return moe.run(ctx, cfg)


def pp_interleaved_odd_rounds_last_twice(ctx, cfg):
    """Interleaved 1F1B that, with an odd microbatch count split into more than one round, counts the
    last microbatch's loss twice (its rounds are paired up, and the odd one out pairs with itself).

    The matrix's odd counts on the interleaved schedule (m = pp+1 or m = pp = 3) all run in one
    round (rounds = max(1, m // pp)); an odd m of several rounds (pp=1 m=3, pp=3 m=9) is only drawn.
    """
    real = pipeline.Stages.forward
    m, pp = cfg.size("m"), cfg.degree("pp")
    broken = cfg.switch("sched") == "interleaved" and m % 2 == 1 and schedule.rounds(pp, m) > 1

    def forward(self, s, mb, x, p, labels):
        out = real(self, s, mb, x, p, labels)
        return out * 2 if broken and s == self.last and mb == m - 1 else out

    with patched(pipeline.Stages, "forward", forward):
        return pipeline.run(ctx, cfg)


def ring_odd_chunk_diagonal_halves(ctx, cfg):
    """Ring attention whose causal diagonal block, on a ring of two or more ranks, is computed in
    two halves split at c // 2 once a rank's chunk has c >= 5 tokens: with c odd the middle row
    loses its own key.

    The component's rules reject a sequence the ring cannot split into equal chunks, so this is the
    nearest honest case: s splits over cp, but a chunk does not split in two (s/cp odd, contig
    layout). The matrix's contig chunks are 24, 12, 8, 6, 48, 16 and 3 (cp=8, s=24): none odd and >= 5.
    """
    real = ring._visible
    split = cfg.degree("cp") > 1

    def visible(pos_q, pos_k, causal):
        mask = real(pos_q, pos_k, causal)
        c = len(pos_q)
        if split and causal and c >= 5 and c % 2 and torch.equal(pos_q, pos_k):
            mask = mask.clone()
            mask[c // 2, c // 2] = False
        return mask

    with patched(ring, "_visible", visible):
        return ring.run(ctx, cfg)
