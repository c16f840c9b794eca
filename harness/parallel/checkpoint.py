"""Checkpoint reshard round trips: save under one layout with torch.distributed.checkpoint, load under
another, check, and take one more step.

Read beside ``reference/checkpoint.py``, where the whole round trip is the identity between two
AdamW steps. Here one cell is an ordered pair of layouts (switches ``save`` and ``load``):

    fsdp<n>          FSDP2 ``fully_shard`` over a ``dp=n`` mesh                (dim-0 shards, uneven)
    hsdp<r>x<s>      FSDP2 over a ``rep=r, shard=s`` mesh: replicate x shard
    fsdptp<d>x<t>    DTensor ``parallelize_module`` over ``tp=t`` (w1 column-, w2 row-parallel),
                     then ``fully_shard`` over ``dp=d``
    ours<n>          our FSDP (harness/parallel/fsdp.py) over ``dp=n``
    ourshsdp<r>x<s>  our HSDP over ``rep=r, shard=s``

The cell's mesh is ``w=<the larger world>``; the two layout meshes are declared through
``meshes(cfg)`` and fetched with ``ctx.mesh``. Ranks outside a layout sit its phase out: every DCP
collective runs on the layout's own whole group (``w=<its world>``), never on the default group.
FSDP2 pairs save PyTorch's own ``get_state_dict``; a pair with our FSDP on one side saves our
FSDP's keys (``model.w1``, ``optim.w1.exp_avg``, ...), which both sides can give and take.

1. save side: step 1 on batch 1, ``checkpoint_io.save`` into ``ctx.scratch``, note the full state
   (what was saved), then step 2 on the old layout.
2. load side: a different target state (other parameters, two steps on other batches);
   ``checkpoint_io.load``; every tensor a rank holds must have changed; the full state must equal
   the saved one bit for bit; then step 2 on the new layout, which must equal step 2 on the old
   layout within the tolerance policy.

The checks run last (the bit and step checks on rank 0, which is in every layout), so a failure is
a clear error and never leaves a rank waiting in a collective. The results (state after load, the
resumed step and the state after it) are full tensors, compared with the reference by the harness
like any other cell.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from harness import events
from harness.compare.tolerance import Tolerances
from harness.config import Config, ConfigError
from harness.context import RankContext
from harness.layout import Piece, Shard, take
from harness.names import param_name, state_name
from reference.checkpoint import MOMENTS, PARAMS, make_problem, reduction_size
from reference.common import probe_loss

from . import checkpoint_io
from .fsdp import FSDP
from .optim import shardwise_adamw

# module parameter -> the reference's name
NAMES = {"w1.weight": "w1", "w1.bias": "b1", "w2.weight": "w2", "w2.bias": "b2"}
FORMS = ("fsdp<n>", "hsdp<r>x<s>", "fsdptp<d>x<t>", "ours<n>", "ourshsdp<r>x<s>")
PATTERNS = {  # kind -> (pattern, mesh dim names); the HSDP meshes are the ones harness/parallel/fsdp.py reads
    "fsdp": (r"fsdp(\d+)", ("dp",)),
    "hsdp": (r"hsdp(\d+)x(\d+)", ("rep", "shard")),
    "fsdptp": (r"fsdptp(\d+)x(\d+)", ("dp", "tp")),
    "ours": (r"ours(\d+)", ("dp",)),
    "ourshsdp": (r"ourshsdp(\d+)x(\d+)", ("rep", "shard")),
}


@dataclass(frozen=True)
class Layout:
    """One way of holding the model: who holds it (FSDP2 or our FSDP) and on which mesh."""

    text: str
    kind: str  # a key of PATTERNS
    dims: tuple[tuple[str, int], ...]

    @property
    def world(self) -> int:
        return math.prod(d for _, d in self.dims)

    @property
    def whole(self) -> tuple[tuple[str, int], ...]:
        """A 1-D mesh over the layout's ranks: DCP's process group."""
        return (("w", self.world),)

    @property
    def ours(self) -> bool:
        return self.kind.startswith("ours")

    @property
    def data_parallel(self) -> int:
        """Ranks the batch is split over: all but tp."""
        return math.prod(d for n, d in self.dims if n != "tp")


def parse_layout(text: str) -> Layout:
    for kind, (pattern, names) in PATTERNS.items():
        if m := re.fullmatch(pattern, text):
            return Layout(text, kind, tuple(zip(names, map(int, m.groups()))))
    raise ConfigError(f"checkpoint layout {text!r} is not one of {', '.join(FORMS)} "
                      "(e.g. fsdp4, hsdp2x4, fsdptp2x2, ours3)")


def layouts(cfg: Config) -> tuple[Layout, Layout]:
    return parse_layout(cfg.switch("save")), parse_layout(cfg.switch("load"))


def state_format(cfg: Config) -> str:
    """``torch``: FSDP2's ``get_state_dict`` keys; ``flat``: harness/parallel/fsdp.py's keys, which both sides
    can give, for a cell with our FSDP on one side."""
    return "flat" if any(layout.ours for layout in layouts(cfg)) else "torch"


def validate(cfg: Config) -> None:
    """Rules of the checkpoint component, checked before any rank runs."""
    save, load = layouts(cfg)
    for layout in (save, load):
        if any(d < 1 for _, d in layout.dims):
            raise ConfigError(f"checkpoint layout {layout.text}: every degree must be at least 1")
        dp = layout.data_parallel
        if cfg.size("b") % dp:
            raise ConfigError(f"layout {layout.text} splits the batch b={cfg.size('b')} over {dp} data-parallel ranks: "
                              f"choose b a multiple of {dp} (gradients are averaged, so the shards must be equal)")
        if layout.kind == "fsdptp" and cfg.size("f") % layout.dims[1][1]:
            raise ConfigError(f"layout {layout.text}: tp={layout.dims[1][1]} does not divide f={cfg.size('f')}: "
                              "choose f a multiple of tp (DTensor TP here assumes even tp shards)")
    if cfg.dtype != "fp32" and state_format(cfg) == "flat":
        raise ConfigError(f"{cfg.id}: cells with our FSDP run in fp32 (its bf16 mode is mixed precision with fp32 "
                          "master weights, FSDP2 here keeps bf16 parameters): use dtype fp32")
    world = max(save.world, load.world)
    if cfg.mesh != (("w", world),):
        raise ConfigError(f"{cfg.id}: a checkpoint cell's mesh is the larger layout's world, w={world}, "
                          f"not {','.join(f'{n}={d}' for n, d in cfg.mesh)}")


def meshes(cfg: Config) -> list[tuple[tuple[str, int], ...]]:
    """The two layouts' meshes and the whole group of each (for DCP), besides the cell's ``w`` mesh."""
    out = []
    for layout in layouts(cfg):
        for dims in (layout.dims, layout.whole):
            if dims != cfg.mesh and dims not in out:
                out.append(dims)
    return out


class MLP(nn.Module):
    """``reference.checkpoint.forward`` as modules, so FSDP2 and a TP plan can name its parts."""

    def __init__(self, p: dict[str, torch.Tensor]):
        super().__init__()
        self.w1 = nn.Linear(p["w1"].shape[1], p["w1"].shape[0], dtype=p["w1"].dtype)
        self.w2 = nn.Linear(p["w2"].shape[1], p["w2"].shape[0], dtype=p["w2"].dtype)
        with torch.no_grad():
            for module, name in NAMES.items():
                self.get_parameter(module).copy_(p[name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


Placement = tuple  # per tensor: (name, local shape, global offset, global shape, dtype)


def placement_of(tensors: dict[str, torch.Tensor]) -> list[Placement]:
    """Where this rank's local pieces sit, as DTensor computes it (and as DCP writes them)."""
    out = []
    for name, t in tensors.items():
        local = _local(t)
        offset = (0,) * t.dim()
        if isinstance(t, DTensor):
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            if tuple(local.shape) != tuple(shape):
                raise RuntimeError(f"{name}: local shard {tuple(local.shape)} is not the {tuple(shape)} its placements give")
        out.append((name, tuple(local.shape), tuple(offset), tuple(t.shape), t.dtype))
    return out


def full_tensors(tensors: dict[str, torch.Tensor], group, placements: list[list[Placement]]) -> dict[str, torch.Tensor]:
    """The full tensors of many DTensors in one all-gather over ``group`` (every rank of their mesh).

    ``full_tensor()`` costs one all-gather per tensor, and ``all_gather_object`` pickles tensors; a
    cell takes four snapshots of 16 tensors. Here each rank sends its local pieces as one fp64
    buffer (exact for every float dtype), and every rank places every rank's pieces by
    ``placements`` (every rank's :func:`placement_of`, gathered once). Each element must be covered,
    and replicas (HSDP's replicate dim, tp copies of a bias) must agree bit for bit.
    ``tests/test_checkpoint_faults`` holds this against ``full_tensor()`` on every layout.
    """
    mine = torch.cat([_local(t).detach().reshape(-1).double() for t in tensors.values()])
    sizes = [sum(math.prod(shape) for _, shape, *_ in rank) for rank in placements]
    wire = torch.zeros(max(sizes), dtype=torch.float64)
    wire[: mine.numel()] = mine
    parts = [torch.empty_like(wire) for _ in sizes]
    dist.all_gather(parts, wire, group=group)
    full = {name: torch.empty(shape, dtype=dtype) for name, _, _, shape, dtype in placements[0]}
    seen = {name: torch.zeros(t.shape, dtype=torch.bool) for name, t in full.items()}
    for rank, (part, layout) in enumerate(zip(parts, placements)):
        start = 0
        for name, local_shape, offset, _, _ in layout:
            n = math.prod(local_shape)
            local = part[start:start + n].view(local_shape).to(full[name].dtype)
            start += n
            where = tuple(slice(o, o + k) for o, k in zip(offset, local_shape))
            held = seen[name][where]
            if held.any() and not torch.equal(full[name][where][held], local[held]):
                raise RuntimeError(f"{name}: replicas disagree (rank {rank} of the layout)")
            full[name][where], seen[name][where] = local, True
    for name, covered in seen.items():
        if not covered.all():
            raise RuntimeError(f"{name}: {int((~covered).sum())} elements are held by no rank")
    return full


def flat_key(name: str) -> str:
    """harness/parallel/fsdp.py's state key of a result name: ``param/w1`` -> ``model.w1``,
    ``opt/exp_avg/w1`` -> ``optim.w1.exp_avg``."""
    parts = name.split("/")
    return f"model.{parts[1]}" if parts[0] == "param" else f"optim.{parts[2]}.{parts[1]}"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Side:
    """The model and AdamW held under one layout: a training step, save, load, and its full state."""

    optimizer: torch.optim.Optimizer

    def __init__(self, ctx: RankContext, layout: Layout, fmt: str):
        self.layout, self.fmt = layout, fmt
        self._placements: list | None = None
        self.mesh = ctx.mesh(layout.dims)
        self.group = ctx.mesh(layout.whole).get_group("w")
        coords = dict(zip(self.mesh.mesh_dim_names, self.mesh.get_coordinate()))
        self.dp_index = 0  # this rank's block of the batch: row-major over the data-parallel dims
        for name, degree in layout.dims:
            if name != "tp":
                self.dp_index = self.dp_index * degree + coords[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        """The live state by result name (``param/w1``, ``opt/exp_avg/w1``, ``opt/step/w1``): DTensors
        for what is sharded."""
        raise NotImplementedError

    def step(self, x: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
        """One AdamW step on this rank's batch block; returns the loss over the whole batch."""
        x, probe = (take(t, Shard(0), self.layout.data_parallel, self.dp_index) for t in (x, probe))
        # both FSDPs average gradients over the data-parallel ranks: each normalises by its own rows
        loss = probe_loss(self.forward(x), probe, x.shape[0])
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total, group=self.group)  # tp ranks hold equal copies: the mean is still right
        return total / self.layout.world

    def state_dict(self) -> dict:
        """The state to save, or the template to load into (in :attr:`fmt`)."""
        return {flat_key(name): t for name, t in self.tensors().items()}

    def apply(self, loaded: dict) -> None:
        """Take over a state loaded into a copy of :meth:`state_dict`."""
        raise NotImplementedError

    def save(self, path: str) -> None:
        checkpoint_io.save(self.state_dict(), path, self.group)

    def load(self, path: str) -> None:
        self.apply(checkpoint_io.load(self.state_dict(), path, self.group))

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter, AdamW moment and step count as a full tensor (a collective on the layout)."""
        tensors = self.tensors()
        if self._placements is None:  # shards do not move: every rank's placement, gathered once
            self._placements = [None] * self.layout.world
            dist.all_gather_object(self._placements, placement_of(tensors), group=self.group)
        return full_tensors(tensors, self.group, self._placements)


class FSDP2Side(Side):
    """FSDP2 ``fully_shard`` over dp (1-D) or rep x shard (2-D: HSDP); for fsdptp, DTensor TP first."""

    def __init__(self, ctx: RankContext, layout: Layout, fmt: str, params: dict[str, torch.Tensor]):
        super().__init__(ctx, layout, fmt)
        self.model = MLP(params)
        if layout.kind == "fsdptp":
            parallelize_module(self.model, self.mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
            fully_shard(self.model, mesh=self.mesh["dp"])
        else:
            fully_shard(self.model, mesh=self.mesh)
        self.optimizer = shardwise_adamw(list(self.model.parameters()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for module_name, p in self.model.named_parameters():
            name = NAMES[module_name]
            out[param_name(name)] = p
            for key in (*MOMENTS, "step"):
                out[state_name(key, name)] = self.optimizer.state[p][key]
        return out

    def state_dict(self) -> dict:
        if self.fmt == "flat":
            return super().state_dict()
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optimizer}

    def apply(self, loaded: dict) -> None:
        if self.fmt == "torch":
            set_state_dict(self.model, self.optimizer, model_state_dict=loaded["model"],
                           optim_state_dict=loaded["optim"])
            return
        with torch.no_grad():
            for name, live in self.tensors().items():
                _local(live).copy_(_local(loaded[flat_key(name)]))


class OursSide(Side):
    """harness/parallel/fsdp.py's FSDP (or HSDP) on the layout's mesh; its own ``state_dict``/``load_state_dict``."""

    def __init__(self, ctx: RankContext, layout: Layout, fmt: str, params: dict[str, torch.Tensor]):
        super().__init__(ctx, layout, fmt)
        self.fsdp = FSDP(self.mesh, params, torch.float32)  # on the layout's declared mesh
        self.optimizer = self.fsdp.optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fsdp.forward(x)

    def tensors(self) -> dict[str, torch.Tensor]:
        state = self.fsdp.state_dict()
        out = {}
        for name in PARAMS:
            out[param_name(name)] = state[f"model.{name}"]
            for key in (*MOMENTS, "step"):
                out[state_name(key, name)] = state[f"optim.{name}.{key}"]
        return out

    def state_dict(self) -> dict:
        return self.fsdp.state_dict()

    def apply(self, loaded: dict) -> None:
        self.fsdp.load_state_dict(loaded)


def side(ctx: RankContext, layout: Layout, cfg: Config, params: dict[str, torch.Tensor]) -> Side:
    kind = OursSide if layout.ours else FSDP2Side
    return kind(ctx, layout, state_format(cfg), params)


class RoundTripError(AssertionError):
    """The load did not restore the saved state, or the resumed step left the old layout's result."""


def check(cfg: Config, saved: dict, loaded: dict, old: dict, resumed: dict) -> None:
    """On rank 0: the load restored every bit of the saved state, and the resumed step agrees with
    that step taken on the old layout within the tolerance policy."""
    save, load = (layout.text for layout in layouts(cfg))
    for k in saved:
        if loaded[k].dtype != saved[k].dtype or not torch.equal(loaded[k], saved[k]):
            diff = (loaded[k].double() - saved[k].double()).abs()
            worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.dim() else ()
            raise RoundTripError(f"{k} loaded under {load} differs from the one saved under {save}: "
                                 f"{int((diff > 0).sum())}/{diff.numel()} elements, worst at {worst}: "
                                 f"{float(loaded[k].flatten()[diff.argmax()]):.6g} vs {float(saved[k].flatten()[diff.argmax()]):.6g}")
    tol = Tolerances(cfg.dtype, reduction_size(cfg))
    for k in old:
        name = f"resumed/{k}"
        err = (resumed[k].double() - old[k].double()).abs()
        allowed = tol.get(name).allowed(old[k].double())
        if (err > allowed).any():
            i = int((err / allowed).flatten().argmax())
            raise RoundTripError(f"{k} after the resumed step under {load} differs from that step under {save}: "
                                 f"{float(resumed[k].flatten()[i]):.6g} vs {float(old[k].flatten()[i]):.6g} "
                                 f"at flat index {i}, beyond {tol.get(name)}")


def as_events(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state under the reference's event names (``state/param/w1``), step counts left out."""
    return {f"state/{k}": t for k, t in full.items() if k.startswith(("param/", "opt/exp_avg"))}


def run(ctx: RankContext, cfg: Config) -> dict[str, Piece]:
    save, load = layouts(cfg)
    problem = make_problem(cfg)
    path = os.path.join(ctx.scratch, "checkpoint")
    if ctx.rank < save.world:
        held = side(ctx, save, cfg, problem.params)
        held.step(*problem.batches[0])
        held.save(path)
        saved = held.full_state()
        events.record("checkpoint", {}, as_events(saved), phase="save")
        old_loss = held.step(*problem.batches[1])
        old = held.full_state() | {"loss": old_loss}
    # the load side reads what the coordinator of the save side wrote: all of it must be there
    dist.barrier(group=ctx.group("w"))
    result, unchanged = None, []
    if ctx.rank < load.world:
        held = side(ctx, load, cfg, problem.target_params)
        for batch in problem.target_batches:  # two steps: the step count differs from the saved one too
            held.step(*batch)
        before = {k: _local(t).clone() for k, t in held.tensors().items()}
        held.load(path)
        # every tensor this rank holds must change: the target's state differed from the saved one
        unchanged = [k for k, t in held.tensors().items() if _local(t).numel() and torch.equal(_local(t), before[k])]
        loaded = held.full_state()
        events.record("checkpoint", {}, as_events(loaded), phase="load")
        loss = held.step(*problem.batches[1])
        resumed = held.full_state() | {"loss": loss}
        events.record("checkpoint", {}, as_events(resumed), phase="resume")
        result = {f"loaded/{k}": v for k, v in loaded.items()} | {f"resumed/{k}": v for k, v in resumed.items()}
        result = {k: v for k, v in result.items() if "/opt/step/" not in k}
    if load.world < ctx.layout.world:  # ranks outside the load layout return rank 0's copy
        box = [result]
        dist.broadcast_object_list(box, src=0, group=ctx.group("w"))
        result = box[0]
    # checks last, so that a failing one is a clear error and never leaves a rank waiting
    if unchanged:
        raise RoundTripError(f"rank {ctx.rank}: loading did not change {unchanged}: the {load.text} target already "
                             "held the saved values, so the round trip proves nothing for them")
    if ctx.rank == 0:
        check(cfg, saved, loaded, old, resumed)
    return {name: Piece.full(t) for name, t in result.items()}
