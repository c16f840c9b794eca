"""Reshard round trip of a model cell: switch ``reshard_<layout>``.

The cell trains on its own mesh for ``steps - 1`` steps (or ``N`` with ``reshard_<layout>at<N>``), saves the model and optimizer state with
``torch.distributed.checkpoint`` (``get_state_dict``: DTensor and FSDP2 shards as they are) into the
cell's scratch directory, then a fresh model is built and parallelized by the same function on the
mesh ``<layout>`` (``dp4``, ``rep2dp2``, ``tp2``, ...: the model mesh dims with their degrees run
together), or left whole on one process (``reshard_one``: rank 0 alone, the user's unparallelized
model, ``dcp.load(no_dist=True)``); it loads the checkpoint (DCP reshards it), and takes the
remaining steps (the last one; from N+1 to the last with ``at<N>``: ``reshard_rep2dp2tp2at5`` of a
steps10 cell saves after step 5 and continues on rep2dp2tp2 for steps 6 to 10). The results are those of the run that never stopped: the loss of every step, the gradients
of step 1, the parameters and optimizer state after the last step, against the same one-process
reference, so a state that does not survive the trip (a shard loaded into the wrong place, an
optimizer moment dropped, the step count lost) is a named mismatch.

The load layout runs on the first ranks of the cell's (at most as many: make the larger layout the
cell's mesh); the other ranks wait and receive its results. The reloaded state is reported as full
tensors, so the two layouts' placements never need to agree. Pipelined models are not supported.
"""
from __future__ import annotations

import dataclasses
import os
import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from ..config import Config, ConfigError
from ..layout import MeshLayout, Piece

ONE = "one"
_DIM = re.compile(r"(pp|rep|dp|cp|tp)(\d+)")
_AT = re.compile(r"(.*?)at(\d+)")


def _split(cfg: Config) -> tuple[str, int | None]:
    """The switch's layout text and its save step (None: steps - 1)."""
    text = dict(cfg.switches)["reshard"]
    m = _AT.fullmatch(text)
    return (m.group(1), int(m.group(2))) if m else (text, None)


def save_step(cfg: Config) -> int:
    """The step after which the cell saves (``at<N>``, else steps - 1)."""
    at = _split(cfg)[1]
    return cfg.size("steps") - 1 if at is None else at


def layout(cfg: Config) -> tuple[tuple[str, int], ...] | None:
    """The load mesh of a reshard cell as model mesh dims (``None``: one process)."""
    text = _split(cfg)[0]
    if text == ONE:
        return None
    dims = _DIM.findall(text)
    if not dims or "".join(n + d for n, d in dims) != text:
        raise ConfigError(f"{cfg.id}: switch reshard_{text}: name the load mesh as model dims with their degrees "
                          "run together (reshard_dp4, reshard_rep2dp2, reshard_tp2) or reshard_one")
    return tuple((n, int(d)) for n, d in dims)


def load_config(cfg: Config) -> Config | None:
    """The cell as it continues after the reload: the load mesh, no reshard switch."""
    dims = layout(cfg)
    switches = {k: v for k, v in cfg.switches if k != "reshard"}
    return None if dims is None else cfg.replace(mesh=dims, switches=switches)


def check(case, cfg: Config) -> None:
    """The rules of a reshard cell (the model rules hold for the load layout too)."""
    from .rules import check as check_model, check_impl

    if cfg.size("steps") < 2:
        raise ConfigError(f"{cfg.id}: a reshard cell saves after step steps-1 and resumes: give it steps2 or more")
    if not 1 <= save_step(cfg) < cfg.size("steps"):
        raise ConfigError(f"{cfg.id}: reshard ...at{save_step(cfg)} saves after a step the cell does not end with: "
                          f"choose at<N> with 1 <= N < steps={cfg.size('steps')}")
    again = load_config(cfg)
    if again is None:
        return
    if again.world > cfg.world:
        raise ConfigError(f"{cfg.id}: the load mesh ({again.world} ranks) is larger than the cell's ({cfg.world}): "
                          "make the larger layout the cell's mesh and reshard to the smaller one")
    if dict(cfg.mesh).get("pp", 1) > 1 or dict(again.mesh).get("pp", 1) > 1:
        raise ConfigError(f"{cfg.id}: reshard cells do not run pipelined layouts (pp)")
    check_model(case, again)
    check_impl(case, again)


def _all(world: int) -> tuple[tuple[str, int], ...]:
    """A 1-D mesh over the first ``world`` ranks: its group is the checkpoint's (the pool may be larger)."""
    return (("w", world),)


def meshes(cfg: Config) -> list:
    """Besides the cell's own: a mesh over the cell's ranks and, unless one process loads, the load
    layout's harness.meshes marker and a mesh over its ranks."""
    from .rules import meshes as model_meshes

    again = load_config(cfg)
    return [_all(cfg.world)] + ([] if again is None else model_meshes(again) + [_all(again.world)])


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


def _state(trainer) -> dict[str, torch.Tensor]:
    """Every parameter and its optimizer state, full (a collective for DTensors: every rank calls it)."""
    from reference.common import param_name, state_name

    out = {}
    for name, p in trainer.params:
        out[param_name(name)] = _full(p)
        for key, value in sorted(trainer.optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                out[state_name(key, name)] = _full(value)
    return out


def _one_process(case, cfg: Config, path: str, last: int) -> dict[str, torch.Tensor]:
    """Rank 0 alone: the unparallelized model loads the sharded checkpoint and takes the last step."""
    from .batches import as_dtype, global_batch, start_model
    from .runner import autocast, loss_name, scalar

    model = start_model(case, cfg)
    optimizer = case.optimizer(model.parameters())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = {}
    for step in range(last, cfg.size("steps")):
        batch = as_dtype(global_batch(case, step), torch.float32)
        with autocast(case, cfg, torch.device("cpu")):
            loss = case.loss(case.forward(model, batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[loss_name(step + 1)] = scalar(loss)

    class Whole:  # what _state reads
        params = sorted(model.named_parameters())

    Whole.optimizer = optimizer
    return losses | _state(Whole)


def run(case, ctx, cfg: Config) -> dict[str, Piece]:
    """Rank task of a reshard cell."""
    from .runner import Trainer, loss_name

    last = save_step(cfg)  # steps 1..last before the save, steps last+1.. after the reload
    path = os.path.join(ctx.scratch, "checkpoint")
    saver = Trainer(case, ctx, cfg)
    pieces: dict[str, Piece] = {}
    for step in range(last):
        pieces[loss_name(step + 1)] = Piece.full(saver.step(saver.batch(step)))
        if step == 0:
            pieces |= saver.pieces("grad")
        saver.optimizer.step()
        saver.optimizer.zero_grad(set_to_none=True)
    cell = ctx.mesh(_all(cfg.world)).get_group()  # the cell's ranks (the pool may have more)
    model_sd, optim_sd = get_state_dict(saver.modules[0], saver.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=cell)
    dist.barrier(group=cell)  # every shard is on disk before any rank reads

    again = load_config(cfg)
    result = None
    if again is None:
        if ctx.rank == 0:
            try:  # a checkpoint that does not load must fail the cell, not leave the others waiting
                result = _one_process(case, cfg, path, last)
            except BaseException as error:  # noqa: BLE001  (DCP raises CheckpointException, a BaseException)
                result = f"{type(error).__name__}: {error}"
    elif ctx.rank < again.world:
        loader = Trainer(case, dataclasses.replace(ctx, layout=MeshLayout.of(again.mesh)), again)
        model_sd, optim_sd = get_state_dict(loader.modules[0], loader.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path, process_group=ctx.mesh(_all(again.world)).get_group())
        set_state_dict(loader.modules[0], loader.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        result = {}
        for step in range(last, cfg.size("steps")):
            result[loss_name(step + 1)] = loader.step(loader.batch(step)).cpu()
            loader.optimizer.step()
            loader.optimizer.zero_grad(set_to_none=True)
        result |= _state(loader)
    box = [result]
    dist.broadcast_object_list(box, group=cell, group_src=0)  # rank 0's results on every rank of the cell
    if isinstance(box[0], str):
        raise RuntimeError(f"{cfg.id}: the checkpoint saved on {cfg.mesh} did not load on one process: {box[0]}")
    return pieces | {name: Piece.full(t) for name, t in box[0].items()}
