"""What the code of a running cell may ask of it: ``harness.model.cell_dir()`` and
``harness.model.switches()``.

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
"""
from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path

from .case import MESH_SWITCHES

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("paritytest_cell_dir", default=None)
_switches: contextvars.ContextVar[dict | None] = contextvars.ContextVar("paritytest_switches", default=None)


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


@contextlib.contextmanager
def configured(case, cfg):
    """``switches()`` are ``cfg``'s values of ``case``'s switches while the block runs."""
    named = dict(cfg.switches)
    token = _switches.set({name: named.get(name, values[0]) for name, values in case.switches.items()
                           if name not in MESH_SWITCHES})
    try:
        yield
    finally:
        _switches.reset(token)


@contextlib.contextmanager
def inside(directory: str):
    """``cell_dir()`` is ``directory`` while the block runs."""
    token = _current.set(directory)
    try:
        yield
    finally:
        _current.reset(token)
