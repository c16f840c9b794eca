"""``harness.parallel.optim.ShardwiseAdamW``, the optimizer of the model, FSDP2 and checkpoint cells,
steps each DTensor parameter on its local shard: on real gloo ranks, over ten steps, every parameter
and every AdamW state it leaves is bit for bit what ``torch.optim.AdamW(foreach=False)`` leaves
stepping the DTensors themselves, for replicated, sharded, doubly and unevenly sharded, dim-1 sharded
and 0-dim parameters in fp32 and fp64; its state stays DTensors (what checkpoints and the comparison
read)."""
import torch

TP4 = (("tp", 4),)


def steps_agree(ctx, payload):
    """Pool task: both optimizers over the same ten steps on a 2x2 mesh of this world's 4 ranks."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from harness.model.case import ADAMW
    from harness.parallel.optim import ShardwiseAdamW

    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("a", "b"))
    shapes = [((7, 5), [Replicate(), Shard(0)]), ((9,), [Shard(0), Shard(0)]), ((4, 6), [Replicate(), Replicate()]),
              ((3, 8), [Shard(1), Replicate()]), ((), [Replicate(), Replicate()])]
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(shape, generator=g, dtype=dtype) for shape, _ in shapes for dtype in (torch.float32, torch.float64)]
    placements = [p for _, p in shapes for _ in range(2)]
    grads = [[torch.randn(f.shape, generator=g, dtype=f.dtype) for f in fulls] for _ in range(10)]
    left = {}
    for name, make in (("dtensor", lambda ps: torch.optim.AdamW(ps, **ADAMW, foreach=False)),
                       ("shardwise", lambda ps: ShardwiseAdamW(ps, **ADAMW, foreach=False))):
        params = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, p)) for f, p in zip(fulls, placements)]
        opt = make(params)
        for step in grads:
            for param, grad, p in zip(params, step, placements):
                param.grad = distribute_tensor(grad, mesh, p)
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert all(isinstance(v, DTensor) for param in params for k, v in opt.state[param].items() if k != "step")
        assert all(isinstance(param, DTensor) for group in opt.param_groups for param in group["params"])
        left[name] = [param.full_tensor() for param in params] + [
            v.full_tensor() if isinstance(v, DTensor) else v for param in params for _, v in sorted(opt.state[param].items())]
    return [bool(torch.equal(a, b)) for a, b in zip(left["dtensor"], left["shardwise"])]


def test_the_shardwise_step_is_the_dtensor_step_bit_for_bit(small_pool):
    got = small_pool.run("tests.test_shardwise_adamw:steps_agree", None, TP4)
    assert set(got) == set(range(4))
    for rank, equal in got.items():
        assert len(equal) == 10 * 4 and all(equal), (rank, equal)  # 10 parameters, 3 states each
