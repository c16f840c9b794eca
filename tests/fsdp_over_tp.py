"""A rank task for tests/test_model_placements.py: FSDP2 over TP on the cell's dp·tp mesh, as torchtitan
and transformers' plans build it, and each parameter as :func:`harness.model.placement.piece_of`
describes it without a collective (None where it cannot), beside torch's own ``full_tensor()``."""
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from harness.model.placement import piece_of


class Layers(nn.Module):
    def __init__(self):
        super().__init__()
        # rows of "even" split 12 = 2 tp x 2 dp x 3 each; "uneven"'s 6 give tp shards of 3, cut 2 and 1 by dp
        self.even, self.down, self.uneven = nn.Linear(5, 12), nn.Linear(12, 5), nn.Linear(5, 6)

    def forward(self, x):
        return self.down(self.even(x)) + self.uneven(x).sum(-1, keepdim=True)


def pieces(ctx, payload):
    torch.manual_seed(0)
    model = Layers()
    mesh = ctx.mesh(ctx.layout.dims)
    parallelize_module(model, mesh["tp"], {"even": ColwiseParallel(), "down": RowwiseParallel(),
                                           "uneven": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    degrees = dict(ctx.layout.dims)  # the placements as torch prints them: _S(0, 2) is strided, split factor 2
    return {name: (piece_of(p, degrees, gather=False), tuple(str(x) for x in p.placements),
                   p.full_tensor().detach().clone()) for name, p in model.named_parameters()}
