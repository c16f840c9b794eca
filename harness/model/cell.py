"""The directory a cell's ranks share: ``harness.model.cell_dir()``.

A ``build`` or ``parallelize`` that goes through files (``save_pretrained`` on one rank, then
``from_pretrained(..., tp_plan=..., device_mesh=...)`` on all) needs a directory every rank of the
cell reads, empty at the cell's start. In the pool it is removed after a passing cell and moved into
the test's ``tmp_path`` after a failing one (pytest keeps it as it keeps a failed test's, and the
failure says where); under torchrun, a directory under the job's scratch (``PARITYTEST_SCRATCH``
for one that all hosts see).
"""
from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("paritytest_cell_dir", default=None)


def cell_dir() -> Path:
    """The directory this cell's ranks share (see the module docstring)."""
    where = _current.get()
    if where is None:
        raise RuntimeError("harness.model.cell_dir() is the directory a cell's ranks share: call it while a cell "
                           "runs (from parallelize, or build on the ranks); the one-process reference has no cell")
    return Path(where)


@contextlib.contextmanager
def inside(directory: str):
    """``cell_dir()`` is ``directory`` while the block runs."""
    token = _current.set(directory)
    try:
        yield
    finally:
        _current.reset(token)
