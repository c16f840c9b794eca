"""A user's hand-written (Megatron-style) tensor parallelism on plain tensors, with the placements
declared to the harness: right in training, wrong in a checkpoint, which stores each plain tensor as
a replica (rank 0's shard as the whole weight). For tests/test_reshard.py."""
import torch
from torch import nn
from torch.distributed.tensor import Shard

from harness.layout import take
from harness.layout import Shard as Cut
from harness.model import ModelCase
from harness.parallel.collectives import reduce_from_group


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return {"input": torch.randn(8, 8, generator=g), "target": torch.randn(8, 8, generator=g)}


def loss(out, batch):
    return ((out - batch["target"]) ** 2).mean()


def hand_tp(model, meshes):
    """fc1 column-parallel, fc2 row-parallel, its partial outputs summed over tp (forward all-reduce,
    identity backward, as Megatron's row-parallel layer)."""
    group, n = meshes.group("tp"), meshes.spec.tp
    c = torch.distributed.get_rank(group)
    with torch.no_grad():
        for module, name, dim in ((model.fc1, "weight", 0), (model.fc1, "bias", 0), (model.fc2, "weight", 1)):
            setattr(module, name, nn.Parameter(take(getattr(module, name), Cut(dim), n, c).clone()))
    model.fc2.register_forward_hook(lambda module, args, out: reduce_from_group(out, group))
    return model


def fsdp(model, meshes):
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=meshes.mesh("fsdp"))


HANDTP = ModelCase(build=MLP, batch=batch, loss=loss, parallelize={"handtp": hand_tp, "fsdp": fsdp},
                   placements={"fc1.*": {"tp": Shard(0)}, "fc2.weight": {"tp": Shard(1)}})
