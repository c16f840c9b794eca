"""A user's expert-parallel plan with a planted bug (tests/test_model_bugs_moe.py), on transformers'
tiny Qwen3-MoE (harness/examples/qwen3moe_hf.py). Never a flag in production code: the bug is a parallelize
function of its own, registered as the ``noexpsum`` implementation of the ``qwen3moebug`` model."""
import dataclasses

import torch

from torch.distributed.fsdp import fully_shard

from harness.examples import qwen3moe_hf


def ep_without_expert_sum(model, meshes):
    """transformers' EP plan (all_to_all) by hand, FSDP2 over dp for everything but the experts,
    which are left out of it (``ignored_params``) and so never summed over their copies (efsdp): each
    copy of an expert steps on the gradient of the tokens its own ep group routed to it."""
    from harness.examples.hf import DistributedConfig
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    spec = meshes.spec
    _, ep_plan, _ = model._resolve_parallel_plans(DistributedConfig(ep_size=spec.ep, fsdp_size=spec.dp))
    apply_expert_parallelism(model, meshes.sparse["ep"], meshes.dense["tp"], ep_plan, ep_implementation="all_to_all")
    experts = {p for name, p in model.named_parameters() if ".mlp.experts." in name}
    for layer in model.model.layers:
        fully_shard(layer, mesh=meshes.mesh("fsdp"), ignored_params=experts)
    fully_shard(model, mesh=meshes.mesh("fsdp"), ignored_params=experts)
    return model


NOEXPSUM = dataclasses.replace(qwen3moe_hf.CASE, parallelize={"noexpsum": ep_without_expert_sum}, supports={})


class _GradTwice(torch.autograd.Function):
    """The identity forward; twice the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


def ep_router_grad_twice(model, meshes):
    """transformers' own EP plan (all_to_all) and FSDP2, with a backward-only bug in the last layer's
    router: the gradient of its routing weights is doubled on its way back, the forward untouched."""
    made = qwen3moe_hf.ep(model, meshes)
    gate = made.model.layers[1].mlp.gate
    gate.register_forward_hook(lambda module, args, out: (out[0], _GradTwice.apply(out[1]), out[2]))
    return made


def tp_ep_router_grad_twice(model, meshes):
    """The same router bug under transformers' TP and EP plans together, the experts over the
    tensor-parallel ranks: every rank is given the same tokens."""
    from harness.examples.llama_hf import distribute

    spec = meshes.spec
    made = distribute(model, meshes, tp_size=spec.tp, ep_size=spec.ep, ep_implementation="all_to_all")
    gate = made.model.layers[1].mlp.gate
    gate.register_forward_hook(lambda module, args, out: (out[0], _GradTwice.apply(out[1]), out[2]))
    return made


ROUTERGRAD = dataclasses.replace(qwen3moe_hf.CASE, parallelize={"routergrad": ep_router_grad_twice,
                                                                "tproutergrad": tp_ep_router_grad_twice},
                                 supports={})
