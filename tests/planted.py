"""Implementations with planted bugs, registered by tests (never flags in the production code).

Each wraps a real implementation and breaks one thing for the duration of its own call only: the
rank processes are shared with other tests' cells. The FSDP and checkpoint plants import their
module when called: a project whose conftest registers these plants imports this module in its
pytest process (to check the paths resolve) and in its zygote, which then need not import DTensor.
"""
import contextlib
import os

import torch

import harness.parallel.moe as moe
import harness.parallel.pipeline as pipeline
import harness.parallel.ring_attention as ring
import harness.parallel.tp as tp


@contextlib.contextmanager
def patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def tp_grads_over_tp(ctx, cfg):
    """Tensor parallel with every gradient divided by tp before the step (a scaling bug)."""
    real = tp.reduce_and_step

    def scaled(params, loss, groups):
        for p in params:
            p.grad /= ctx.degree("tp")
        return real(params, loss, groups)

    with patched(tp, "reduce_and_step", scaled):
        return tp.run(ctx, cfg)


def ring_never_rotates(ctx, cfg):
    """Ring attention whose K/V (and dK/dV) never move: every step sees the rank's own block.
    Needs cp > 1 to show."""
    with patched(ring, "_shift", lambda t, group: (t.clone(), [])):
        return ring.run(ctx, cfg)


def ring_merge_without_rescale(ctx, cfg):
    """Ring attention whose online-softmax merge forgets to rescale the running output by
    exp(old lse - new lse): right for a row's first block only. Needs cp > 1 to show."""
    def merge(out, lse, rows, block_out, block_lse):
        new = torch.logaddexp(lse[..., rows], block_lse)
        out[:, :, rows] = out[:, :, rows] + block_out * torch.exp(block_lse - new).unsqueeze(-1)
        lse[..., rows] = new

    with patched(ring, "_merge", merge):
        return ring.run(ctx, cfg)


def ring_zigzag_mask_as_contig(ctx, cfg):
    """Ring attention whose causal mask takes the tokens' positions as if the layout were contiguous:
    wrong for the zigzag layout's second chunk. Needs cp > 1, causal and zigzag together."""
    real = ring.positions
    with patched(ring, "positions", lambda layout, s, n, rank: real("contig", s, n, rank)):
        return ring.run(ctx, cfg)


def tp_noisy(ctx, cfg):
    """Tensor parallel whose output carries fresh random noise on every run: nondeterministic."""
    pieces = tp.run(ctx, cfg)
    noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    out = pieces["out"]
    out.tensor = out.tensor + torch.randn(out.tensor.shape, generator=noise).to(out.tensor.dtype)
    return pieces


def tp_column_backward_unreduced(ctx, cfg):
    """Column-parallel linear without copy_to_group: the forward is unchanged, but the input
    gradient is each tp rank's partial sum, never all-reduced. Bisect should place it at ``bwd fc1``."""
    with patched(tp, "column_parallel", lambda x, w, b, group: torch.nn.functional.linear(x, w, b)):
        return tp.run(ctx, cfg)


def pp_microbatch_loss_doubled(ctx, cfg):
    """Pipeline whose last stage doubles the loss of microbatch 1 (a per-microbatch scaling bug):
    bisect should name microbatch 1."""
    real = pipeline.Stages.forward

    def forward(self, s, mb, x, p, labels):
        out = real(self, s, mb, x, p, labels)
        return out * 2 if s == self.last and mb == 1 else out

    with patched(pipeline.Stages, "forward", forward):
        return pipeline.run(ctx, cfg)


def moe_expert_off_by_one(ctx, cfg):
    """MoE whose second local expert runs with the first one's weights (an off-by-one in the local
    expert index): bisect should name that expert."""
    def run_experts(tokens, counts, p, etp):
        rows = moe.copy_to_group(tokens, etp)
        outs = [moe.swiglu(chunk, p["w_gate"][max(i - 1, 0)], p["w_up"][max(i - 1, 0)], p["w_down"][max(i - 1, 0)])
                for i, chunk in enumerate(rows.split(counts))]
        return moe.reduce_from_group(torch.cat(outs + [tokens.new_zeros(0, tokens.shape[1])]), etp)

    with patched(moe, "run_experts", run_experts):
        return moe.run(ctx, cfg)


def fsdp_gather_swaps_shards(ctx, cfg):
    """FSDP whose all-gather of W1 puts the first two ranks' shards in each other's place (a group's
    rank order mixed up): needs a shard group of 2 or more; bisect should name the gathered weights
    of the first step's first layer."""
    import harness.parallel.fsdp as fsdp  # here, not above: it imports DTensor (and sympy), 0.6 s

    real = fsdp.FSDPParam.gather

    def gather(self):
        full = real(self)
        n = fsdp.group_size(self.groups.shard)
        if self.name != "w1" or n < 2:
            return full
        first, second = full.chunk(n)[:2]
        return torch.cat([second, first, *full.chunk(n)[2:]]) if first.shape == second.shape else full

    with patched(fsdp.FSDPParam, "gather", gather):
        return fsdp.run(ctx, cfg)


def ckpt_load_rotates_rows(ctx, cfg):
    """Checkpoint whose load puts each local shard of W1 one row off (a resharding offset bug):
    bisect should name the load."""
    import harness.parallel.checkpoint as checkpoint  # here, not above: it imports DCP and DTensor, 0.8 s

    real = checkpoint.Side.load

    def load(self, path):
        real(self, path)
        with torch.no_grad():
            for name, t in self.tensors().items():
                local = checkpoint._local(t)
                if name == "param/w1" and local.shape[0] > 1:
                    local.copy_(local.roll(1, 0))

    with patched(checkpoint.Side, "load", load):
        return checkpoint.run(ctx, cfg)


def tp_sp_replicated_grads_unreduced(ctx, cfg):
    """Sequence parallel whose replicated weights (the layer norm's, the second bias: (h,) vectors
    applied to each rank's sequence shard) skip copy_to_group: their gradients stay each tp rank's
    partial sum, never all-reduced; the forward and every activation gradient are right."""
    real = tp.copy_to_group
    with patched(tp, "copy_to_group", lambda t, group: t if t.dim() == 1 else real(t, group)):
        return tp.run(ctx, cfg)
