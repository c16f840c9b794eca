"""The one runner contract: what a cell (:mod:`harness.cell`, :mod:`harness.fixture`, bisect's
localisation) asks of whatever runs its tasks on ranks.

Two runners have it: the warm pool (:class:`harness.pool.parent.Pool`, the ranks forked from a
zygote, driven from this process) and torchrun's (:class:`harness.torchrun.runner.RankRunner`, this
process one rank of the job). Both satisfy :class:`Runner` structurally, without importing it;
``tests/test_runner.py`` holds their members and signatures to it.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

Mesh = tuple[tuple[str, int], ...]


@runtime_checkable
class Runner(Protocol):
    """Runs ``fn(ctx, payload)`` (an import path, ``"module:function"``) on the ranks of a mesh."""

    size: int  # ranks there are: a mesh needing more is refused before any rank runs
    backend: str  # "gloo" or "nccl"
    deadline: float  # seconds a task may run when the call names none
    can_rerun: bool  # whether a failing cell may be run again to localise it

    def run(self, fn: str, payload: Any, mesh: Mesh, *, seed: int = 0, deadline: float | None = None,
            label: str = "", extra_meshes=(), scratch: str | None = None,
            fresh: bool = False) -> dict[int, Any] | None:
        """Every mesh rank's return value (None on a torchrun rank that does not gather); raises
        :class:`harness.pool.parent.CaseFailure`, every rank's outcome in it, when a rank raised,
        died or passed the deadline. ``fresh``: on ranks no task ran on, where the runner can
        replace them (:attr:`harness.registry.Component.fresh`)."""
        ...

    def alone(self, fn: str, payload: Any, mesh: Mesh, *, seed: int = 0, deadline: float | None = None,
              label: str = "") -> Any:
        """``fn(ctx, payload)`` on ``mesh`` (every degree 1) in a world of one: its value."""
        ...

    def new_scratch(self, fresh: bool = False) -> str | None:
        """An empty directory the ranks of a later ``run(scratch=...)`` share, or None where the
        runner gives each round its own; ``fresh``: for a cell whose ranks must be new (the pool
        replaces ranks that ran a task first)."""
        ...
