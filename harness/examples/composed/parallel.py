"""The composed model's parallel modules: ``model.py``'s modules rebuilt from ``harness/parallel/``,
holding this rank's shards under the reference's parameter names, its FSDP units, its pipeline stage
and schedule, and :func:`parallelize`, which applies every dim the mesh has:

* tp: the embedding and head vocab-parallel, wq/wk/wv column-parallel and wo row-parallel (heads over
  tp), the MLP column- then row-parallel (``harness/parallel/tp.py``); the experts' FFN over etp = tp
  (``harness/parallel/moe.py``'s ``run_experts``); the logits stay cut by vocabulary
  (:class:`VocabLogits`) and :func:`loss` runs the vocab-parallel cross-entropy;
* cp: ring attention over the sequence chunks (``harness/parallel/ring_attention.py``, contiguous layout: the
  harness cuts the sequence in cp chunks);
* ep: the experts over the sparse mesh's ep, borrowed from dp·cp (dp2ep), tokens dispatched and
  combined with ``harness/parallel/moe.py``'s all-to-all pair;
* dp·cp (FSDP) and rep (HSDP): FSDP units as torchtitan wraps them (the embedding,
  each block, norm + head), each one ``harness/parallel/fsdp.py`` ``FSDPParam`` per shard group holding every
  parameter's dim-0 chunk side by side (FSDP1's flat parameter): all-gathered once per call of the
  unit, its gradient reduce-scattered once, all-reduced over rep and divided by the loss
  ranks (rep·dp·cp: each rank's loss is a mean over its own tokens). The shard group is the
  flattened fsdp group (times tp for a tensor tp cuts on dim 0; the experts' efsdp·ep is the same
  ranks), the tp or ep chunk being cut from the gathered tensor. Each parameter is a DTensor over the
  dense mesh (rep, dp, cp, tp) sharing the shard's storage: the harness reads its
  placements and ``torch.distributed.checkpoint`` saves and reshards it;
* pp: two stages (embedding + block 0, block 1 + norm + head) run by ``harness/parallel/pipeline.py``'s
  ``execute`` on the 1F1B action lists of ``harness/parallel/pipeline_schedule.py`` (``MICROBATCHES``
  microbatches), wrapped as :class:`harness.model.Pipelined`.

``manual=True`` swaps the dense MLP for the 3D seed's hand-written backward (:class:`ManualMLP`).
Imports ``model.py`` (its modules, sizes and single-process loss) and ``harness/parallel/``; the
model case (``case.py``) builds on this module, never the other way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard

from harness.events import paused
from harness.layout import Shard, chunk_bounds, take
from harness.model import Pipelined
from harness.parallel import moe as par_moe
from harness.parallel import pipeline_schedule as ps
from harness.parallel.collectives import copy_to_group, group_rank, group_size
from harness.parallel.fsdp import DPGroups, FSDPParam
from harness.parallel.pipeline import execute
from harness.parallel.ring_attention import positions, ring_attention
from harness.parallel.tp import column_parallel, row_parallel, vocab_parallel_cross_entropy, vocab_parallel_embedding
from reference.moe import EXPERT_PARAMS
from reference.pipeline import GRAD_SCALE
from reference.ring_attention import merge_heads, split_heads

from . import model as ref
from .model import DIM, EPS, HEADS, MICROBATCHES, MOE, SEQ, VOCAB


# ---- the groups ---------------------------------------------------------------------------------------
class Groups:
    """This rank's process groups for the composed model, from :class:`harness.meshes.Meshes`."""

    def __init__(self, meshes):
        s = meshes.spec
        self.spec = s
        self.tp, self.cp, self.pp = meshes.group("tp"), meshes.group("cp"), meshes.group("pp")
        self.rep = meshes.group("rep")
        self.fsdp = meshes.group("fsdp")  # dp·cp
        # dp·cp·tp: the shard group of tensors tp cuts on dim 0 (a DTensor's nested Shard(0)s)
        self.fsdp_tp = meshes.dense["dp", "cp", "tp"]._flatten("composed_fsdp_tp").get_group() \
            if s.tp > 1 else self.fsdp
        self.ep, self.etp = meshes.sparse["ep"].get_group(), meshes.sparse["etp"].get_group()
        self.loss_ranks = s.rep * s.dp * s.cp  # each rank's loss is a mean over its tokens
        # the parameters' DTensors live on the dims that split something: a DTensor op's sharding is
        # propagated over every dim of its mesh, so dims of size 1 would only multiply that work
        self.dense_dims = tuple(d for d in DENSE_DIMS if getattr(s, d) > 1) or ("dp",)
        self.dense = meshes.dense[self.dense_dims]
        self.sparse = meshes.sparse["rep", "efsdp", "ep", "etp"]
        # experts: (efsdp, ep) are the fsdp ranks (ep borrows dp·cp when etp = tp), same order
        coord = dict(zip(self.sparse.mesh_dim_names, self.sparse.get_coordinate()))
        assert coord["efsdp"] * s.ep + coord["ep"] == group_rank(self.fsdp), "sparse (efsdp, ep) != dense fsdp order"

    def dp_groups(self, shard_group) -> DPGroups:
        return DPGroups(shard_group, self.rep, self.loss_ranks, 0)


# the dense dims a parameter's placements are written over, before the dims of size 1 are dropped
DENSE_DIMS = ("rep", "dp", "cp", "tp")


# ---- the FSDP units ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cut:
    """A dim-0 chunk cut from a gathered tensor: this rank's chunk of ``ranks`` over ``group``."""

    group: dist.ProcessGroup
    ranks: int


@dataclass(eq=False)
class Entry:
    """A parameter declared to a :class:`Unit`: attribute ``name`` of ``module``; ``full``: the
    reference's tensor; ``sharded``: what FSDP shards over ``group`` (``full``, or its tp chunk);
    ``inner``: the chunk cut from the gathered tensor (tp or ep), or None; ``placements`` on ``mesh``:
    the DTensor's."""

    module: nn.Module
    name: str
    full: torch.Tensor
    sharded: torch.Tensor
    group: dist.ProcessGroup
    inner: Cut | None
    placements: list
    mesh: object


@dataclass(frozen=True, eq=False)
class Segment:
    """An :class:`Entry`'s place in its shard group's flat rows: ``size`` elements from ``offset`` of each
    rank's row, a dim-0 chunk of ``shape`` of the ``sharded_shape`` tensor; ``full_shape``: the
    reference's (the DTensor's global shape)."""

    module: nn.Module
    name: str
    offset: int
    size: int
    shape: tuple[int, ...]
    sharded_shape: tuple[int, ...]
    inner: Cut | None
    placements: list
    mesh: object
    full_shape: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class FlatRow:
    """One shard group's flat parameter: the ``FSDPParam`` (``[ranks, C]``) and its segments."""

    param: FSDPParam
    segments: list[Segment]


class Unit:
    """One FSDP unit (a block, the embedding, norm + head): its parameters gathered with one
    all-gather per shard group and their gradients reduced with one reduce-scatter, FSDP1's flat
    parameter made of ``harness/parallel/fsdp.py``'s pieces: per shard group, rank r's chunks of every
    parameter of the unit are one row of a ``[ranks, C]`` tensor, an ``FSDPParam`` (its
    ``gather``: all-gather; its ``reduce``: reduce-scatter, all-reduce over rep, divided by
    the loss ranks). Each parameter is a DTensor (dense mesh, or sparse for experts) whose local
    tensor is its segment of this rank's row (same storage: the optimizer and DCP write through).

    A forward pre-hook on the unit's module drops the gathered tensors, so each call of the unit
    (each microbatch of a pipeline) gathers once; autograd calls :class:`GatherUnit`'s backward once
    per call, when every parameter's gradient of that call is in."""

    def __init__(self, root: nn.Module, groups: Groups):
        self.groups, self.root = groups, root
        self.entries: list[Entry] = []
        self.flat: dict[dist.ProcessGroup, FlatRow] = {}  # by shard group
        self.segments: dict[tuple[int, str], Segment] = {}  # by (id(module), name)
        self.cache: dict | None = None
        root.register_forward_pre_hook(lambda module, args: self.drop())

    def drop(self):
        self.cache = None

    def add(self, module, name, full, *, tp_dim=None, expert_dim=None):
        """Declare parameter ``name`` of ``module`` (``full``: the reference's tensor); returns ``get()``,
        the tensor this rank computes with. ``tp_dim``: the dim tp cuts (0: FSDP shards over fsdp·tp and
        the tp chunk is cut from the gathered tensor; 1, 2: FSDP shards the tp chunk over fsdp).
        ``expert_dim``: an expert weight, its etp dim (FSDP shards the experts over efsdp·ep = fsdp
        and the ep chunk is cut from the gathered experts)."""
        g, s = self.groups, self.groups.spec
        n_tp, c_tp = group_size(g.tp), group_rank(g.tp)
        inner = None
        placements = [Replicate(), DShard(0), DShard(0), Replicate()]
        mesh = g.dense
        if expert_dim is not None:
            # the DTensor sits on the dense mesh: (efsdp, ep) are the fsdp ranks (dp, cp) in the same
            # order (asserted in Groups), so this is the same layout, and the harness can place it
            # without gathering (a sparse-mesh DTensor would be read back with full_tensor())
            sharded = take(full, Shard(expert_dim), n_tp, c_tp) if n_tp > 1 else full
            group, inner = g.fsdp, Cut(g.ep, s.ep)
            if n_tp > 1:
                placements[3] = DShard(expert_dim)
        elif tp_dim == 0 and n_tp > 1:
            sharded, group, inner = full, g.fsdp_tp, Cut(g.tp, n_tp)
            placements[3] = DShard(0)
        else:
            cut = tp_dim is not None and n_tp > 1
            sharded, group = (take(full, Shard(tp_dim), n_tp, c_tp) if cut else full), g.fsdp
            if cut:
                placements[3] = DShard(tp_dim)
        placements = [p for d, p in zip(DENSE_DIMS, placements) if d in g.dense_dims]
        self.entries.append(Entry(module, name, full, sharded.detach().float(), group, inner, placements, mesh))
        return lambda: self.get(module, name)

    def build(self):
        """Cut every declared parameter into the flat rows and register the DTensor parameters."""
        by_group: dict[dist.ProcessGroup, list[Entry]] = {}
        for entry in self.entries:
            by_group.setdefault(entry.group, []).append(entry)
        for group, entries in by_group.items():
            n = group_size(group)
            rows, segments, offset = [], [], 0
            for e in entries:
                if e.sharded.shape[0] % n:
                    raise ValueError(f"{e.name}: {e.sharded.shape[0]} rows do not shard evenly over {n} ranks")
                chunks = e.sharded.chunk(n)
                rows.append(torch.stack([c.flatten() for c in chunks]))
                segments.append(Segment(e.module, e.name, offset, chunks[0].numel(), tuple(chunks[0].shape),
                                        tuple(e.sharded.shape), e.inner, e.placements, e.mesh, tuple(e.full.shape)))
                offset += chunks[0].numel()
            fp = FSDPParam(f"unit{len(self.flat)}", torch.cat(rows, 1), self.groups.dp_groups(group), torch.float32)
            self.flat[group] = FlatRow(fp, segments)
            for seg in segments:
                local = fp.padded[0, seg.offset:seg.offset + seg.size].view(seg.shape)
                dt = DTensor.from_local(local, seg.mesh, seg.placements, run_check=False,
                                        shape=torch.Size(seg.full_shape),
                                        stride=torch.empty(seg.full_shape, device="meta").stride())
                param = nn.Parameter(dt)
                assert param.to_local().data_ptr() == local.data_ptr(), f"{seg.name}: the DTensor does not share the shard"
                setattr(seg.module, seg.name, param)
                self.segments[id(seg.module), seg.name] = seg

    def gathered(self) -> dict:
        if self.cache is None:
            self.cache = {}
            for row in self.flat.values():
                locals_ = [getattr(seg.module, seg.name).to_local() for seg in row.segments]
                fulls = GatherUnit.apply(row.param, row.segments, *locals_)
                for seg, whole in zip(row.segments, fulls):
                    self.cache[id(seg.module), seg.name] = whole
        return self.cache

    def get(self, module, name):
        whole = self.gathered()[id(module), name]
        inner = self.segments[id(module), name].inner
        if inner is None or inner.ranks == 1:
            return whole
        lo, hi = chunk_bounds(whole.shape[0], inner.ranks, group_rank(inner.group))
        return whole.narrow(0, lo, hi - lo)


class GatherUnit(torch.autograd.Function):
    """Forward: the unit's flat row all-gathered (``FSDPParam.gather``), cut into each parameter's
    full tensor. Backward: the parameters' gradients laid out as the flat rows, reduced by
    ``FSDPParam.reduce`` (reduce-scatter, rep all-reduce, / loss ranks), cut into this
    rank's segments."""

    @staticmethod
    def forward(ctx, fp, segments, *locals_):
        ctx.fp, ctx.segments = fp, segments
        flat = fp.gather()  # [ranks, C]
        return tuple(flat[:, s.offset:s.offset + s.size].reshape(-1, *s.shape[1:]).reshape(s.sharded_shape)
                     for s in segments)

    @staticmethod
    def backward(ctx, *grads):
        fp, segments = ctx.fp, ctx.segments
        n = fp.full_shape[0]
        rows = torch.cat([(g if g is not None else torch.zeros(s.sharded_shape)).reshape(n, s.size)
                          for g, s in zip(grads, segments)], 1)
        mine = fp.reduce(rows)[0]  # this rank's row, reduced
        return (None, None, *(mine[s.offset:s.offset + s.size].view(s.shape) for s in segments))


# ---- the parallel modules ---------------------------------------------------------------------------------
class ParallelEmbedding(nn.Module):
    def __init__(self, ref_module, groups, unit):
        super().__init__()
        self.groups = groups
        self.get = unit.add(self, "weight", ref_module.weight.data, tp_dim=0)

    def forward(self, ids):
        return vocab_parallel_embedding(ids, self.get(), self.groups.tp, VOCAB)


class ParallelNorm(nn.Module):
    def __init__(self, ref_module, groups, unit):
        super().__init__()
        self.get = unit.add(self, "weight", ref_module.weight.data)

    def forward(self, x):
        return F.rms_norm(x, (DIM,), self.get(), EPS)


class ParallelAttention(nn.Module):
    """Heads over tp (wq/wk/wv column-parallel, wo row-parallel), the sequence over cp (ring attention)."""

    def __init__(self, ref_module, groups, unit):
        super().__init__()
        self.groups = groups
        self.get = {w: unit.add(self, w, getattr(ref_module, w).data, tp_dim=0) for w in ("wq", "wk", "wv")}
        self.get["wo"] = unit.add(self, "wo", ref_module.wo.data, tp_dim=1)
        n = group_size(groups.cp)
        self.pos = [positions("contig", SEQ, n, r) for r in range(n)]

    def forward(self, x):
        g = self.groups
        heads = HEADS // group_size(g.tp)
        q, k, v = (split_heads(column_parallel(x, self.get[w](), None, g.tp), heads) for w in ("wq", "wk", "wv"))
        with paused():  # the ring's own events are placed for the ringattn cells, not this model
            out, _ = ring_attention(q, k, v, g.cp, self.pos, True)
        return row_parallel(merge_heads(out), self.get["wo"](), None, g.tp)


class ParallelMLP(nn.Module):
    """Column- then row-parallel (harness/parallel/tp.py), or the 3D seed's hand-written backward."""

    def __init__(self, ref_module, groups, unit, manual: bool):
        super().__init__()
        self.groups, self.manual = groups, manual
        self.get = {w: unit.add(self, w, getattr(ref_module, w).data, tp_dim=d)
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
    """harness/parallel/moe.py's layer: experts over ep (borrowed from dp·cp), their FFN over etp = tp."""

    def __init__(self, ref_module, groups, unit):
        super().__init__()
        self.groups = groups
        self.get = {"router": unit.add(self, "router", ref_module.router.data)}
        for w in EXPERT_PARAMS:
            self.get[w] = unit.add(self, w, getattr(ref_module, w).data, expert_dim=par_moe.FFN_DIM[w])

    def forward(self, x):
        b, s, h = x.shape
        p = {w: get() for w, get in self.get.items()}
        g = self.groups
        etp = g.etp if group_size(g.etp) > 1 else None
        with paused():  # the layer's own events are placed for the moe cells, not this model
            out, _, _, _ = par_moe.moe(MOE, x.reshape(b * s, h), p, g.ep, etp, [], b * s)
        return out.view(b, s, h)


class VocabLogits:
    """A rank's logits cut over tp by vocabulary (:func:`cross_entropy` runs the vocab-parallel cross-entropy)."""

    def __init__(self, logits, tp):
        self.logits, self.tp = logits, tp


def cross_entropy(output, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: vocab-parallel on a :class:`VocabLogits`, else ``model.py``'s."""
    if isinstance(output, VocabLogits):
        return vocab_parallel_cross_entropy(output.logits, target, output.tp, VOCAB).mean()
    return ref.cross_entropy(output, target)


def loss(output, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model case's loss: on the reference's logits or on a parallel model's :class:`VocabLogits`."""
    return cross_entropy(output, batch["target"])


class ParallelHead(nn.Module):
    """Column-parallel over the vocabulary; the logits stay cut (vocab-parallel cross-entropy)."""

    def __init__(self, ref_module, groups, unit):
        super().__init__()
        self.groups = groups
        self.get = unit.add(self, "weight", ref_module.weight.data, tp_dim=0)

    def forward(self, x):
        return VocabLogits(F.linear(copy_to_group(x, self.groups.tp), self.get()), self.groups.tp)


def swap(model: ref.Composed, groups: Groups, manual: bool) -> ref.Composed:
    """Every module of the reference replaced by its parallel counterpart, in place; FSDP units as
    torchtitan wraps them: the embedding, each block, norm + head (the unit of norm + head runs
    from the norm's call)."""
    units = []
    if model.embed is not None:
        unit = Unit(model, groups)  # (the root's pre-hook: the embedding runs first)
        model.embed = ParallelEmbedding(model.embed, groups, unit)
        units.append(unit)
    for block in model.layers.values():
        unit = Unit(block, groups)
        block.attention_norm = ParallelNorm(block.attention_norm, groups, unit)
        block.ffn_norm = ParallelNorm(block.ffn_norm, groups, unit)
        block.attention = ParallelAttention(block.attention, groups, unit)
        if hasattr(block, "moe"):
            block.moe = ParallelMoE(block.moe, groups, unit)
        else:
            block.mlp = ParallelMLP(block.mlp, groups, unit, manual)
        block.unit = unit
        units.append(unit)
    if model.head is not None:
        unit = Unit(model.norm, groups)
        model.norm = ParallelNorm(model.norm, groups, unit)
        model.head = ParallelHead(model.head, groups, unit)
        unit.root = model.norm
        model.norm.register_forward_pre_hook(lambda module, args, unit=unit: unit.drop())
        units.append(unit)
    for unit in units:
        unit.build()
    return model


# ---- the pipeline -------------------------------------------------------------------------------------------
class Stage:
    """What harness.model.Pipelined reads of a stage (``submod``, ``is_first``, ``is_last``) and
    what harness/parallel/pipeline.py's ``execute`` calls (``forward``, ``last``)."""

    def __init__(self, submod, index: int, stages: int):
        self.submod, self.index = submod, index
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.last = stages - 1
        self.losses: list[torch.Tensor] = []

    def forward(self, s: int, mb: int, x, params, target):
        out = self.submod(x)
        if s < self.last:
            return out
        loss = cross_entropy(out, target)
        self.losses.append(loss.detach())
        return loss / MICROBATCHES  # the microbatches add up to this rank's mean


class Schedule:
    """``schedule.step`` as harness.model's runner calls it, on harness/parallel/pipeline.py's 1F1B lists."""

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
