"""Backend and device choice, in one place: gloo on CPU, NCCL where there are GPUs.

torch is imported where a choice needs it, not with the module: the plugin checks ``--backend`` in
every pytest run, most of which (a project's other tests, ``--help``, a usage error) run no cell."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BACKENDS = ("auto", "gloo", "nccl")


def check(requested: str) -> None:
    """Raise ValueError, saying why, unless ``requested`` can run here (torch only for nccl)."""
    if requested not in BACKENDS:
        raise ValueError(f"backend {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "nccl":
        resolve(requested)


def resolve(requested: str = "auto") -> str:
    """The process-group backend to use. Runs in the parent only (it may initialise CUDA)."""
    import torch

    if requested not in BACKENDS:
        raise ValueError(f"backend {requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend nccl needs CUDA, and torch.cuda.is_available() is False: use --backend gloo")
    return requested


def device_type(backend: str) -> str:
    return "cuda" if backend == "nccl" else "cpu"


def rank_device(backend: str, rank: int) -> torch.device:
    """The device a pool rank computes on: ``cuda:(rank mod GPUs)`` under NCCL, else the CPU."""
    import torch

    if backend == "nccl":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")
