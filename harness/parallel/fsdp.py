"""FSDP and HSDP from torch.distributed primitives; read beside ``reference/fsdp.py``.

Meshes (row-major, as ``DeviceMesh(torch.arange(world).view(shape))``):

* FSDP ``dp=N``: every parameter sharded over the N ranks of ``dp``.
* HSDP ``rep=R,shard=S``: sharded over the S ranks of ``shard``, the shards replicated over the R
  ranks of ``rep`` (a replica group is one column of the mesh).

The data-parallel world is every rank (N, or R*S): the batch of a step is cut into that many
row blocks, rank ``rep_coord*S + shard_coord`` taking block number that, and its block into ``m``
microbatches.

How a rank's shard relates to the full parameter (the layout a checkpoint sees)
-------------------------------------------------------------------------------
``shard = torch.chunk(full, S, dim=0)[c]`` where ``S`` is the size of the shard dim (``dp`` for
FSDP, ``shard`` for HSDP) and ``c`` this rank's coordinate along it; ``torch.chunk`` semantics, so
chunks are ``ceil(rows/S)`` rows and the trailing ranks hold fewer rows or an EMPTY shard (5 rows
over 4 ranks: 2/2/1/0). Nothing is sharded over ``rep``: all R ranks of a replica group hold equal
shards. As DTensors this is placements ``[Shard(0)]`` on the 1-D ``dp`` mesh and
``[Replicate(), Shard(0)]`` on the 2-D ``(rep, shard)`` mesh, which is exactly how DTensor cuts
uneven shards too. :meth:`FSDP.state_dict` returns the model and AdamW state in that form
(``DTensor.from_local(local, mesh, placements, shape=full_shape, stride=full_stride)``), for
``torch.distributed.checkpoint`` to save or load in place; :meth:`FSDP.load_state_dict` copies such
a state back into the shards. Keys: ``model.<p>``, ``optim.<p>.exp_avg``, ``optim.<p>.exp_avg_sq``
(DTensors) and ``optim.<p>.step`` (a plain scalar tensor), for p in w1, b1, w2, b2.
``harness/parallel/fsdp_torch.py:state_dict`` gives the same keys for FSDP2, so a checkpoint crosses over.
On a mesh smaller than the pool, pass ``dcp.save/load`` a ``process_group`` spanning the mesh's
ranks (the default group is the whole pool, whose idle ranks would never join).

The algorithm
-------------
* Each rank keeps its shard in fp32 (the master weights), stored padded with zeros to the largest
  chunk: that is the buffer it sends, since gloo's all-gather needs equal sizes.
* A layer's forward all-gathers its parameters (cast to the compute dtype first: bf16 under mixed
  precision, so the wire carries bf16) and frees the full tensors when it returns: autograd saves a
  handle instead of the full weight (``saved_tensors_hooks``), and the backward all-gathers again
  each weight it needs (W2, to pass the gradient to the hidden layer; not W1, whose input needs no
  gradient, nor the biases).
* :class:`GatherParam` states the pair: forward all-gather over the shard group, backward
  reduce-scatter over the shard group, then all-reduce over ``rep``, divided by the whole
  data-parallel world (the local loss is a mean over the rank's rows, so the gradient is the mean
  of the ranks' gradients). The reduction runs in fp32 whatever the compute dtype.
* Gradient accumulation: for every microbatch but the last, the backward adds the unsharded fp32
  gradient to a buffer and communicates nothing; the last microbatch reduces the sum once.
* Gradient-norm clipping: squares summed over each rank's padded gradient shard (the padding is
  zero, so it adds nothing), all-reduced over the shard group only (replicas hold equal shards).
* AdamW (``reference.common.adamw``) steps on the unpadded local shards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard

from harness import events
from harness.config import Config, ConfigError
from harness.context import RankContext
from harness.events import At
from harness.layout import Piece, Shard, chunk_bounds, empty_chunk_rule, take
from harness.names import grad_name, param_name, state_name, step_name
from reference.common import adamw, probe_loss
from reference.fsdp import CLIP_EPS, MAX_NORM, PARAMS, STEPS, make_problem

from .collectives import all_gather_chunks, group_rank, group_size, reduce_scatter_padded

DIMS = ("rep", "shard", "dp", "tp")
LAYERS = (("w1", "b1"), ("w2", "b2"))  # one FSDP unit per linear layer
MIXED = {"fp32": torch.float32, "bf16": torch.bfloat16}  # compute dtype; master and reduction fp32


def shard_dim(names) -> str:
    """The mesh dim parameters are sharded over: ``shard`` on an HSDP mesh, else ``dp``."""
    return "shard" if "shard" in names else "dp"


def validate(cfg: Config) -> None:
    """Rules of the fsdp component, checked before any rank runs."""
    names = [n for n, _ in cfg.mesh]
    extra = [n for n in names if n not in DIMS]
    if extra:
        raise ConfigError(f"fsdp cells take mesh dims dp (FSDP), rep,shard (HSDP) and tp, not {extra}: "
                          "e.g. dp=4, rep=2,shard=2 or dp=2,tp=2")
    if ("rep" in names) != ("shard" in names) or ("dp" in names and "shard" in names):
        raise ConfigError(f"fsdp mesh {cfg.mesh}: FSDP is dp=N, HSDP is rep=R,shard=S (both dims, no dp)")
    if "dp" not in names and "shard" not in names:
        raise ConfigError(f"fsdp mesh {cfg.mesh} has no data-parallel dim: add dp=N or rep=R,shard=S")
    order = [n for n in DIMS if n in names]
    if names != order:
        raise ConfigError(f"fsdp mesh dims must come in the order {','.join(order)} (replicas outermost, "
                          f"tp innermost), got {','.join(names)}")
    if cfg.dtype not in MIXED:
        raise ConfigError(f"fsdp dtype {cfg.dtype}: fp32, or bf16 for mixed precision (bf16 compute, "
                          "fp32 master weights and reduction)")
    tp = cfg.degree("tp")
    if tp > 1:
        if "shard" in names:
            raise ConfigError("fsdp with tp runs on dp=D,tp=T, not on an HSDP mesh")
        if cfg.impl == "ours":
            raise ConfigError("our fsdp shards over data parallel only: run dp×tp cells with impl fsdp2")
        if not empty_chunk_rule(cfg.size("f"), tp):
            raise ConfigError(f"tp={tp} leaves a rank an empty chunk of f={cfg.size('f')}: "
                              f"choose f with ceil(f/tp)*(tp-1) < f")
    world, m, b = dp_world(cfg.mesh), cfg.size("m"), cfg.size("b")
    if b % (world * m):
        raise ConfigError(f"batch b={b} does not split into {world} data-parallel ranks x m={m} microbatches: "
                          f"choose b a multiple of {world * m}")
    for key in "hfo":
        cfg.size(key)


def dp_world(mesh) -> int:
    """Ranks the batch is split over: every mesh dim but tp."""
    return math.prod(d for n, d in mesh if n != "tp")


@dataclass
class DPGroups:
    """This rank's data-parallel groups: the shard group, the replica group (HSDP) and their sizes."""

    shard: object  # ProcessGroup or None (a single rank)
    rep: object
    world: int  # whole data-parallel world: the divide factor of the gradient
    index: int  # this rank's block of the batch

    @classmethod
    def of(cls, mesh: DeviceMesh) -> "DPGroups":
        """The groups of a ``dp`` or ``(rep, shard)`` DeviceMesh (the cell's, or a declared extra one)."""
        names = mesh.mesh_dim_names
        sd = shard_dim(names)
        s, c = mesh.size(names.index(sd)), mesh.get_local_rank(sd)
        rep, r, rc = None, 1, 0
        if "rep" in names:
            rep, r, rc = mesh.get_group("rep"), mesh.size(names.index("rep")), mesh.get_local_rank("rep")
        return cls(mesh.get_group(sd), rep, s * r, rc * s + c)


class FSDPParam:
    """One parameter's padded fp32 shard, its unsharded-gradient buffer, and the two collectives."""

    def __init__(self, name: str, full: torch.Tensor, groups: DPGroups, compute_dtype: torch.dtype):
        self.name, self.groups, self.compute_dtype = name, groups, compute_dtype
        self.full_shape = tuple(full.shape)
        n, c = group_size(groups.shard), group_rank(groups.shard)
        lo, hi = chunk_bounds(full.shape[0], n, c)
        self.rows, self.padded_rows = hi - lo, chunk_bounds(full.shape[0], n, 0)[1]
        self.padded = torch.zeros((self.padded_rows, *full.shape[1:]), dtype=torch.float32)
        self.padded[: self.rows] = full[lo:hi]
        # the leaf AdamW steps: the unpadded rows, a view into the padded buffer the all-gather sends
        self.shard = self.padded[: self.rows].requires_grad_()
        self.padded_grad: torch.Tensor | None = None  # this step's reduced gradient shard, padding kept
        self.pending: torch.Tensor | None = None  # unsharded fp32 gradient of earlier microbatches
        self.reduce_now = True  # False while accumulating microbatches that do not reduce

    def gather(self) -> torch.Tensor:
        """The full parameter in the compute dtype (no autograd)."""
        local = self.padded.to(self.compute_dtype, copy=True)  # never the shard's own storage
        if group_size(self.groups.shard) == 1:
            return local
        return all_gather_chunks(local, 0, self.groups.shard, self.full_shape[0])

    def reduce(self, grad_full: torch.Tensor) -> torch.Tensor | None:
        """Accumulate the full gradient; on the last microbatch reduce it to this rank's shard."""
        grad = grad_full.to(torch.float32)  # reduce in fp32, whatever the compute dtype
        if self.pending is not None:
            grad = self.pending + grad
        if not self.reduce_now:
            self.pending = grad
            return None
        self.pending = None
        if group_size(self.groups.shard) > 1:
            grad = reduce_scatter_padded(grad, 0, self.groups.shard)
        if group_size(self.groups.rep) > 1:
            dist.all_reduce(grad, group=self.groups.rep)
        self.padded_grad = grad / self.groups.world
        return self.padded_grad[: self.rows]


class GatherParam(torch.autograd.Function):
    """Forward: all-gather the shard over the shard group (in the compute dtype).
    Backward: reduce-scatter the gradient over the shard group and all-reduce it over ``rep``, in
    fp32, divided by the whole data-parallel world (or only accumulate it, before the last microbatch)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, param: FSDPParam) -> torch.Tensor:
        ctx.param = param
        return param.gather()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.param.reduce(grad), None


class FSDP:
    """The reference MLP, each linear layer one FSDP unit over this rank's data-parallel groups."""

    def __init__(self, mesh: DeviceMesh, params: dict[str, torch.Tensor], compute_dtype: torch.dtype):
        self.mesh, self.groups = mesh, DPGroups.of(mesh)
        self.compute_dtype = compute_dtype
        self.params = {k: FSDPParam(k, params[k].float(), self.groups, compute_dtype) for k in PARAMS}
        self.optimizer = adamw([p.shard for p in self.params.values()])
        self.placements = [Replicate(), DShard(0)] if "rep" in mesh.mesh_dim_names else [DShard(0)]
        self.step, self.microbatches = 0, 1  # of the current train_step, for the events

    def _unit(self, names: tuple[str, ...], fn, x: torch.Tensor) -> torch.Tensor:
        """Run ``fn(full params, x)`` with the unit's parameters gathered; autograd keeps no full
        weight, only a handle that gathers it again when the backward needs it."""
        params = [self.params[k] for k in names]
        full = {p.name: GatherParam.apply(p.shard, p) for p in params}
        by_storage = {full[p.name].untyped_storage().data_ptr(): p for p in params}

        def pack(t: torch.Tensor):
            p = by_storage.get(t.untyped_storage().data_ptr()) if t.numel() else None
            return t if p is None else (p, t.shape, t.stride(), t.storage_offset())

        def unpack(saved):
            if isinstance(saved, torch.Tensor):
                return saved
            p, shape, stride, offset = saved
            return p.gather().as_strided(shape, stride, offset)

        with saved_tensors_hooks(pack, unpack):
            y = fn(full, x)
        self._record(LAYERS.index(names), full, x, y)
        return y

    def _record(self, layer: int, full: dict, x: torch.Tensor, y: torch.Tensor) -> None:
        """Events for bisect: the weights a layer gathered, and its rows in and out. Those are per
        step, so they are recorded only when the step is one microbatch."""
        if not events.active():
            return
        events.record("weights", {}, full, layer=layer, step=self.step)
        if self.microbatches == 1:
            # row blocks in dp rank order; each rank's loss is a mean over its own rows
            rows = {name: Shard(0) for name in self.mesh.mesh_dim_names} | {"grad_scale": 1 / self.groups.world}
            batch = x.shape[0] * self.groups.world
            events.op("layer", {"x": (x, At((batch, *x.shape[1:]), **rows))},
                      {"y": (y, At((batch, *y.shape[1:]), **rows))}, layer=layer, step=self.step)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``reference.fsdp.forward``, one unit per layer."""
        x = x.to(self.compute_dtype)
        h = self._unit(LAYERS[0], lambda p, x: F.gelu(F.linear(x, p["w1"], p["b1"])), x)
        return self._unit(LAYERS[1], lambda p, h: F.linear(h, p["w2"], p["b2"]), h)

    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        for group in (self.groups.shard, self.groups.rep):
            if group_size(group) > 1:
                dist.all_reduce(t, group=group)
        return t

    def train_step(self, x: torch.Tensor, probe: torch.Tensor, microbatches: int, step: int = 0):
        """One optimizer step on this rank's rows ``x`` (split into microbatches); ``step`` names
        the events.

        Returns the global loss, the gradient norm before clipping and the gradient shards before
        clipping."""
        self.step, self.microbatches = step, microbatches
        rows = x.shape[0]
        loss = torch.zeros((), dtype=torch.float32)
        for i, (xm, pm) in enumerate(zip(x.chunk(microbatches), probe.chunk(microbatches))):
            for p in self.params.values():
                p.reduce_now = i == microbatches - 1
            mb_loss = probe_loss(self.forward(xm), pm, rows)  # a mean over this rank's rows
            mb_loss.backward()
            loss += mb_loss.detach()
        grads = {k: p.shard.grad.clone() for k, p in self.params.items()}
        norm = self.clip_grad_norm(MAX_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._dp_sum(loss) / self.groups.world, norm, grads

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm from the padded shards; scale the shards' gradients like
        ``torch.nn.utils.clip_grad_norm_``. Returns the norm before clipping."""
        squares = torch.stack([p.padded_grad.pow(2).sum() for p in self.params.values()]).sum()
        if group_size(self.groups.shard) > 1:
            dist.all_reduce(squares, group=self.groups.shard)
        norm = squares.sqrt()
        coef = (max_norm / (norm + CLIP_EPS)).clamp(max=1.0)
        for p in self.params.values():
            p.shard.grad.mul_(coef)
        return norm

    # ---- the sharded state, as DTensors, for torch.distributed.checkpoint --------------------
    def _dtensor(self, local: torch.Tensor, shape: tuple[int, ...]) -> DTensor:
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=torch.Size(shape),
                                  stride=stride)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Model and AdamW state as DTensors over the data-parallel mesh (see the module docstring).

        The DTensors share memory with the shards, so ``dcp.load`` into them loads in place; an
        optimizer that has not stepped yet gets zero moments and step 0 first."""
        state: dict[str, torch.Tensor] = {}
        for name, p in self.params.items():
            opt = self.optimizer.state[p.shard]
            if not opt:
                opt.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p.shard),
                           exp_avg_sq=torch.zeros_like(p.shard))
            state[f"model.{name}"] = self._dtensor(p.shard.detach(), p.full_shape)
            for key in ("exp_avg", "exp_avg_sq"):
                state[f"optim.{name}.{key}"] = self._dtensor(opt[key], p.full_shape)
            state[f"optim.{name}.step"] = opt["step"]
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a state of :meth:`state_dict`'s form (e.g. after ``dcp.load``) into the shards."""
        own = self.state_dict()
        missing = sorted(set(own) - set(state))
        if missing:
            raise KeyError(f"state has no {missing}")
        for key, target in own.items():
            value = state[key]
            local = value.to_local() if isinstance(value, DTensor) else value
            dest = target.to_local() if isinstance(target, DTensor) else target
            if local.shape != dest.shape:
                raise ValueError(f"{key}: local shard of shape {tuple(local.shape)}, this rank holds {tuple(dest.shape)}")
            dest.copy_(local)  # a no-op where dcp.load already wrote into the shard itself


def build(ctx: RankContext, cfg: Config, mesh: DeviceMesh | None = None) -> FSDP:
    """Our FSDP of ``cfg``'s problem on this rank, before any step, on ``mesh`` (a ``dp`` or
    ``(rep, shard)`` DeviceMesh; default the cell's own, ``ctx.device_mesh``)."""
    return FSDP(ctx.device_mesh if mesh is None else mesh, make_problem(cfg).params, MIXED[cfg.dtype])


def local_rows(t: torch.Tensor, groups: DPGroups) -> torch.Tensor:
    """This rank's block of a step's batch rows."""
    return take(t, Shard(0), groups.world, groups.index)


def step_pieces(step: int, loss, norm, grads: dict, shards: dict, opt_state: dict, full_shapes: dict,
                placement: dict) -> dict[str, Piece]:
    """One step's results as Pieces: ``placement`` says how a shard sits on the mesh."""
    def piece(t, shape):  # a copy: the shards and moments change in place at the next step
        return Piece.sharded(t.detach().clone(), shape, **placement)

    pieces = {step_name(step, "loss"): Piece.full(loss.clone()), step_name(step, "gradnorm"): Piece.full(norm.clone())}
    for name in PARAMS:
        shape = full_shapes[name]
        pieces[step_name(step, grad_name(name))] = piece(grads[name], shape)
        pieces[step_name(step, param_name(name))] = piece(shards[name], shape)
        for key in ("exp_avg", "exp_avg_sq"):
            pieces[step_name(step, state_name(key, name))] = piece(opt_state[name][key], shape)
    return pieces


def run(ctx: RankContext, cfg: Config) -> dict[str, Piece]:
    """Three FSDP/HSDP training steps on this rank; returns every step's pieces."""
    problem = make_problem(cfg)
    model = build(ctx, cfg)
    placement = {shard_dim(ctx.layout.names): Shard(0)}
    pieces: dict[str, Piece] = {}
    for k in range(STEPS):
        x, probe = (local_rows(t[k], model.groups) for t in (problem.x, problem.probe))
        loss, norm, grads = model.train_step(x, probe, cfg.size("m"), k + 1)
        shards = {n: p.shard.detach() for n, p in model.params.items()}
        opt = {n: model.optimizer.state[p.shard] for n, p in model.params.items()}
        full_shapes = {n: p.full_shape for n, p in model.params.items()}
        pieces |= step_pieces(k + 1, loss, norm, grads, shards, opt, full_shapes, placement)
    return pieces
