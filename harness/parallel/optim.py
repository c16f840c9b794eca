"""The optimizer step on DTensor parameters, taken on their local shards.

AdamW's single-tensor step is elementwise, so on a shard it computes what the DTensor step computes,
bit for bit; through DTensor it misses the sharding-propagation cache every step (its bias
corrections are new scalars each step, and the cache keys on them), which made the optimizer step
most of the cost of a model cell on 8 ranks and of a checkpoint cell under FSDP2.
"""
from __future__ import annotations

from typing import Iterable

import torch

from reference.common import ADAMW


class ShardwiseAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW``, its step run on each DTensor parameter's local shard when the
    parameter's gradient has the parameter's placements (Shard/Replicate, no Partial). State stays
    DTensors (checkpoints and the results read them as before); any other parameter takes AdamW's own
    DTensor or tensor path."""

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor

        swapped = []  # (group, index, the DTensor parameter, its local shard, its state before the step)
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if (isinstance(p, DTensor) and isinstance(p.grad, DTensor)
                        and tuple(p.grad.placements) == tuple(p.placements) and p.grad.device_mesh == p.device_mesh):
                    local = p.to_local()  # under no_grad: the shard itself, which the step updates in place
                    local.grad = p.grad.to_local()
                    state = self.state.pop(p, None)
                    if state:
                        self.state[local] = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}
                    group["params"][i] = local
                    swapped.append((group, i, p, local, state))
        try:
            return super().step(closure)
        finally:
            for group, i, p, local, state in swapped:
                group["params"][i] = p
                local.grad = None
                new = self.state.pop(local, None)
                if state:  # the same local tensors, updated in place
                    self.state[p] = state
                elif new is not None:  # first step: wrap the new state as the parameter is
                    self.state[p] = {k: (DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                                            shape=p.shape, stride=p.stride())
                                         if k != "step" else v)
                                     for k, v in new.items()}


def shardwise_adamw(params: Iterable[torch.Tensor]) -> ShardwiseAdamW:
    """``reference.common.adamw``'s optimizer (the one both sides of a component use), stepped shard by
    shard on DTensor parameters."""
    return ShardwiseAdamW(params, **ADAMW, foreach=False)
