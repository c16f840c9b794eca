"""A hand-written (Megatron-style) tensor-parallel MLP whose parameters are plain tensors, not
DTensors: the case declares where each rank's piece sits (``ModelCase.placements``), and the harness
assembles them. Used by tests/test_model_placements.py; ``noreduce`` forgets the row-parallel sum."""
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from harness.model import ModelCase
from harness.parallel.collectives import copy_to_group, reduce_from_group


def build():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return {"input": torch.randn(8, 16, generator=g), "target": torch.randn(8, 16, generator=g)}


def column_row(model, meshes, reduce: bool = True):
    """fc1 column-parallel (its rows and bias split over tp), fc2 row-parallel (its columns split,
    partial outputs summed over tp, the bias added once), by hand on plain tensors."""
    tp_mesh = meshes.dense["tp"]
    group, n, c = tp_mesh.get_group(), tp_mesh.size(), tp_mesh.get_local_rank()
    fc1, fc2 = model[0], model[2]
    with torch.no_grad():
        fc1.weight = nn.Parameter(fc1.weight.chunk(n, 0)[c].clone())
        fc1.bias = nn.Parameter(fc1.bias.chunk(n, 0)[c].clone())
        fc2.weight = nn.Parameter(fc2.weight.chunk(n, 1)[c].clone())
    fc1.forward = types.MethodType(lambda self, x: F.linear(copy_to_group(x, group), self.weight, self.bias), fc1)

    def row(self, h):
        partial = F.linear(h, self.weight)
        return (reduce_from_group(partial, group) if reduce else partial) + self.bias

    fc2.forward = types.MethodType(row, fc2)
    return model


CASE = ModelCase(build=build, batch=batch, loss=lambda out, b: F.mse_loss(out, b["target"]),
                 parallelize={"megatron": column_row, "noreduce": lambda m, meshes: column_row(m, meshes, reduce=False)},
                 placements={"0.weight": {"tp": Shard(0)}, "0.bias": {"tp": Shard(0)}, "2.weight": {"tp": Shard(1)}})
