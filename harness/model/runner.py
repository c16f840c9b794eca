"""The rank side of a model cell: build, parallelize with the user's function, train, report pieces.

On every rank of the cell's mesh: the model from the harness's seed and the cell's dtype-rounded
start (:func:`harness.model.batches.start_model`), ``parallelize(model, meshes)``, then ``steps``
optimizer steps on this rank's slice of each global batch (dim 0 over rep·dp, ``seq_dim`` over
cp). Pieces returned (names as :mod:`harness.model` documents): the global loss of every step, the
gradients at step 1, the parameters and optimizer state after the last step. A pipelined model's
parameter lives on the stages that hold it (``Shard(on=...)`` over pp); a tied parameter held by
two stages is checked on both.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .. import events
from ..compare.tolerance import TORCH_DTYPE
from ..layout import MeshLayout, Piece, Shard, piece_index
from .batches import as_dtype, global_batch, local_batch, start_model
from .case import ModelCase, Pipelined
from .hooks import Recorder, logical_shapes
from .pieces import declared, describe
from .rules import ORDER, SHORT
from .rules import meshes as mesh_dims
from .rules import spec as spec_of


def loss_name(step: int) -> str:
    return f"loss/step{step}"


def aliases(model: nn.Module) -> dict[str, str]:
    """Every parameter name (tied ones included) -> the name the reference reports it under."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def autocast(case: ModelCase, cfg, device: torch.device):
    """The forward's context: autocast to the cell's dtype for ``mixed_precision="autocast"``."""
    if cfg.dtype in ("bf16", "fp16") and case.mixed_precision == "autocast":
        return torch.autocast(device.type, dtype=TORCH_DTYPE[cfg.dtype])
    return contextlib.nullcontext()


def scalar(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain fp64 scalar (a replicated DTensor from loss_parallel included)."""
    loss = loss.detach()
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).double().reshape(())


class Trainer:
    """One rank's model, optimizer and step loop."""

    def __init__(self, case: ModelCase, ctx, cfg):
        self.case, self.ctx, self.cfg = case, ctx, cfg
        self.spec = spec_of(cfg)
        self.meshes = ctx.extra_meshes[mesh_dims(cfg)[0]]
        self.degrees = dict(cfg.mesh)
        model = start_model(case, cfg).to(ctx.device)
        self.alias = aliases(model)
        made = case.parallelize[cfg.impl](model, self.meshes)
        self.pipelined = made if isinstance(made, Pipelined) else None
        if self.pipelined is None and not isinstance(made, nn.Module):
            raise TypeError(f"parallelize[{cfg.impl!r}] returned {type(made).__name__}: return the module, "
                            "or harness.model.Pipelined(stages, schedule) for a pipelined model")
        self.modules = self.pipelined.modules if self.pipelined else [made]
        self.params = self._params()
        self.optimizer = case.optimizer([p for _, p in self.params])

    def _params(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under the reference's names, sorted (every rank of a stage's mesh
        visits them in the same order: the fallback gather is a collective)."""
        seen, out = set(), []
        for module in self.modules:
            for name, p in module.named_parameters(remove_duplicate=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if name not in self.alias:
                    raise KeyError(f"parallelize[{self.cfg.impl!r}] made a parameter {name!r} the model does not "
                                   "have: keep the model's parameter names (wrap, shard or delete modules in place)")
                out.append((self.alias[name], p))
        return sorted(out, key=lambda item: item[0])

    # ---- data ----------------------------------------------------------------------------------
    def batch(self, step: int) -> dict[str, torch.Tensor]:
        ctx, s = self.ctx, self.spec
        data = (s.rep * s.dp, ctx.coord("rep") * s.dp + ctx.coord("dp"))
        local = local_batch(global_batch(self.case, step), self.case.seq_dim, data, (s.cp, ctx.coord("cp")))
        dtype = TORCH_DTYPE[self.cfg.dtype] if self.case.mixed_precision == "bf16" and self.cfg.dtype != "fp32" \
            else torch.float32
        return {k: t.to(self.ctx.device) for k, t in as_dtype(local, dtype).items()}

    # ---- one step ------------------------------------------------------------------------------
    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward, loss, backward; the global loss (fp64 scalar, the same on every rank)."""
        if self.pipelined:
            loss = self._pipeline_step(batch)
        else:
            with autocast(self.case, self.cfg, self.ctx.device):
                output = self.case.forward(self.modules[0], batch)
            parallel_loss = isinstance(output, DTensor) or (isinstance(output, tuple) and any(
                isinstance(o, DTensor) for o in output))
            with _loss_parallel() if parallel_loss else contextlib.nullcontext():
                with autocast(self.case, self.cfg, self.ctx.device):
                    loss = self.case.loss(output, batch)
                loss.backward()
            loss = scalar(loss)
        group = self.meshes.group("loss")
        dist.all_reduce(loss, group=group)
        return loss / dist.get_world_size(group)

    def _pipeline_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        p = self.pipelined
        first = any(stage.is_first for stage in p.stages)
        last = any(stage.is_last for stage in p.stages)
        losses: list[torch.Tensor] = []
        args = (batch[p.input],) if first else ()
        with autocast(self.case, self.cfg, self.ctx.device):
            p.schedule.step(*args, target=batch[p.target] if last else None, losses=losses if last else None)
        loss = torch.stack([scalar(x) for x in losses]).mean() if last else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(loss, group=self.meshes.group("pp"))  # the last stage's, on every stage
        return loss

    # ---- pieces --------------------------------------------------------------------------------
    def pieces(self, which: str) -> dict[str, Piece]:
        """``grad``: every parameter's gradient; ``state``: every parameter and its optimizer state."""
        from reference.common import grad_name, param_name, state_name

        local: dict[str, Piece] = {}
        for name, p in self.params:
            plain = declared(name, self.case.placements, self.degrees) if not isinstance(p, DTensor) else None
            if which == "grad":
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                local[grad_name(name)] = describe(grad, self.degrees, plain)
                continue
            local[param_name(name)] = describe(p.detach(), self.degrees, plain)
            for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor) and value.shape == p.shape:
                    local[state_name(key, name)] = describe(value, self.degrees, plain)
        return self._over_stages(local) if self.spec.pp > 1 else local

    def _over_stages(self, local: dict[str, Piece]) -> dict[str, Piece]:
        """Every name any stage holds, on every rank: held on the pp coordinates that hold it
        (``Shard(0, on=...)``), an empty piece elsewhere."""
        held = [None] * self.spec.pp
        mine = {n: (pc.shape, pc.placements, pc.tensor.dtype) for n, pc in local.items()}
        dist.all_gather_object(held, (self.ctx.coord("pp"), mine), group=self.meshes.group("pp"))
        layout = MeshLayout.of(self.cfg.mesh)
        out = {}
        for name in sorted({n for _, names in held for n in names}):
            coords = tuple(sorted(c for c, names in held if name in names))
            shape, placements, dtype = next(names[name] for _, names in held if name in names)
            placements = dict(placements, pp=Shard(0, on=coords))
            piece = Piece(local[name].tensor if name in local else None, shape, placements)
            if name not in local:
                size = tuple(len(i) for i in piece_index(piece, layout, self.ctx.rank))
                piece.tensor = torch.zeros(size, dtype=dtype)
            out[name] = piece
        return out


def _loss_parallel():
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def plain_activation(tensor: torch.Tensor, degrees: dict[str, int], batch: dict[str, Shard],
                     logical: tuple[int, ...] | None) -> Piece | None:
    """A plain activation's piece: this rank's rows of the batch, and, on a dim still short of the
    logical shape by a factor tp, a tensor-parallel shard (a colwise layer's local output, a
    sequence-parallel region); None when the shape says neither."""
    if logical is None or len(logical) != tensor.dim():
        return None
    placements = {d: s for d, s in batch.items() if s.dim < tensor.dim()}
    for d in range(tensor.dim()):
        held = tensor.shape[d] * math.prod(degrees[n] for n, s in placements.items() if s.dim == d)
        if held == logical[d]:
            continue
        if held * degrees.get("tp", 1) != logical[d] or "tp" in placements:
            return None
        placements["tp"] = Shard(d)
    return Piece(tensor.detach().cpu().clone(), tuple(logical), in_order(placements))


def in_order(placements: dict[str, Shard]) -> dict[str, Shard]:
    """Placements sorted in the cell mesh's order, the order nested shards of a tensor dim apply in."""
    return dict(sorted(placements.items(), key=lambda item: ORDER.index(item[0])))


def activation(tensor: torch.Tensor, degrees: dict[str, int], batch: dict[str, Shard],
               logical: tuple[int, ...] | None = None) -> Piece | None:
    """An activation's piece: its DTensor placements (if any) plus the batch dims its mesh does not
    name (a tensor-parallel activation is still this rank's rows of the batch)."""
    if not isinstance(tensor, DTensor):
        return plain_activation(tensor, degrees, batch, logical)
    piece = describe(tensor, degrees, gather=False)
    if piece is None:
        return None
    named = {SHORT.get(n, n) for n in tensor.device_mesh.mesh_dim_names or ()}
    shape = list(piece.shape)
    for dim, shard in batch.items():
        if dim not in named and dim not in piece.placements:
            piece.placements[dim] = shard
            shape[shard.dim] *= degrees[dim]
    piece.shape = tuple(shape)
    piece.placements = in_order(piece.placements)
    return piece


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


def run(case: ModelCase, ctx, cfg) -> dict[str, Piece]:
    """Rank task of a model cell; an exception raised inside a module names the module."""
    trainer = Trainer(case, ctx, cfg)
    try:
        return _train(trainer, case, cfg)
    except Exception as error:
        where = crashed_in(error, trainer.modules)
        if where is None:
            raise
        raise ModuleError(f"in module {where}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") \
            from error


def _train(trainer: Trainer, case: ModelCase, cfg) -> dict[str, Piece]:
    recorder = None
    if events.active():
        batch_dims = {d: Shard(0) for d in ("rep", "dp") if trainer.degrees.get(d, 1) > 1}
        if case.seq_dim is not None and trainer.degrees.get("cp", 1) > 1:
            batch_dims["cp"] = Shard(case.seq_dim)
        plain = start_model(case, cfg)
        shapes = logical_shapes(plain, lambda: case.forward(plain, global_batch(case, 0)))
        s = trainer.spec
        # a pipeline's activations are per microbatch: their rows are no slice of the global batch
        # (a microbatch's rows could pass for a tp shard by their shape), so only parameters are named
        recorder = Recorder(trainer.modules, lambda t, module, name: None if trainer.pipelined else activation(
            t, trainer.degrees, batch_dims, shapes.get((module, name))),
            grad_scale=1.0 / (s.rep * s.dp * s.cp))
    pieces: dict[str, Piece] = {}
    for step in range(cfg.size("steps")):
        if recorder:
            recorder.step = step + 1
        pieces[loss_name(step + 1)] = Piece.full(trainer.step(trainer.batch(step)))
        if trainer.pipelined and trainer.pipelined.before_step:
            trainer.pipelined.before_step()
        if step == 0:
            pieces |= trainer.pieces("grad")
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
    if recorder:
        recorder.remove()
    return pieces | trainer.pieces("state")
