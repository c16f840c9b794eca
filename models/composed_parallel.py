"""The parallel side of ``models/composed.py``: its modules rebuilt from ``parallel/``, holding this
rank's shards under the reference's parameter names (see that module's docstring for the layout)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard

from harness.layout import Shard, chunk_bounds, take
from harness.model import Pipelined
from parallel import moe as par_moe
from parallel import pipeline_schedule as ps
from parallel.collectives import copy_to_group, group_rank, group_size, reduce_from_group
from parallel.fsdp import DPGroups, FSDPParam, GatherParam
from parallel.pipeline import execute
from parallel.ring_attention import positions, ring_attention
from parallel.tp import column_parallel, row_parallel, vocab_parallel_embedding
from reference.pipeline import GRAD_SCALE
from reference.ring_attention import merge_heads, split_heads

from . import composed as ref
from .composed import DIM, EPS, HEAD_DIM, HEADS, MICROBATCHES, MOE, SEQ, VOCAB, VocabLogits


# ---- the groups ---------------------------------------------------------------------------------------
class Groups:
    """This rank's process groups for the composed model, from :class:`harness.meshes.Meshes`."""

    def __init__(self, meshes):
        s = meshes.spec
        self.spec = s
        self.tp, self.cp, self.pp = meshes.group("tp"), meshes.group("cp"), meshes.group("pp")
        self.rep = meshes.group("dp_replicate")
        self.fsdp = meshes.group("fsdp")  # dp_shard·cp
        # dp_shard·cp·tp: the shard group of tensors tp cuts on dim 0 (a DTensor's nested Shard(0)s)
        self.fsdp_tp = meshes.dense["dp_shard", "cp", "tp"]._flatten("composed_fsdp_tp").get_group() \
            if s.tp > 1 else self.fsdp
        self.ep, self.etp = meshes.sparse["ep"].get_group(), meshes.sparse["etp"].get_group()
        self.loss_ranks = s.dp_replicate * s.dp_shard * s.cp  # each rank's loss is a mean over its tokens
        self.dense = meshes.dense["dp_replicate", "dp_shard", "cp", "tp"]
        self.sparse = meshes.sparse["dp_replicate", "efsdp", "ep", "etp"]
        # experts: (efsdp, ep) are the fsdp ranks (ep borrows dp_shard·cp when etp = tp), same order
        coord = dict(zip(self.sparse.mesh_dim_names, self.sparse.get_coordinate()))
        assert coord["efsdp"] * s.ep + coord["ep"] == group_rank(self.fsdp), "sparse (efsdp, ep) != dense fsdp order"

    def dp_groups(self, shard_group) -> DPGroups:
        return DPGroups(shard_group, self.rep, self.loss_ranks, 0)


class Weight(nn.Module):
    """Nothing but a parameter holder (keeps names when a module is swapped)."""


def fsdp_param(module: nn.Module, name: str, full: torch.Tensor, groups: Groups, *, tp_dim: int | None,
               expert_dim: int | None = None):
    """Register ``name`` on ``module`` as a DTensor parameter sharing storage with a parallel/fsdp.py
    ``FSDPParam``; return ``gather()``: the tensor this rank computes with (autograd: GatherParam).

    ``tp_dim``: the dim tp cuts (0: FSDP shards over fsdp·tp and the tp chunk is cut from the
    gathered tensor; 1/2: the tp chunk is what FSDP shards over fsdp). ``expert_dim``: an expert
    weight, its etp dim; FSDP shards the experts over efsdp·ep (= fsdp) and the ep chunk is cut
    from the gathered experts."""
    s = groups.spec
    expert = expert_dim is not None
    n_tp, c_tp = group_size(groups.tp), group_rank(groups.tp)
    inner, inner_n = None, 1  # a dim-0 chunk cut from the gathered tensor: (group, size)
    placements = [Replicate(), DShard(0), DShard(0), Replicate()]
    if expert:
        sharded = take(full, Shard(expert_dim), n_tp, c_tp) if n_tp > 1 else full
        shard_group, inner, inner_n = groups.fsdp, groups.ep, s.ep
        if n_tp > 1:
            placements[3] = DShard(expert_dim)
        mesh = groups.sparse
    elif tp_dim == 0 and n_tp > 1:
        sharded, shard_group, inner, inner_n = full, groups.fsdp_tp, groups.tp, n_tp
        placements[3] = DShard(0)
        mesh = groups.dense
    else:
        sharded = take(full, Shard(tp_dim), n_tp, c_tp) if tp_dim is not None and n_tp > 1 else full
        shard_group = groups.fsdp
        if tp_dim is not None and n_tp > 1:
            placements[3] = DShard(tp_dim)
        mesh = groups.dense
    n = group_size(shard_group)
    if sharded.shape[0] % n:
        raise ValueError(f"{name}: {sharded.shape[0]} rows do not shard evenly over {n} ranks")
    fp = FSDPParam(name, sharded.detach().float(), groups.dp_groups(shard_group), torch.float32)
    local = fp.shard.detach()
    shape = torch.Size(full.shape)
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                            stride=torch.empty(shape, device="meta").stride())
    param = nn.Parameter(dt)
    assert param.to_local().data_ptr() == fp.padded.data_ptr(), f"{name}: the DTensor does not share the shard"
    setattr(module, name, param)

    def gather():
        whole = GatherParam.apply(getattr(module, name).to_local(), fp)
        if inner is None or inner_n == 1:
            return whole
        lo, hi = chunk_bounds(whole.shape[0], inner_n, group_rank(inner))
        return whole.narrow(0, lo, hi - lo)

    return gather


# ---- the parallel modules ---------------------------------------------------------------------------------
class ParallelEmbedding(nn.Module):
    def __init__(self, ref_module, groups):
        super().__init__()
        self.groups = groups
        self.get = fsdp_param(self, "weight", ref_module.weight.data, groups, tp_dim=0)

    def forward(self, ids):
        return vocab_parallel_embedding(ids, self.get(), self.groups.tp, VOCAB)


class ParallelNorm(nn.Module):
    def __init__(self, ref_module, groups):
        super().__init__()
        self.get = fsdp_param(self, "weight", ref_module.weight.data, groups, tp_dim=None)

    def forward(self, x):
        return F.rms_norm(x, (DIM,), self.get(), EPS)


class ParallelAttention(nn.Module):
    """Heads over tp (wq/wk/wv column-parallel, wo row-parallel), the sequence over cp (ring attention)."""

    def __init__(self, ref_module, groups):
        super().__init__()
        self.groups = groups
        self.get = {w: fsdp_param(self, w, getattr(ref_module, w).data, groups, tp_dim=0) for w in ("wq", "wk", "wv")}
        self.get["wo"] = fsdp_param(self, "wo", ref_module.wo.data, groups, tp_dim=1)
        n = group_size(groups.cp)
        self.pos = [positions("contig", SEQ, n, r) for r in range(n)]

    def forward(self, x):
        g = self.groups
        heads = HEADS // group_size(g.tp)
        q, k, v = (split_heads(column_parallel(x, self.get[w](), None, g.tp), heads) for w in ("wq", "wk", "wv"))
        out, _ = ring_attention(q, k, v, g.cp, self.pos, True)
        return row_parallel(merge_heads(out), self.get["wo"](), None, g.tp)


class ParallelMLP(nn.Module):
    """Column- then row-parallel (parallel/tp.py), or the 3D seed's hand-written backward."""

    def __init__(self, ref_module, groups, manual: bool):
        super().__init__()
        self.groups, self.manual = groups, manual
        self.get = {w: fsdp_param(self, w, getattr(ref_module, w).data, groups, tp_dim=d)
                    for w, d in (("w1", 0), ("b1", 0), ("w2", 1), ("b2", None))}

    def forward(self, x):
        p = {w: get() for w, get in self.get.items()}
        tp = self.groups.tp
        if self.manual:
            return ManualMLP.apply(x, p["w1"], p["b1"], p["w2"], p["b2"], tp)
        return row_parallel(F.gelu(column_parallel(x, p["w1"], p["b1"], tp)), p["w2"], p["b2"], tp)


def _gelu_grad(h):
    """d gelu(h) / dh for the exact (erf) GELU."""
    cdf = 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0)))
    pdf = torch.exp(-0.5 * h * h) / math.sqrt(2.0 * math.pi)
    return cdf + h * pdf


class ManualMLP(torch.autograd.Function):
    """The 3D seed's MLP with its backward written out: forward h = x W1ᵀ + b1 (this rank's columns),
    y = all-reduce_tp(gelu(h) W2ᵀ) + b2; backward dW2 = dyᵀ a, da = dy W2, dh = da · gelu'(h),
    dW1 = dhᵀ x, db1 = Σ dh, db2 = Σ dy, dx = all-reduce_tp(dh W1)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, tp):
        h = F.linear(x, w1, b1)
        a = F.gelu(h)
        y = F.linear(a, w2)
        if group_size(tp) > 1:
            dist.all_reduce(y, group=tp)
        ctx.save_for_backward(x, w1, w2, h, a)
        ctx.tp = tp
        return y + b2

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, h, a = ctx.saved_tensors
        rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        dw2 = rows(dy).T @ rows(a)
        db2 = rows(dy).sum(0)
        dh = (dy @ w2) * _gelu_grad(h)
        dw1 = rows(dh).T @ rows(x)
        db1 = rows(dh).sum(0)
        dx = dh @ w1
        if group_size(ctx.tp) > 1:
            dx = dx.contiguous()
            dist.all_reduce(dx, group=ctx.tp)
        return dx, dw1, db1, dw2, db2, None


class ParallelMoE(nn.Module):
    """parallel/moe.py's layer: experts over ep (borrowed from dp_shard·cp), their FFN over etp = tp."""

    def __init__(self, ref_module, groups):
        super().__init__()
        self.groups = groups
        self.get = {"router": fsdp_param(self, "router", ref_module.router.data, groups, tp_dim=None)}
        for w in ref_moe_expert_params():
            self.get[w] = fsdp_param(self, w, getattr(ref_module, w).data, groups, tp_dim=None,
                                     expert_dim=par_moe.FFN_DIM[w])

    def forward(self, x):
        b, s, h = x.shape
        p = {w: get() for w, get in self.get.items()}
        g = self.groups
        etp = g.etp if group_size(g.etp) > 1 else None
        out, _, _, _ = par_moe.moe(MOE, x.reshape(b * s, h), p, g.ep, etp, [], b * s)
        return out.view(b, s, h)


def ref_moe_expert_params():
    from reference.moe import EXPERT_PARAMS

    return EXPERT_PARAMS


class ParallelHead(nn.Module):
    """Column-parallel over the vocabulary; the logits stay cut (vocab-parallel cross-entropy)."""

    def __init__(self, ref_module, groups):
        super().__init__()
        self.groups = groups
        self.get = fsdp_param(self, "weight", ref_module.weight.data, groups, tp_dim=0)

    def forward(self, x):
        return VocabLogits(F.linear(copy_to_group(x, self.groups.tp), self.get()), self.groups.tp)


def swap(model: ref.Composed, groups: Groups, manual: bool) -> ref.Composed:
    """Every module of the reference replaced by its parallel counterpart, in place."""
    if model.embed is not None:
        model.embed = ParallelEmbedding(model.embed, groups)
    for block in model.layers.values():
        block.attention_norm = ParallelNorm(block.attention_norm, groups)
        block.ffn_norm = ParallelNorm(block.ffn_norm, groups)
        block.attention = ParallelAttention(block.attention, groups)
        if hasattr(block, "moe"):
            block.moe = ParallelMoE(block.moe, groups)
        else:
            block.mlp = ParallelMLP(block.mlp, groups, manual)
    if model.head is not None:
        model.norm = ParallelNorm(model.norm, groups)
        model.head = ParallelHead(model.head, groups)
    return model


# ---- the pipeline -------------------------------------------------------------------------------------------
class Stage:
    """What harness.model.Pipelined reads of a stage (``submod``, ``is_first``, ``is_last``) and
    what parallel/pipeline.py's ``execute`` calls (``forward``, ``last``)."""

    def __init__(self, submod, index: int, stages: int):
        self.submod, self.index = submod, index
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.last = stages - 1
        self.losses: list[torch.Tensor] = []

    def forward(self, s: int, mb: int, x, params, target):
        out = self.submod(x)
        if s < self.last:
            return out
        loss = ref.cross_entropy(out, target)
        self.losses.append(loss.detach())
        return loss / MICROBATCHES  # the microbatches add up to this rank's mean


class Schedule:
    """``schedule.step`` as harness.model's runner calls it, on parallel/pipeline.py's 1F1B lists."""

    def __init__(self, stage: Stage, groups: Groups):
        self.stage, self.groups = stage, groups
        self.sched = ps.build("1f1b", groups.spec.pp, MICROBATCHES)
        self.coord = group_rank(groups.pp)
        self.peers = {c: dist.get_global_rank(groups.pp, c) for c in range(groups.spec.pp)}

    def step(self, *args, target=None, losses=None):
        m = MICROBATCHES
        ids = list(args[0].chunk(m)) if args else [None] * m
        labels = list(target.chunk(m)) if target is not None else [None] * m
        rows = (args[0] if args else target).shape[0] if (args or target is not None) else None
        if rows is None:  # a middle stage: the rows of this rank's slice (every rank has the same)
            raise ValueError("the composed pipeline has two stages")
        act = (rows // m, SEQ // group_size(self.groups.cp), DIM)
        self.stage.losses = []
        execute(self.sched, self.coord, self.stage, {}, ids, labels, self.peers, self.groups.pp, act, torch.float32)
        for p in self.stage.submod.parameters():  # execute backpropagates the loss times GRAD_SCALE
            if p.grad is not None:
                p.grad.mul_(1.0 / GRAD_SCALE)
        if losses is not None:
            losses.extend(self.stage.losses)


def stage_module(model: ref.Composed, index: int) -> ref.Composed:
    """Stage ``index`` of two: embedding + block 0, or block 1 + norm + head."""
    keep = {0: {"0"}, 1: {"1"}}[index]
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    if index == 0:
        model.norm, model.head = None, None
    else:
        model.embed = None
    return model


def parallelize(model: ref.Composed, meshes, manual: bool):
    groups = Groups(meshes)
    if groups.spec.pp == 1:
        return swap(model, groups, manual)
    if groups.spec.pp != 2:
        raise ValueError("the composed model pipelines over pp=2 (two stages)")
    index = group_rank(groups.pp)
    stage = Stage(swap(stage_module(model, index), groups, manual), index, 2)
    return Pipelined([stage], Schedule(stage, groups))
