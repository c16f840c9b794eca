"""What a whole model's :class:`harness.registry.Component` names: each entry point takes the case
first and is bound to it by path (``"harness.model.tasks:run[mypkg.cases:CASE]"``,
:mod:`harness.paths`), so the rank processes import the case as they import an implementation.

``run`` is the rank task (a reshard cell's: its round trip); ``reference`` the one-process fp64
result and ``calibration`` the same in the cell's dtype (the rounding the tolerance allows);
``check``, ``check_impl``, ``reduction_size``, ``meshes`` and ``xfail`` the cell's plan and
tolerance, as a component declares them; ``space`` what exploration draws. Each runs the case's code
with the cell's own switches in place (:func:`harness.model.switches`).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from .. import events
from ..config import Config
from ..context import RankContext
from ..layout import MeshLayout, Piece, Shard, piece_index
from ..names import DENSE, NOT_JUDGED, parse
from ..registry import Space
from ..world import CellError, any_world
from . import cell, plan
from .batches import global_batch, start_model
from .case import ModelCase
from .draws import Draws, not_judged
from .hooks import Recorder, logical_shapes
from .placement import activation, declared_placements, piece_of
from .split import agree
from .train import OneProcess, OnRank, Trainer, state_of


def in_cell(entry: Callable) -> Callable:
    """``entry(case, ..., cfg)`` with ``cfg``'s switches of the case in place, on the rank's device
    where one of ``args`` is its ``RankContext`` (the reference's: the CPU)."""
    @functools.wraps(entry)
    def wrapped(case: ModelCase, *args):
        device = next((a.device for a in args if isinstance(a, RankContext)), torch.device("cpu"))
        with cell.configured(case, args[-1], device):
            return entry(case, *args)
    return wrapped


# ---- the rank task ----------------------------------------------------------------------------------
@in_cell
def run(case: ModelCase, ctx: RankContext, cfg: Config) -> dict[str, Piece]:
    """This rank's part of the cell; an exception raised inside a module names the module."""
    with cell.inside(ctx.scratch):
        return _run(case, ctx, cfg)


def _run(case: ModelCase, ctx: RankContext, cfg: Config) -> dict[str, Piece]:
    trip = plan.reshard_of(cfg)
    if trip is not None:
        return round_trip(case, ctx, cfg, trip)
    trainer = OnRank(case, ctx, cfg)
    try:
        return _train(trainer, case, cfg)
    except Exception as error:
        where = crashed_in(error, trainer.modules)
        if where is None:
            raise
        first = str(error).splitlines()[0] if str(error) else ""
        raise ModuleError(f"in module {where}: {type(error).__name__}: {first}") from error


def _train(trainer: OnRank, case: ModelCase, cfg: Config) -> dict[str, Piece]:
    trainer.recorder = _recorder(trainer, case, cfg) if events.active() else None
    pieces: dict[str, Piece] = {}
    with trainer.notes.watching():
        losses = trainer.train(range(cfg.size("steps")), lambda step, grads: gradients(trainer, step, grads, pieces))
    if trainer.recorder is not None:
        trainer.recorder.remove()
    pieces |= local_pieces(trainer, state_of(trainer.params, trainer.optimizer))
    return {name: Piece.full(loss) for name, loss in losses.items()} | held(trainer, pieces)


def gradients(trainer: OnRank, step: int, grads: dict[str, torch.Tensor], pieces: dict[str, Piece]) -> None:
    """After a step's backward, its gradients go into ``pieces`` (this rank's, :func:`local_pieces`);
    after step 1's, first, the cell fails on every rank if a dim split nothing (no verdict on numbers
    that one process computed on every rank)."""
    if step == 1:
        agree(trainer.notes, trainer.cfg.impl)
    pieces.update(local_pieces(trainer, grads))


def _recorder(trainer: OnRank, case: ModelCase, cfg: Config) -> Recorder:
    """Hooks on every submodule recording its events (bisect, a failing cell's diagnosis)."""
    batch_dims = {d: Shard(0) for d in ("rep", "dp") if trainer.degrees.get(d, 1) > 1}
    if case.seq_dim is not None and trainer.degrees.get("cp", 1) > 1:
        batch_dims["cp"] = Shard(case.seq_dim)
    whole = start_model(case, cfg)
    shapes = logical_shapes(whole, lambda: case.forward(whole, global_batch(case, 0)))
    s = trainer.spec
    # a rank's gradient of an activation, as the reference's: a mean over its own slice weighs each row
    # data-ranks times the global mean's weight; a share of the global loss already weighs it as that does
    grad_scale = 1.0 if trainer.shares else 1.0 / (s.rep * s.dp * s.cp)

    # a pipeline's modules run once per microbatch: the recorder joins a step's calls in their order
    judged = case.judge_plain_activations
    return Recorder(trainer.modules, lambda t, module, name: activation(
        t, trainer.degrees, batch_dims, shapes.get((module, name)), trainer.ours, plain=judged), grad_scale=grad_scale,
        microbatches=trainer.pipelined is not None, names=trainer.global_module_names())


def local_pieces(trainer: OnRank, tensors: dict[str, torch.Tensor]) -> dict[str, Piece]:
    """A rank's named parameter tensors (gradients, values, optimizer state) as pieces on the cell's
    mesh: DTensors by their placements, plain ones as ``ModelCase.placements`` declares."""
    local = {}
    for name, tensor in tensors.items():
        plain = None if isinstance(tensor, DTensor) else \
            declared_placements(parse(name).param, trainer.case.placements, trainer.degrees)
        local[name] = piece_of(tensor, trainer.degrees, plain, ours=trainer.ours)
    return local


def held(trainer: OnRank, local: dict[str, Piece]) -> dict[str, Piece]:
    """This rank's pieces, and where some ranks hold a name and others do not (a pipeline's stages,
    local experts), each name on every rank (:func:`_over_holders`, one collective for them all)."""
    return _over_holders(trainer, local) if trainer.spec.pp > 1 or trainer.local_names else local


def _over_holders(trainer: OnRank, local: dict[str, Piece]) -> dict[str, Piece]:
    """Every name some rank holds, on every rank: held on the mesh coordinates of the ranks that hold
    it (``Shard(0, on=...)`` per dim: a pipeline's stages over pp, a local expert's ranks over the
    dims ep is borrowed from), an empty piece elsewhere."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, {n: (pc.shape, pc.placements, pc.tensor.dtype) for n, pc in local.items()})
    layout = MeshLayout.of(trainer.cfg.mesh)
    out = {}
    for name in sorted(set().union(*every)):
        holders = [r for r, names in enumerate(every) if name in names]
        shape, placements, dtype = every[holders[0]][name]
        piece = Piece(local[name].tensor if name in local else None, shape,
                      dict(placements, **_held_on(name, holders, layout, placements)))
        if name not in local:
            size = tuple(len(i) for i in piece_index(piece, layout, trainer.ctx.rank))
            piece.tensor = torch.zeros(size, dtype=dtype)
        out[name] = piece
    return out


def _held_on(name: str, holders: list[int], layout: MeshLayout, placements: dict) -> dict[str, Shard]:
    """``Shard(0, on=coords)`` per mesh dim whose coordinates say which ranks hold ``name``: the
    ranks ``holders`` must be exactly those whose coordinates lie in the holders' on every dim."""
    on = {d: sorted({layout.coord(r, d) for r in holders}) for d, n in zip(layout.names, layout.shape) if n > 1}
    described = [r for r in range(layout.world) if all(layout.coord(r, d) in coords for d, coords in on.items())]
    partial = {d: coords for d, coords in on.items() if len(coords) < layout.shape[layout.names.index(d)]}
    if described != holders or set(partial) & set(placements):
        raise CellError(f"{name} is held by ranks {holders}, which no coordinates of the cell's mesh ({layout.id}) "
                        "describe: a parameter held by some ranks only must be held by every rank whose "
                        "coordinates on each dim are among the holders'")
    return {d: Shard(0, on=tuple(coords)) for d, coords in partial.items()}


class ModuleError(RuntimeError):
    """A rank's exception, with the innermost module of the model it was raised in."""


def crashed_in(error: BaseException, modules: list[nn.Module]) -> str | None:
    """The qualified name of the innermost module of ``modules`` whose ``forward`` (or a function
    it called) raised ``error``: read from the traceback's frames, so it costs nothing until then."""
    names = {id(m): name for root in modules for name, m in root.named_modules() if name}
    found, tb = None, error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    return found


# ---- the reshard round trip ---------------------------------------------------------------------------
def round_trip(case: ModelCase, ctx: RankContext, cfg: Config, trip: plan.Reshard) -> dict[str, Piece]:
    """Train to the save step, save with DCP over the cell's ranks, load under the load layout (or
    on rank 0 alone) and train to the end; the results are those of the run that never stopped, the
    reloaded state as full tensors (so the two layouts' placements never need to agree)."""
    path = os.path.join(ctx.scratch, "paritytest-checkpoint")
    saver = OnRank(case, ctx, cfg)
    grads: dict[str, Piece] = {}
    with saver.notes.watching():
        losses = saver.train(range(trip.save_step), lambda step, step_grads: gradients(saver, step, step_grads, grads))
    pieces = held(saver, grads) | {name: Piece.full(loss) for name, loss in losses.items()}
    cell = ctx.mesh(plan.ranks_of(cfg.world)).get_group()  # the cell's ranks (the pool may have more)
    model_sd, optim_sd = get_state_dict(saver.modules[0], saver.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=cell)
    dist.barrier(group=cell)  # every shard is on disk before any rank reads

    rest = range(trip.save_step, cfg.size("steps"))
    result = None
    if trip.load is None:
        if ctx.rank == 0:
            try:  # a checkpoint that does not load must fail the cell, not leave the others waiting
                whole = OneProcess(case, cfg, reference=False)
                _load(whole.model, whole.optimizer, path, None)
                result = _resumed(whole, rest)
            except BaseException as error:  # noqa: BLE001  (DCP raises CheckpointException, a BaseException)
                result = f"{type(error).__name__}: {error}"
    elif ctx.rank < trip.load.world:
        loader = OnRank(case, dataclasses.replace(ctx, layout=MeshLayout.of(trip.load.mesh)), trip.load)
        _load(loader.modules[0], loader.optimizer, path, ctx.mesh(plan.ranks_of(trip.load.world)).get_group())
        result = _resumed(loader, rest)
    box = [result]
    dist.broadcast_object_list(box, group=cell, group_src=0)  # rank 0's results on every rank of the cell
    if isinstance(box[0], str):
        raise RuntimeError(f"{cfg.id}: the checkpoint saved on {cfg.mesh} did not load on one process: {box[0]}")
    return pieces | {name: Piece.full(t) for name, t in box[0].items()}


def _load(model: nn.Module, optimizer, path: str, group) -> None:
    """Load model and optimizer state saved by DCP (``group`` None: this process alone)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if group is None:
        dcp.load(state, checkpoint_id=path, no_dist=True)
    else:
        dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _resumed(trainer: Trainer, steps: range) -> dict[str, torch.Tensor]:
    """The remaining steps' losses and gradients and the final state as full tensors (a collective
    for DTensors)."""
    grads: dict[str, torch.Tensor] = {}
    losses = {name: loss.cpu() for name, loss in
              trainer.train(steps, lambda _, step_grads: grads.update({n: _full(g) for n, g in step_grads.items()})).items()}
    return losses | grads | {name: _full(t) for name, t in state_of(trainer.params, trainer.optimizer).items()}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


# ---- the plan, the reference, the tolerance ---------------------------------------------------------
@in_cell
def reference(case: ModelCase, cfg: Config) -> dict[str, torch.Tensor]:
    """``loss/step<k>``, ``grad/<p>`` (step 1) and ``step<k>/grad/<p>`` (each later step),
    ``param/<p>`` and ``opt/<state>/<p>`` (after the last step) of the same model on one process in
    fp64, trained on the whole global batch of every step; ``{NOT_JUDGED: why}`` instead when it
    draws random numbers (:mod:`harness.model.draws`).

    A model whose fp64 run fails on fp64 is run again with each op that fails on inputs mixing fp32
    and fp64 computed in fp32, as the model asks (:class:`harness.model.train.Fp32Ops`): only such a
    model pays for the second run and the op-by-op dispatch."""
    first = None
    for mixed in (False, True):
        trainer = OneProcess(case, cfg, mixed=mixed)
        trainer.recorder = Recorder([trainer.model]) if events.active() else None
        trainer.draws = drawn = Draws(trainer.model)
        try:
            result = _trained(trainer, cfg)
            break
        except (RuntimeError, NotImplementedError) as error:
            if trainer.recorder is not None:
                trainer.recorder.remove()
            if "double" not in str(error).lower():  # "no kernel for Double", "float != double"
                raise
            if first is not None:  # no mixing to blame: a kernel with no fp64 (fp32_ops) or another failure
                raise CellError(_no_fp64(case, first[0], first[1])) from first[1]
            first = (trainer, error)
    if trainer.recorder is not None:
        trainer.recorder.remove()
    if drawn.drew:  # no parallel run draws these numbers as one process does: nothing to compare
        return {NOT_JUDGED: _random(case, cfg, mixed)}
    return result


@in_cell
def calibration(case: ModelCase, cfg: Config) -> dict[str, torch.Tensor]:
    """The results of :func:`reference`, of the same model on one process in the cell's dtype (as a
    cell starts it: its rounded start, its autocast or low-precision parameters): how far right code
    lies from fp64 by rounding alone (:mod:`harness.compare.tolerance`)."""
    trainer = OneProcess(case, cfg, reference=False)
    trainer.recorder = Recorder([trainer.model]) if events.active() else None  # localisation's calibration
    result = _trained(trainer, cfg)
    if trainer.recorder is not None:
        trainer.recorder.remove()
    return result


def _trained(trainer: OneProcess, cfg: Config) -> dict[str, torch.Tensor]:
    """The cell's steps on one process: each step's loss and gradients, the final state."""
    result: dict[str, torch.Tensor] = {}
    result |= trainer.train(range(cfg.size("steps")),
                            lambda _, grads: result.update({n: g.detach().clone() for n, g in grads.items()}))
    return result | {name: t.detach().clone() for name, t in state_of(trainer.params, trainer.optimizer).items()}


def _random(case: ModelCase, cfg: Config, mixed: bool) -> str:
    """What to say when the reference drew random numbers: its steps again, from the start, noting
    each op that draws and the module it runs in."""
    trainer = OneProcess(case, cfg, mixed=mixed)
    trainer.draws = watched = Draws(trainer.model, watch=True)
    trainer.train(range(cfg.size("steps")))
    return not_judged(trainer.model, watched.found)


def _no_fp64(case: ModelCase, trainer: OneProcess, error: BaseException) -> str:
    """What to say when the fp64 reference met a kernel with no fp64 implementation: the op (found by
    one more forward that notes each op it dispatches), the module, and the fix."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LastOp(TorchDispatchMode):
        name = "?"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            LastOp.name = func.overloadpacket.__name__
            return func(*args, **(kwargs or {}))

    model, batch = trainer.model, trainer.batch(0)
    try:
        with LastOp():
            case.loss(case.forward(model, batch), batch).backward()
    except (RuntimeError, NotImplementedError):
        pass
    module = crashed_in(error, [model])
    first = str(error).strip().splitlines()[0]
    return (f"the fp64 reference failed in {'module ' + module if module else 'the model'}: aten.{LastOp.name} has "
            f"no float64 kernel here ({first}); run it from its fp32 kernel in the reference: "
            f"ModelCase(fp32_ops=({LastOp.name!r},)) (what such a reference certifies: harness.compare.tolerance)")


@in_cell
def check(case: ModelCase, cfg: Config) -> None:
    """The rules every model cell obeys (:func:`harness.model.plan.check`)."""
    plan.check(case, cfg)


@in_cell
def check_impl(case: ModelCase, cfg: Config) -> None:
    """The meshes ``cfg.impl`` supports (``ModelCase.supports``)."""
    plan.check_impl(case, cfg)


def meshes(case: ModelCase, cfg: Config) -> list:
    """What the ranks build besides the cell's mesh (:func:`harness.model.plan.meshes`)."""
    return plan.meshes(cfg)


@in_cell
def xfail(case: ModelCase, cfg: Config) -> str | None:
    """Why ``cfg`` is known to diverge upstream (``ModelCase.xfail``), or None."""
    known = case.xfail.get(cfg.impl)
    return known(cfg) if known else None


_sizes: dict[tuple, int] = {}


@in_cell
def reduction_size(case: ModelCase, cfg: Config) -> int:
    """The ``n`` of the tolerance policy for a model: ``case.reduction`` when given, else the larger
    of the largest fan-in of any ``nn.Linear`` (the terms a forward dot product adds) and the
    tokens of a global batch (the terms a parameter's gradient and a mean loss add: the elements of
    ``batch["input"]`` for integer ids, its rows times sequence otherwise, i.e. all dims but the last)."""
    if case.reduction is not None:
        return int(case.reduction)
    key = (cfg.component, cfg.seed, tuple(sorted(cell.switches().items())))
    if key not in _sizes:
        with any_world():  # the parent's call into the case's code: it may read the world
            model, batch = start_model(case, cfg), global_batch(case, 0)
        fan_in = max((m.in_features for m in model.modules() if isinstance(m, nn.Linear)), default=1)
        first = batch.get("input", next(iter(batch.values())))
        tokens = first.numel() if not first.is_floating_point() else first.numel() // max(1, first.shape[-1])
        _sizes[key] = max(fan_in, tokens)
    return _sizes[key]


def space(case: ModelCase) -> Space:
    """What exploration draws for a model: meshes over its dense dims in their order (the cell's
    rules keep what the case supports), fp32 and bf16, one to three steps, and the case's own
    switches (with the mesh dims each acts with)."""
    return Space(dims=DENSE, sizes={"steps": (1, 3)}, switches=dict(case.switches), ordered=True, only_these=True,
                 acts_with=dict(case.acts_with), mesh_decides=True)
