"""FSDP2 (``torch.distributed.fsdp.fully_shard``) as the second fsdp implementation, run by the same cases.

The reference MLP as an ``nn.Module``, each linear layer its own ``fully_shard`` unit and the root a
third (which owns no parameters of its own), on the same meshes as ``harness/parallel/fsdp.py``:

* ``dp=N``: ``fully_shard(mesh=<1-D dp mesh>)``, parameters ``Shard(0)`` over dp;
* ``rep=R,shard=S``: the 2-D mesh makes FSDP2 HSDP (replicate over dim 0, shard over dim 1);
* ``dp=D,tp=T``: ``parallelize_module`` first (l1 column-parallel, l2 row-parallel over tp), then
  ``fully_shard`` over dp: parameters become 2-D DTensors over ``(dp, tp)``.

Mixed precision (dtype bf16) is ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
accumulation uses ``set_requires_gradient_sync(False)`` for every microbatch but the last; clipping is
``torch.nn.utils.clip_grad_norm_`` on the DTensor gradients. Results are each rank's local shards
(so the parent also checks that FSDP2 cuts dim 0 as torch.chunk does), or full tensors with tp.

:func:`state_dict` gives the same keys as ``harness.parallel.fsdp.FSDP.state_dict`` (``model.w1``,
``optim.w1.exp_avg``, ...), holding FSDP2's own DTensors, so a checkpoint saved by one
implementation loads into the other.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from harness.config import Config
from harness.context import RankContext
from harness.layout import Piece, Shard, take
from reference.common import probe_loss
from reference.fsdp import MAX_NORM, STEPS, make_problem

from .fsdp import dp_world, shard_dim, step_pieces
from .optim import shardwise_adamw

# module parameter name -> the reference's name
NAMES = {"l1.weight": "w1", "l1.bias": "b1", "l2.weight": "w2", "l2.bias": "b2"}


def skip_reason(cfg: Config) -> str | None:
    return None


class MLP(nn.Module):
    """``reference.fsdp.forward`` as modules: ``l2(gelu(l1(x)))``."""

    def __init__(self, p: dict[str, torch.Tensor]):
        super().__init__()
        self.l1 = nn.Linear(p["w1"].shape[1], p["w1"].shape[0])
        self.l2 = nn.Linear(p["w2"].shape[1], p["w2"].shape[0])
        with torch.no_grad():
            for module_name, name in NAMES.items():
                self.get_parameter(module_name).copy_(p[name])

    def forward(self, x):
        return self.l2(F.gelu(self.l1(x)))


def build(ctx: RankContext, cfg: Config, mesh: DeviceMesh | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The FSDP2 model (fp32 master parameters) and its AdamW on this rank, before any step, on
    ``mesh`` (``dp``, ``(rep, shard)`` or ``(dp, tp)``; default the cell's own, ``ctx.device_mesh``)."""
    model = MLP({k: t.float() for k, t in make_problem(cfg).params.items()})
    device_mesh = ctx.device_mesh if mesh is None else mesh
    names = device_mesh.mesh_dim_names
    if "tp" in names:
        # l1's output stays a DTensor: re-wrapping a local shard (the default) would assume even shards,
        # and f=13 over tp=2 is 7/6
        plan = {"l1": ColwiseParallel(use_local_output=False), "l2": RowwiseParallel()}
        parallelize_module(model, device_mesh["tp"], plan)
        mesh = device_mesh["dp"]
    else:
        mesh = device_mesh  # 1-D dp, or 2-D (rep, shard): HSDP
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cfg.dtype == "bf16" else None,
                                  reduce_dtype=torch.float32)
    for layer in (model.l1, model.l2):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, shardwise_adamw(list(model.parameters()))


def state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Model and AdamW state under ``harness.parallel.fsdp``'s keys, as FSDP2's DTensors (in place for
    ``dcp.load``); an optimizer that has not stepped yet gets zero moments and step 0 first."""
    state: dict[str, torch.Tensor] = {}
    for module_name, p in model.named_parameters():
        name = NAMES[module_name]
        opt = optimizer.state[p]
        if not opt:
            opt.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state[f"model.{name}"] = p.data
        for key in ("exp_avg", "exp_avg_sq", "step"):
            state[f"optim.{name}.{key}"] = opt[key]
    return state


def _full(t: torch.Tensor) -> torch.Tensor:
    """A copy of the full tensor (a 1-rank DTensor's full_tensor() is its own storage, which the
    clipping and the optimizer change in place)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _results(t: torch.Tensor, tp: bool) -> torch.Tensor:
    """What a rank reports of a parameter-shaped DTensor: its local dim-0 shard as FSDP2 holds it
    (the parent checks it against torch.chunk's cut), or with tp the full tensor (FSDP2 keeps
    dp x tp parameters as strided shards, which a Piece does not describe)."""
    return _full(t) if tp else t.to_local().detach()


def train_step(mesh: DeviceMesh, model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               probe: torch.Tensor, microbatches: int):
    """One optimizer step on this rank's rows (``mesh``: the one the model was built on); returns the
    global loss, the gradient norm before clipping and the gradients before clipping (by reference
    name: local shards, or full tensors with tp)."""
    names = mesh.mesh_dim_names
    params = dict(model.named_parameters())
    loss = torch.zeros(())
    for i, (xm, pm) in enumerate(zip(x.chunk(microbatches), probe.chunk(microbatches))):
        model.set_requires_gradient_sync(i == microbatches - 1)
        mb_loss = probe_loss(model(xm.float()), pm, x.shape[0])  # a mean over this rank's rows
        mb_loss.backward()
        loss += mb_loss.detach()
    grads = {NAMES[n]: _results(p.grad, "tp" in names).clone() for n, p in params.items()}
    norm = _full(torch.nn.utils.clip_grad_norm_(list(params.values()), MAX_NORM, foreach=False))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for n in names:
        if n != "tp":
            dist.all_reduce(loss, group=mesh.get_group(n))
    return loss / dp_world(zip(names, mesh.shape)), norm, grads


def run(ctx: RankContext, cfg: Config) -> dict[str, Piece]:
    """Three FSDP2 training steps; returns every step's results (see ``_results``)."""
    problem = make_problem(cfg)
    model, optimizer = build(ctx, cfg)
    names = [n for n in ctx.layout.names if n != "tp"]
    world = dp_world(ctx.layout.dims)
    index = 0
    for n in names:  # row-major block index over the data-parallel dims
        index = index * ctx.degree(n) + ctx.coord(n)
    params = dict(model.named_parameters())
    tp = "tp" in ctx.layout.names
    placement = {} if tp else {shard_dim(names): Shard(0)}
    pieces: dict[str, Piece] = {}
    for k in range(STEPS):
        x, probe = (take(t[k], Shard(0), world, index) for t in (problem.x, problem.probe))
        loss, norm, grads = train_step(ctx.device_mesh, model, optimizer, x, probe, cfg.size("m"))
        shards = {NAMES[n]: _results(p, tp) for n, p in params.items()}
        opt = {NAMES[n]: {key: _results(optimizer.state[p][key], tp) for key in ("exp_avg", "exp_avg_sq")}
               for n, p in params.items()}
        full_shapes = {name: tuple(t.shape) for name, t in problem.params.items()}
        pieces |= step_pieces(k + 1, loss, norm, grads, shards, opt, full_shapes, placement)
    return pieces
