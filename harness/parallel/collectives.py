"""Collectives as autograd functions, each stated with its conjugate.

    forward               backward
    identity          <-> all-reduce       copy_to_group / reduce_from_group
    split (own chunk) <-> all-gather       split_to_group / gather_from_group
    all-gather        <-> reduce-scatter   all_gather_dim / reduce_scatter_dim
    all-to-all        <-> reverse all-to-all  all_to_all_rows (the raw exchange; MoE's dispatch and
                                              combine in harness/parallel/moe.py are its autograd pair)

Chunks follow ``torch.chunk`` (harness.layout.chunk_bounds): uneven sizes are padded to the largest
chunk for the wire, because gloo's all-gather and reduce-scatter need equal sizes.
A group of one rank (or ``None``) makes every function the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from harness.layout import chunk_bounds


def group_size(group) -> int:
    """Ranks in ``group``; a missing mesh dim (None) counts as one."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in ``group`` (0 for a missing mesh dim)."""
    return 0 if group is None else dist.get_rank(group)


def _sizes(full: int, n: int) -> list[int]:
    return [hi - lo for lo, hi in (chunk_bounds(full, n, i) for i in range(n))]


def _pad(x: torch.Tensor, dim: int, to: int) -> torch.Tensor:
    if x.shape[dim] == to:
        return x.contiguous()
    shape = list(x.shape)
    shape[dim] = to - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim).contiguous()


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n, r = group_size(group), group_rank(group)
    lo, hi = chunk_bounds(x.shape[dim], n, r)
    return x.narrow(dim, lo, hi - lo).contiguous()


def _gather(x: torch.Tensor, dim: int, group, full: int) -> torch.Tensor:
    n = group_size(group)
    sizes = _sizes(full, n)
    parts = [torch.empty_like(_pad(x, dim, max(sizes))) for _ in range(n)]
    dist.all_gather(parts, _pad(x, dim, max(sizes)), group=group)
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    r = group_rank(group)
    return reduce_scatter_padded(x, dim, group).narrow(dim, 0, _sizes(x.shape[dim], group_size(group))[r])


def reduce_scatter_padded(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """No autograd: sum ``x`` over ``group`` and keep this rank's ``torch.chunk`` chunk of ``dim``,
    padded with zeros to the largest chunk (FSDP keeps its gradient shards padded)."""
    n = group_size(group)
    sizes = _sizes(x.shape[dim], n)
    chunks = [_pad(x.narrow(dim, lo, s), dim, max(sizes)) for lo, s in zip(
        [chunk_bounds(x.shape[dim], n, i)[0] for i in range(n)], sizes)]
    # one stacked tensor, not a list of chunks: the same sum, and gloo's list form costs about n
    # all-reduces (4.8x the tensor form's time on 8 ranks of this 2-core machine, 3x on 4)
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter_tensor(out.unsqueeze(0), torch.stack(chunks), group=group)
    return out


def all_gather_chunks(x: torch.Tensor, dim: int, group, full: int) -> torch.Tensor:
    """No autograd: the full ``dim`` of ``full`` items from every rank's chunk (padded or not)."""
    return _gather(x, dim, group, full)


class _CopyToGroup(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (each rank holds a partial gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward: all-reduce of partial results. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SplitToGroup(torch.autograd.Function):
    """Forward: keep this rank's chunk of ``dim``. Backward: all-gather the chunks."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.full = dim, group, x.shape[dim]
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group, ctx.full), None, None


class _GatherFromGroup(torch.autograd.Function):
    """Forward: all-gather chunks along ``dim``. Backward: keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x, dim, group, full):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group, full)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _AllGatherDim(torch.autograd.Function):
    """Forward: all-gather along ``dim`` (sequence parallel). Backward: reduce-scatter along ``dim``."""

    @staticmethod
    def forward(ctx, x, dim, group, full):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group, full)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterDim(torch.autograd.Function):
    """Forward: reduce-scatter along ``dim``. Backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.full = dim, group, x.shape[dim]
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group, ctx.full), None, None


def copy_to_group(x, group):
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x, group):
    return x if group_size(group) == 1 else _ReduceFromGroup.apply(x, group)


def split_to_group(x, dim: int, group):
    return x if group_size(group) == 1 else _SplitToGroup.apply(x, dim % x.dim(), group)


def gather_from_group(x, dim: int, group, full: int):
    return x if group_size(group) == 1 else _GatherFromGroup.apply(x, dim % x.dim(), group, full)


def all_gather_dim(x, dim: int, group, full: int):
    return x if group_size(group) == 1 else _AllGatherDim.apply(x, dim % x.dim(), group, full)


def reduce_scatter_dim(x, dim: int, group):
    return x if group_size(group) == 1 else _ReduceScatterDim.apply(x, dim % x.dim(), group)


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """No autograd: send ``in_splits[i]`` rows of ``x`` (in order) to rank ``i`` of ``group``; return the
    rows received, ``out_splits[i]`` from rank ``i``, in rank order. Uneven and empty splits are fine.
    The reverse exchange (splits swapped) is its conjugate."""
    if group_size(group) == 1:
        return x.clone()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
    return out


def all_reduce_(tensors, group) -> None:
    """In place, no autograd: sum tensors over a group (data-parallel gradients)."""
    if group_size(group) == 1:
        return
    for t in tensors:
        dist.all_reduce(t, group=group)
