"""The training step every parallel implementation ends with, after its backward."""
from __future__ import annotations

import sys

import torch

from reference.common import sgd_step

from .collectives import all_reduce_


def _is_dtensor(t) -> bool:
    # Without importing DTensor (half a second): no DTensor exists unless its module was imported.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def reduce_and_step(params: list[torch.Tensor], loss: torch.Tensor, split_over: list) -> torch.Tensor:
    """Sum gradients over the groups the tokens were split over, take the SGD step, return the loss.

    Each rank's loss is normalised by the global token count, so over the groups that split the
    tokens (dp, cp) gradients and the loss add up; ``loss`` must already be complete over the
    groups that split the model (tp). Groups that are None or of one rank are skipped.
    """
    grads = [_local(p.grad) for p in params]
    total = _local(loss.full_tensor() if _is_dtensor(loss) else loss).detach().clone()
    for group in split_over:
        all_reduce_(grads, group)
        all_reduce_([total], group)
    with torch.no_grad():
        sgd_step(params)
    return total
