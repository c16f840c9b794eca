"""Backend and device choice, in one place: gloo on CPU, NCCL where there are GPUs."""
from __future__ import annotations

import torch

BACKENDS = ("auto", "gloo", "nccl")


def resolve(requested: str = "auto") -> str:
    """The process-group backend to use. Runs in the parent only (it may initialise CUDA)."""
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
    if backend == "nccl":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")
