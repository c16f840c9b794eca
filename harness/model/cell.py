"""What the code of a running cell may ask of it: ``harness.model.cell_dir()``,
``harness.model.switches()`` and ``harness.model.running()``.

**The directory a cell's ranks share**, ``cell_dir()``.

A ``build`` or ``parallelize`` that goes through files (``save_pretrained`` on one rank, then
``from_pretrained(..., tp_plan=..., device_mesh=...)`` on all) needs a directory every rank of the
cell reads, empty at the cell's start. In the pool it is removed after a passing cell and moved into
the test's ``tmp_path`` after a failing one (pytest keeps it as it keeps a failed test's, and the
failure says where); under torchrun, a directory under the job's scratch (``PARITYTEST_SCRATCH``
for one that all hosts see).

**The cell's own switches**, ``switches()``: the values of the switches the case declares
(``ModelCase.switches``), as the cell's id names them, the default (first) value where it names
none: on the ranks and in the one-process reference alike, so ``build`` makes the same model in both.

**The running cell**, ``running()``: its id, dtype (``torch.bfloat16`` for a ``bf16`` cell), mesh
degrees, switches and steps, so ``parallelize`` can set up the precision it trains with (FSDP2's
``MixedPrecisionPolicy(param_dtype=running().dtype)``); in the reference, the cell it is the
reference of. And the device this process trains it on: a rank's (``cuda:(rank mod GPUs)`` under
NCCL, the CPU under gloo), the CPU in the one-process reference, which always runs there.
"""
from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path
from typing import NamedTuple

import torch

from ..compare.tolerance import TORCH_DTYPE
from .case import MESH_SWITCHES

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("paritytest_cell_dir", default=None)
_switches: contextvars.ContextVar[dict | None] = contextvars.ContextVar("paritytest_switches", default=None)
_running: contextvars.ContextVar["Running | None"] = contextvars.ContextVar("paritytest_running", default=None)


class Running(NamedTuple):
    """The running model cell, as its id says it (``harness.model.running()``)."""

    id: str
    dtype: torch.dtype
    mesh: dict[str, int]  # degrees by the harness's dim names (harness.names)
    switches: dict[str, str]  # every switch the id names (``ep``, ``etp`` and the case's own)
    steps: int
    device: torch.device = torch.device("cpu")  # this process's: a rank's, or the reference's CPU


def cell_dir() -> Path:
    """The directory this cell's ranks share (see the module docstring)."""
    where = _current.get()
    if where is None:
        raise RuntimeError("harness.model.cell_dir() is the directory a cell's ranks share: call it while a cell "
                           "runs (from parallelize, or build on the ranks); the one-process reference has no cell")
    return Path(where)


def switches() -> dict[str, str]:
    """The running cell's values of the case's own switches (see the module docstring)."""
    values = _switches.get()
    if values is None:
        raise RuntimeError("harness.model.switches() are the switches of a model cell: call it from build, batch, "
                           "forward or parallelize while the harness runs a cell or its reference")
    return dict(values)


def running() -> Running:
    """The running cell (see the module docstring)."""
    cell = _running.get()
    if cell is None:
        raise RuntimeError("harness.model.running() is the running model cell: call it from build, batch, forward "
                           "or parallelize while the harness runs a cell or its reference")
    return cell


@contextlib.contextmanager
def configured(case, cfg, device: torch.device = torch.device("cpu")):
    """``switches()`` are ``cfg``'s values of ``case``'s switches, and ``running()`` is ``cfg`` on
    ``device``, while the block runs."""
    named = dict(cfg.switches)
    token = _switches.set({name: named.get(name, values[0]) for name, values in case.switches.items()
                           if name not in MESH_SWITCHES})
    cell = _running.set(Running(cfg.id, TORCH_DTYPE[cfg.dtype], dict(cfg.mesh), named, cfg.size("steps"), device))
    try:
        yield
    finally:
        _running.reset(cell)
        _switches.reset(token)


@contextlib.contextmanager
def inside(directory: str):
    """``cell_dir()`` is ``directory`` while the block runs."""
    token = _current.set(directory)
    try:
        yield
    finally:
        _current.reset(token)
