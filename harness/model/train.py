"""One training loop for a model cell, and the two kinds of trainer it drives.

:meth:`Trainer.train` is the loop: batch, forward, loss, backward, the step's loss and gradients,
the optimizer step. :class:`OnRank` runs it on a rank of the cell's mesh, on the model
``parallelize`` made (the parallel run, and both halves of a reshard round trip);
:class:`OneProcess` runs it on the whole model in one process: the fp64 reference, and the model a
``reshard_one`` cell resumes. :func:`state_of` names what a trainer ends with.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..compare.tolerance import TORCH_DTYPE
from ..config import Config
from ..context import RankContext
from ..names import loss_name, mesh_names, param_name, state_name, step_grad_name
from ..world import check_mesh_covers
from .batches import as_dtype, batch_dtype, global_batch, local_batch, start_model
from .case import ModelCase, Parallelized, Pipelined
from .plan import mesh_spec
from .split import Notes, Watched, degrees_of


def autocast(case: ModelCase, cfg: Config, device: torch.device):
    """The forward's context: autocast to the cell's dtype for ``mixed_precision="autocast"``."""
    if cfg.dtype in ("bf16", "fp16") and case.mixed_precision == "autocast":
        return torch.autocast(device.type, dtype=TORCH_DTYPE[cfg.dtype])
    return contextlib.nullcontext()


@contextlib.contextmanager
def computed_in(model: nn.Module, dtype: torch.dtype):
    """Forward and backward on the parameters cast to ``dtype``, the model's floating inputs cast
    too, gradients back in the parameters' own dtype: what FSDP2's ``MixedPrecisionPolicy(
    param_dtype=dtype, reduce_dtype=torch.float32)`` does, on one process (the calibration of a
    ``mixed_precision="params"`` cell)."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    kept = [p.data for p in params]

    def cast(value):
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: (tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}),
        with_kwargs=True)
    for p in params:
        p.data = p.data.to(dtype)
    try:
        yield
    finally:
        hook.remove()
        for p, data in zip(params, kept):
            p.data = data
            if p.grad is not None:
                p.grad = p.grad.to(data.dtype)


def scalar(loss: torch.Tensor, share: bool = False) -> torch.Tensor:
    """A loss as a plain fp64 scalar (a replicated DTensor from loss_parallel included); ``share``:
    a DTensor's local value, this rank's share of a loss the ranks sum."""
    loss = loss.detach()
    if isinstance(loss, DTensor):
        loss = loss.to_local() if share else loss.full_tensor()
    return loss.double().reshape(())


def aliases(model: nn.Module) -> dict[str, str]:
    """Every parameter name (tied ones included) -> the name the reference reports it under."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def gradients_of(params: list[tuple[str, torch.Tensor]], step: int = 1) -> dict[str, torch.Tensor]:
    """Every parameter's gradient at ``step`` (zeros where backward left none), by
    :func:`harness.names.step_grad_name`."""
    return {step_grad_name(step, n): p.grad if p.grad is not None else torch.zeros_like(p) for n, p in params}


def state_of(params: list[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``param/<p>`` of every parameter and ``opt/<key>/<p>`` of its optimizer state of its shape."""
    out = {}
    for name, p in params:
        out[param_name(name)] = p.detach()
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                out[state_name(key, name)] = value
    return out


class Trainer:
    """Parameters under the reference's names, their optimizer, and how one step runs."""

    params: list[tuple[str, torch.Tensor]]
    optimizer: torch.optim.Optimizer
    recorder = None  # harness.model.hooks.Recorder while events are recorded: told each step

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward, loss, backward; the global loss as an fp64 scalar."""
        raise NotImplementedError

    def before_optimizer(self) -> None:
        """Between backward and the optimizer step."""

    def after_optimizer(self) -> None:
        """After the optimizer step."""

    def train(self, steps: range, gradients: Callable[[int, dict[str, torch.Tensor]], None] | None = None
              ) -> dict[str, torch.Tensor]:
        """Take ``steps`` (0-based); each step's loss by name. ``gradients`` is handed each step's
        number (1-based) and its gradients (:func:`gradients_of`), before its optimizer step."""
        losses = {}
        for step in steps:
            if self.recorder is not None:
                self.recorder.step = step + 1
            losses[loss_name(step + 1)] = self.step(self.batch(step))
            self.before_optimizer()
            if gradients is not None:
                gradients(step + 1, gradients_of(self.params, step + 1))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.after_optimizer()
        return losses


class Fp32Ops:
    """While active (the fp64 reference), ops run from their fp32 kernel, fp64 inputs cast to fp32,
    in forward and backward alike: the named aten ops (``"_grouped_mm"``: a kernel with no fp64
    implementation), their fp32 outputs cast back to fp64; and with ``mixed``, an op that fails on
    floating inputs mixing fp32 and fp64 because the model asked for fp32 there itself (a router
    that runs ``x.float()`` against its weight, "in fp32, as in the original"), its output left in
    fp32 as the model's own code expects. An op that runs as it is runs unchanged."""

    def __init__(self, names: tuple[str, ...], mixed: bool = False):
        self.names = {name.replace("aten::", "").replace("aten.", "").split(".")[0] for name in names}
        self.mixed = mixed

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten, tree_map

        names, mixed_too = self.names, self.mixed

        def cast(dtype_from, dtype_to):
            return lambda x: x.to(dtype_to) if isinstance(x, torch.Tensor) and x.dtype == dtype_from else x

        def mixes(args, kwargs) -> bool:
            dtypes = {x.dtype for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
            return {torch.float32, torch.float64} <= dtypes

        def in_fp32(func, args, kwargs, back: bool):
            down = cast(torch.float64, torch.float32)
            out = func(*tree_map(down, args), **tree_map(down, kwargs))
            return tree_map(cast(torch.float32, torch.float64), out) if back else out

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func.overloadpacket.__name__ in names:
                    return in_fp32(func, args, kwargs, back=True)
                if not mixed_too:
                    return func(*args, **kwargs)
                try:
                    return func(*args, **kwargs)
                except RuntimeError:
                    if not mixes(args, kwargs):
                        raise
                return in_fp32(func, args, kwargs, back=False)  # fp32, as the model's own fp32 code expects

        self.mode = Mode() if names or mixed_too else None
        if self.mode is not None:
            self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self.mode is not None:
            self.mode.__exit__(*exc)


class OneProcess(Trainer):
    """The whole model on one process, trained on the whole global batch: in fp64 without autocast
    (``reference``), or as the cell starts it, on the cell's batches under its autocast (the
    tolerance's calibration, a model a reshard cell resumes whole). ``mixed``: the reference of a
    model that asks for fp32 itself (:class:`Fp32Ops`)."""

    draws = None  # harness.model.draws.Draws in the reference: watches each step for random numbers

    def __init__(self, case: ModelCase, cfg: Config, reference: bool = True, mixed: bool = False):
        self.case, self.cfg, self.reference, self.mixed = case, cfg, reference, mixed
        self.model = start_model(case, cfg)
        if reference:
            self.model = self.model.double()
        self.params = list(self.model.named_parameters())  # tied parameters under their first name
        self.optimizer = case.optimizer([p for _, p in self.params])

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        return as_dtype(global_batch(self.case, step), torch.float64 if self.reference else batch_dtype(self.case, self.cfg))

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.reference:
            with Fp32Ops(self.case.fp32_ops, self.mixed), self.draws or contextlib.nullcontext():
                loss = self.case.loss(self.case.forward(self.model, batch), batch)
                loss.backward()
            return scalar(loss)
        if self.case.mixed_precision == "params" and self.cfg.dtype in ("bf16", "fp16"):
            with computed_in(self.model, TORCH_DTYPE[self.cfg.dtype]):
                loss = self.case.loss(self.case.forward(self.model, batch), batch)
                loss.backward()
            return scalar(loss)
        with autocast(self.case, self.cfg, torch.device("cpu")):
            loss = self.case.loss(self.case.forward(self.model, batch), batch)
        loss.backward()
        return scalar(loss)


class OnRank(Trainer):
    """This rank's part of the cell: the model ``parallelize[cfg.impl]`` made from the seeded start,
    on the cell's meshes, trained on this rank's slice of every global batch."""

    def __init__(self, case: ModelCase, ctx: RankContext, cfg: Config):
        self.case, self.ctx, self.cfg = case, ctx, cfg
        self.spec = mesh_spec(cfg)
        self.meshes = ctx.meshes_for(self.spec)
        self.degrees = degrees_of(self.spec)
        model = start_model(case, cfg).to(ctx.device)
        self.alias = aliases(model)
        names = mesh_names(case.mesh_names)  # the names parallelize sees (ours -> its)
        self.ours = {theirs: ours for ours, theirs in names.items()}
        watched = Watched(self.meshes.renamed(names))
        made = case.parallelize[cfg.impl](model, watched)
        self.pipelined = made if isinstance(made, Pipelined) else None
        self.made = made if isinstance(made, Parallelized) else Parallelized(made) if isinstance(made, nn.Module) \
            else None
        if self.pipelined is None and self.made is None:
            raise TypeError(f"parallelize[{cfg.impl!r}] returned {type(made).__name__}: return the module, "
                            "harness.model.Pipelined(stages, schedule) for a pipelined model, or "
                            "harness.model.Parallelized(module, before_step=...) for one whose trainer finishes "
                            "its gradients itself")
        self.modules = self.pipelined.modules if self.pipelined else [self.made.module]
        check_mesh_covers(self.modules, dist.get_world_size())
        self.notes = self._notes(watched)
        self.params = self._params()
        self.optimizer = case.optimizer([p for _, p in self.params])

    def _notes(self, watched: Watched) -> Notes:
        """What split each dim here (:mod:`harness.model.split`)."""
        notes = Notes(self.cfg, self.case, self.degrees, self.ours)
        if self.pipelined is not None or (self.spec.pp > 1 and self._holds_part()):
            notes.split.add("pp")
        if watched.reached:
            notes.split.add("ep")
        notes.modules(self.modules)
        return notes

    def _holds_part(self) -> bool:
        """Whether this rank holds some of the model's parameters only, by the reference's names (a
        pipeline stage that ``Parallelized`` returned)."""
        rename = self.made.global_name or (lambda name: name)
        held = {self.alias.get(rename(n)) for n, _ in self.made.module.named_parameters()}
        return held < set(self.alias.values())

    @property
    def local_names(self) -> bool:
        """Whether ranks name some parameters locally (``Parallelized.global_name``): which ranks
        hold a name is then for the ranks to tell each other."""
        return self.made is not None and self.made.global_name is not None

    def global_module_names(self) -> dict[str, str]:
        """Each submodule's name in the whole model by its name on this rank, where the rank names
        its parameters locally (``Parallelized.global_name``, which maps parameter names): read from
        a parameter under the module, whose global name ends with the same path below it; a module
        holding none takes its parent's, with its own name after. {} where names are global."""
        if not self.local_names:
            return {}
        rename, names = self.made.global_name, {}
        for module in self.modules:
            for name, sub in module.named_modules():
                if not name:
                    continue
                below = next((n for n, _ in sub.named_parameters()), None)
                whole = rename(f"{name}.{below}") if below is not None else None
                if whole is not None and whole.endswith(f".{below}"):
                    names[name] = whole[:-len(below) - 1]
                else:  # no parameter to read it from: its parent's global name, then its own
                    parent, _, own = name.rpartition(".")
                    names[name] = f"{names.get(parent, parent)}.{own}" if parent else name
        return names

    def _params(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under the reference's names, sorted (every rank of a stage's mesh
        visits them in the same order: the fallback gather is a collective)."""
        seen, out = set(), []
        rename = self.made.global_name if self.local_names else None
        mains = self.made.main_params if self.made is not None else None
        for module in self.modules:
            for local, p in module.named_parameters(remove_duplicate=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                name = rename(local) if rename else local
                if name not in self.alias:
                    mapped = f" (its global_name {name!r})" if name != local else ""
                    raise KeyError(f"parallelize[{self.cfg.impl!r}] made a parameter {local!r}{mapped} the model "
                                   "does not have: keep the model's parameter names (wrap, shard or delete modules "
                                   "in place), or map a rank's own names with Parallelized(global_name=...)")
                if name != local:  # parameters split over ranks by name: the expert mesh's way
                    self.notes.split.add("ep")
                if mains is not None and local not in mains:
                    raise KeyError(f"parallelize[{self.cfg.impl!r}] returned Parallelized(main_params=...) without "
                                   f"{local!r}: give every parameter of the module its main parameter")
                out.append((self.alias[name], mains[local] if mains is not None else p))
        return sorted(out, key=lambda item: item[0])

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        ctx, s = self.ctx, self.spec
        data = (s.rep * s.dp, ctx.coord("rep") * s.dp + ctx.coord("dp"))
        local = local_batch(global_batch(self.case, step), self.case.seq_dim, data, (s.cp, ctx.coord("cp")))
        return {k: t.to(ctx.device) for k, t in as_dtype(local, batch_dtype(self.case, self.cfg)).items()}

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = self._pipeline_step(batch) if self.pipelined else self._own_step(batch) if self.made.step \
            else self._local_step(batch)
        group = self.meshes.group("loss")  # the ranks that hold different data
        dist.all_reduce(loss, group=group)
        return loss if self.shares else loss / dist.get_world_size(group)

    @property
    def shares(self) -> bool:
        """Each rank's loss is its share of the global loss (``ModelCase.loss_reduction="sum"``)."""
        return self.case.loss_reduction == "sum"

    def _local_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with autocast(self.case, self.cfg, self.ctx.device):
            output = self.case.forward(self.modules[0], batch)
        parallel_loss = isinstance(output, DTensor) or (isinstance(output, tuple) and any(
            isinstance(o, DTensor) for o in output))
        with _loss_parallel() if parallel_loss else contextlib.nullcontext():
            with autocast(self.case, self.cfg, self.ctx.device):
                loss = self.case.loss(output, batch)
            loss.backward()
        return scalar(loss, self.shares)

    def _own_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The trainer's own forward and backward (``Parallelized.step``)."""
        with autocast(self.case, self.cfg, self.ctx.device):
            loss = self.made.step(batch)
        return scalar(loss, self.shares)

    def _pipeline_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        p = self.pipelined
        first = any(stage.is_first for stage in p.stages)
        last = any(stage.is_last for stage in p.stages)
        losses: list[torch.Tensor] = []
        args = (batch[p.input],) if first else ()
        # the schedule runs the loss, and its backward, inside step: with tp, the last stage's
        # logits may stay vocab-sharded (a DTensor), whose loss needs loss_parallel as a module's does
        sharded = self.cfg.degree("tp") > 1
        with autocast(self.case, self.cfg, self.ctx.device), _loss_parallel() if sharded else contextlib.nullcontext():
            p.schedule.step(*args, target=batch[p.target] if last else None, losses=losses if last else None)
        if last:
            each = torch.stack([scalar(x, self.shares) for x in losses])
            loss = each.sum() if self.shares else each.mean()  # shares of the microbatches, or their means
        else:
            loss = torch.zeros((), dtype=torch.float64)
        dist.all_reduce(loss, group=self.meshes.group("pp"))  # the last stage's, on every stage
        return loss

    def before_optimizer(self) -> None:
        made = self.pipelined or self.made
        if made.before_step:
            made.before_step()

    def after_optimizer(self) -> None:
        if self.made is not None and self.made.after_step:
            self.made.after_step()


def _loss_parallel():
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
