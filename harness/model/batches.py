"""The model a cell starts from and the batches it trains on, the same on the ranks and in the reference."""
from __future__ import annotations

import torch
from torch import nn

from ..compare.tolerance import TORCH_DTYPE
from ..config import Config
from ..context import derive_seed
from ..layout import Shard, take


def global_batch(case, step: int) -> dict[str, torch.Tensor]:
    """``case.batch(step)``, checked to be a dict of tensors."""
    batch = case.batch(step)
    if not isinstance(batch, dict) or not all(isinstance(t, torch.Tensor) for t in batch.values()):
        raise TypeError(f"ModelCase.batch({step}) returned {type(batch).__name__}: return a dict of tensors, "
                        "e.g. {'input': ids, 'target': labels}")
    return batch


def start_model(case, cfg: Config) -> nn.Module:
    """``case.build()`` under the harness's seed (the same initial parameters in every process), with
    every floating parameter and buffer rounded to the cell's dtype and kept in fp32: the start the
    parallel run and the fp64 reference share. With ``mixed_precision="bf16"`` the model stays in
    the cell's dtype."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed("model", cfg.component, cfg.seed))
        model = case.build()
    dtype = TORCH_DTYPE[cfg.dtype]
    keep = dtype if case.mixed_precision == "bf16" and cfg.dtype in ("bf16", "fp16") else torch.float32
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype).to(keep)
    return model


def batch_dtype(case, cfg: Config) -> torch.dtype:
    """The dtype a cell's floating batch tensors take: the cell's for a model kept in it
    (``mixed_precision="bf16"``), else fp32."""
    low = case.mixed_precision == "bf16" and cfg.dtype in ("bf16", "fp16")
    return TORCH_DTYPE[cfg.dtype] if low else torch.float32


def local_batch(batch: dict[str, torch.Tensor], seq_dim: int | None, data: tuple[int, int],
                cp: tuple[int, int]) -> dict[str, torch.Tensor]:
    """This rank's slice of the global batch: chunk ``data[1]`` of ``data[0]`` on dim 0 (the batch
    ranks, rep·dp row-major) and chunk ``cp[1]`` of ``cp[0]`` on ``seq_dim``."""
    out = {}
    for name, tensor in batch.items():
        tensor = take(tensor, Shard(0), *data)
        if seq_dim is not None:
            tensor = take(tensor, Shard(seq_dim), *cp)
        out[name] = tensor
    return out


def as_dtype(batch: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors of a batch in ``dtype`` (token ids and masks as they are)."""
    return {k: t.to(dtype) if t.is_floating_point() else t for k, t in batch.items()}
