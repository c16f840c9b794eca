"""A Megatron-Core maintainer's reproduction of the zoo's finding, with nothing but torch and
megatron-core: a tiny MoE ``GPTModel`` from the local layer spec, tensor parallel with sequence
parallelism on 2 ranks, through Megatron's own ``DistributedDataParallel`` and
``finalize_model_grads`` (the allgather token dispatcher: the zoo finds the same under the all-to-all
one), one forward and backward; prints every parameter that each tp rank holds
whole (the same values on every rank) but whose gradient differs between the ranks: its copies
drift apart at the next optimizer step (a missing all-reduce over tp).

    torchrun --nproc-per-node 2 docs/megatron_repro.py            # ep 1, experts whole on each rank (etp 1)
    torchrun --nproc-per-node 2 docs/megatron_repro.py --etp 2    # experts split over tp (the default): nothing wrong

It exits 1 where it found one, 0 where every such gradient agrees. The CPU shims are the zoo's
(``harness.zoo.megatron.SHIMS``), each one line with why; none touches the parallel math.
"""
import argparse
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F


def shims() -> None:
    import megatron.core.jit

    megatron.core.jit.jit_fuser = lambda function: function  # eager, as disable_jit_fuser() sets it
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    torch.cuda.current_device = lambda: "cpu"  # Megatron allocates its buffers on the current device
    if not hasattr(moe_utils, "te_general_gemm"):  # defined only by Transformer Engine's import
        moe_utils.te_general_gemm = None
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # no dropout; the CUDA one seeds CUDA


class Norm:
    """torch's RMSNorm marked ``sequence_parallel`` as Megatron's fused and TE norms are (the local
    spec's WrappedTorchNorm refuses sequence parallelism)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        layer = torch.nn.RMSNorm(hidden_size, eps=eps)
        for p in layer.parameters():
            p.sequence_parallel = config.sequence_parallel
        return layer


def main(etp: int) -> int:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # no Apex, no Transformer Engine, deprecations: known, and not the finding
    tp = dist.get_world_size()
    shims()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, normalization="RMSNorm",
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, sequence_parallel=True, params_dtype=torch.float32,
        use_cpu_initialization=True, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        expert_tensor_parallel_size=etp, bias_activation_fusion=False, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False, moe_permute_fusion=False, moe_router_fusion=False)
    layer = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = Norm
    block = TransformerBlockSubmodules(layer_specs=[layer] * config.num_layers, layer_norm=Norm)
    torch.manual_seed(0)  # the same start on every rank: what each holds whole, it holds alike
    model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=64, max_sequence_length=16,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    ddp = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=False))
    group = parallel_state.get_tensor_model_parallel_group()

    def alike(t: torch.Tensor) -> bool:
        each = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(each, t.detach().contiguous(), group=group)
        return all(torch.equal(each[0], other) for other in each[1:])

    whole = [(name, p) for name, p in model.named_parameters() if alike(p)]
    tokens = torch.randint(64, (2, 9), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8).expand(2, 8)
    causal = torch.ones(1, 1, 8, 8, dtype=torch.bool).triu(1)
    ddp(tokens[:, :-1], positions, causal, labels=tokens[:, 1:]).float().mean().backward()
    finalize_model_grads([ddp])
    wrong = [name for name, p in whole if not alike(p.main_grad)]
    if dist.get_rank() == 0:
        print(f"megatron-core, tp={tp} with sequence parallel, ep=1, etp={etp}: {len(whole)} parameters held "
              f"whole on every tp rank")
        for name in wrong:
            print(f"{name}: the tp ranks' gradients differ: its all-reduce over tp is missing")
        if not wrong:
            print("every one's gradient is the same on each tp rank")
    dist.destroy_process_group()
    return 1 if wrong else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--etp", type=int, default=1, help="the experts' tensor-parallel size: 1 or the world's")
    sys.exit(main(parser.parse_args().etp))
