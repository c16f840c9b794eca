"""A user's hand-written (Megatron-style) tensor parallelism on plain tensors, with the placements
declared to the harness: right in training, wrong in a checkpoint, which stores each plain tensor as
a replica (rank 0's shard as the whole weight). For tests/test_reshard.py. And the same split with
the reduction in the caller of the row-parallel layer, right and with a gradient bug, for
tests/test_users_diagnosis.py."""
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


def split(mlp: MLP, meshes):
    """fc1 column-parallel, fc2 row-parallel: each rank's shards as plain parameters. The tp group."""
    group, n = meshes.group("tp"), meshes.spec.tp
    c = torch.distributed.get_rank(group)
    with torch.no_grad():
        for module, name, dim in ((mlp.fc1, "weight", 0), (mlp.fc1, "bias", 0), (mlp.fc2, "weight", 1)):
            setattr(module, name, nn.Parameter(take(getattr(module, name), Cut(dim), n, c).clone()))
    return group


def hand_tp(model, meshes):
    """The split, fc2's partial outputs summed over tp (forward all-reduce, identity backward, as
    Megatron's row-parallel layer)."""
    group = split(model, meshes)
    model.fc2.register_forward_hook(lambda module, args, out: reduce_from_group(out, group))
    return model


def fsdp(model, meshes):
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=meshes.mesh("fsdp"))


HANDTP = ModelCase(build=MLP, batch=batch, loss=loss, parallelize={"handtp": hand_tp, "fsdp": fsdp},
                   placements={"fc1.*": {"tp": Shard(0)}, "fc2.weight": {"tp": Shard(1)}})


# ---- a row-parallel layer whose caller reduces it ------------------------------------------------------
class Net(nn.Module):
    """The MLP inside a model with a head: ``mlp.fc2``'s caller is ``mlp``, not the model."""

    def __init__(self):
        super().__init__()
        self.mlp, self.head = MLP(), nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.mlp(x))


def caller_reduces(model, meshes):
    """The split, fc2's partial outputs summed over tp by the MLP that calls it (a forward hook on
    ``mlp``): fc2 returns per-rank partial sums by design, and ``mlp`` the whole."""
    group = split(model.mlp, meshes)
    model.mlp.register_forward_hook(lambda module, args, out: reduce_from_group(out, group))
    return model


def caller_reduces_fc2_gradient_twice(model, meshes):
    """The same, with a backward-only bug in fc2: its weight's gradient doubled on each rank. Where it
    starts is fc2's parameter gradients, in the backward pass; fc2's partial output is by design."""
    made = caller_reduces(model, meshes)
    made.mlp.fc2.weight.register_hook(lambda grad: grad * 2)
    return made


CALLER_REDUCES = ModelCase(
    build=Net, batch=batch, loss=loss,
    parallelize={"callerreduces": caller_reduces, "fc2gradtwice": caller_reduces_fc2_gradient_twice},
    placements={"mlp.fc1.*": {"tp": Shard(0)}, "mlp.fc2.weight": {"tp": Shard(1)}})
