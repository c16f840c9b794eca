"""Planted bugs in the composed model (harness/examples/composed/), one component broken in one block each,
registered as implementations of the model ``composedbug`` (tests/test_composed_bugs.py): never
flags in production code. Each is the composed model's own ``parallelize`` with one module of the
result patched on this rank's instance (or, for the ring, its mask function swapped while that
block's ring runs, and restored):

* ``notpar``: block 1's attention output projection without the tp all-reduce of its row-parallel
  partial sums;
* ``nounperm``: block 0's MoE combine puts the experts' results back in dispatch (expert) order,
  without the un-permutation to the tokens' slots;
* ``nodpsum``: the pipeline's second stage (block 1) skips the data-parallel gradient sum (its FSDP
  unit's reduce-scatter keeps this rank's own rows of its own gradient);
* ``ringoff``: block 0's ring attention with its causal mask one step off (each query also sees the
  next token).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import harness.parallel.moe as par_moe
import harness.parallel.ring_attention as par_ring
from harness.events import paused
from harness.model import ModelCase
from harness.examples.composed.case import CASE, supports
from harness.examples.composed.model import HEADS
from harness.examples.composed.parallel import ParallelAttention, parallelize as composed_parallelize
from harness.parallel.collectives import group_size
from harness.parallel.tp import column_parallel
from reference.ring_attention import merge_heads, split_heads
from tests.planted import patched


def _blocks(made):
    roots = made.modules if not isinstance(made, torch.nn.Module) else [made]
    return {name: block for root in roots for name, block in root.layers.items()}


def _with_attention(model, meshes, block: str, forward):
    """The composed model's own parallelize, with block ``block``'s attention running ``forward``
    on this rank (when this rank's stage holds that block)."""
    made = composed_parallelize(model, meshes, manual=False)
    held = _blocks(made).get(block)
    if held is not None:
        held.attention.forward = forward.__get__(held.attention, ParallelAttention)
    return made


# ---- tp: the row-parallel all-reduce removed in block 1's attention -------------------------------
def _attention_without_all_reduce(self, x):
    g = self.groups
    heads = HEADS // group_size(g.tp)
    q, k, v = (split_heads(column_parallel(x, self.get[w](), None, g.tp), heads) for w in ("wq", "wk", "wv"))
    with paused():
        out, _ = par_ring.ring_attention(q, k, v, g.cp, self.pos, True)
    return F.linear(merge_heads(out), self.get["wo"]())  # the partial sum of this rank's heads only


def no_tp_all_reduce(model, meshes):
    return _with_attention(model, meshes, "1", _attention_without_all_reduce)


# ---- moe: the combine without its un-permutation --------------------------------------------------
class CombineInDispatchOrder(par_moe.Combine):
    @staticmethod
    def forward(ctx, y, plan):
        ctx.plan = plan
        home = par_moe.all_to_all_rows(par_moe._from_local(y, plan), plan.send, plan.recv, plan.group)
        slots = y.new_zeros(plan.slots, y.shape[1])
        slots[: home.shape[0]] = home  # the bug: no slots[plan.order] = home
        return slots.view(-1, plan.k, y.shape[1])


def no_unpermute(model, meshes):
    made = composed_parallelize(model, meshes, manual=False)
    block = _blocks(made).get("0")
    if block is not None:
        moe = block.moe
        forward = moe.forward

        def combine_in_dispatch_order(x):
            with patched(par_moe, "Combine", CombineInDispatchOrder):
                return forward(x)

        moe.forward = combine_in_dispatch_order
    return made


# ---- pp x dp: the second stage's data-parallel gradient sum skipped ---------------------------------
def no_dp_sum(model, meshes):
    made = composed_parallelize(model, meshes, manual=False)
    block = _blocks(made).get("1")
    if block is not None:  # the second stage (pp=2) or the whole model
        for row in block.unit.flat.values():
            fp = row.param

            def reduce(grad_full, fp=fp):
                from harness.parallel.collectives import group_rank

                c = group_rank(fp.groups.shard)
                return grad_full.float()[c:c + 1] / fp.groups.world  # no reduce-scatter, no rep sum
            fp.reduce = reduce
    return made


# ---- cp: the ring's causal mask one step off ---------------------------------------------------------
def _leaky_visible(pos_q, pos_k, causal):
    if not causal:
        return torch.ones(len(pos_q), len(pos_k), dtype=torch.bool)
    return pos_k.unsqueeze(0) <= pos_q.unsqueeze(1) + 1  # the bug: + 1


class LeakyRing(par_ring.RingAttention):
    @staticmethod
    def forward(ctx, *args):
        with patched(par_ring, "_visible", _leaky_visible):
            return par_ring.RingAttention.forward(ctx, *args)

    @staticmethod
    def backward(ctx, *grads):
        with patched(par_ring, "_visible", _leaky_visible):
            return par_ring.RingAttention.backward(ctx, *grads)


def _attention_leaky(self, x):
    g = self.groups
    heads = HEADS // group_size(g.tp)
    q, k, v = (split_heads(column_parallel(x, self.get[w](), None, g.tp), heads) for w in ("wq", "wk", "wv"))
    with paused():
        out, _ = LeakyRing.apply(q, k, v, g.cp, self.pos, True, None)
    from harness.parallel.tp import row_parallel

    return row_parallel(merge_heads(out), self.get["wo"](), None, g.tp)


def ring_off_by_one(model, meshes):
    return _with_attention(model, meshes, "0", _attention_leaky)


BUGS = ModelCase(build=CASE.build, batch=CASE.batch, loss=CASE.loss, steps=CASE.steps,
                 seq_dim=1, supports={k: supports for k in ("notpar", "nounperm", "nodpsum", "ringoff")},
                 parallelize={"notpar": no_tp_all_reduce, "nounperm": no_unpermute, "nodpsum": no_dp_sum,
                              "ringoff": ring_off_by_one})
