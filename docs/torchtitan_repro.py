"""A torchtitan maintainer's reproduction of the zoo's known crash, with nothing but torch and
torchtitan: a tiny qwen3 MoE (4 experts, top-2, softmax router) on 2 ranks, tensor parallel 2 with
expert parallel 2 borrowed from it (as ``ParallelDims`` borrows it), parallelized by qwen3's own
``parallelize_fn`` in the trainer's order (built on meta, ``init_weights``), one forward and backward
with torchtitan's ``cross_entropy_loss``.

    torchrun --nproc-per-node 2 docs/torchtitan_repro.py             # sequence parallel off: crashes
    torchrun --nproc-per-node 2 docs/torchtitan_repro.py --sp on     # sequence parallel on: runs

It exits 1 with the error where a rank raised, 0 where both ran. The CPU shims are the zoo's
(``harness.zoo.torchtitan.SHIMS``), each one line with why; none touches the parallel math.
"""
import argparse
import sys
import tempfile
import types
import warnings

import torch
import torch.distributed as dist

# the zoo's "partial" implementation (0.3.0's default, spmd_types, does not run on torch 2.13); the zoo
# shows the same crash under full_dtensor, whose inputs this script would have to make DTensors first
BACKEND = "partial_dtensor"
SIZES = dict(vocab=64, dim=64, heads=8, kv_heads=4, layers=2, batch=8, seq=8, experts=4, top_k=2)


def shims() -> None:
    kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")  # triton, GPU only, run by none
    kernels.__getattr__ = lambda name: triton_kernel(name)
    trainer = types.ModuleType("torchtitan.trainer")  # the real one imports the data and tracker stack
    trainer.Trainer = type("Trainer", (), {"Config": type("Config", (), {})})  # the models read its Config alone
    sys.modules.update({kernels.__name__: kernels, trainer.__name__: trainer})
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as utils

    utils.device_type, utils.device_module = "cpu", torch.cpu  # read at import: "cuda" without a GPU
    parallel_dims.device_type = "cpu"
    from torchtitan.models.common.moe import GroupedExperts

    GroupedExperts.forward = experts_in_their_dtype  # its hard-coded .bfloat16() casts: fp32 here


def triton_kernel(name: str):
    """What the stand-in kernels module gives for ``name``: a function that says it needs a GPU."""
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel(*args, **kwargs):
        raise RuntimeError(f"{name} is a triton kernel (GPU only)")
    return kernel


def experts_in_their_dtype(self, x_RD, num_tokens_per_expert_E):
    """``GroupedExperts.forward`` without its ``.bfloat16()`` casts (the zoo's shim)."""
    from torch.distributed.tensor import DTensor

    w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    h = torch.nn.functional.silu(self._grouped_mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offsets))
    h = h * self._grouped_mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offsets)
    return self._grouped_mm(A=h, B_t=w2.transpose(-2, -1), offs=offsets)


def qwen3_moe(parallelism):
    """The tiny qwen3 MoE's config from qwen3's own layer builder, each layer's attention torchtitan's
    own SDPA module (FlexAttention has no CPU backward), updated for the job as the trainer does."""
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention

    s, head_dim = SIZES, SIZES["dim"] // SIZES["heads"]
    layers = qwen3._build_qwen3_moe_layers(
        moe_hidden_dim=s["dim"], num_experts=s["experts"], top_k=s["top_k"], moe_comm_backend="standard",
        n_layers=s["layers"], dim=s["dim"], n_heads=s["heads"], n_kv_heads=s["kv_heads"], head_dim=head_dim,
        attn_backend="flex", rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1000000.0))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = qwen3.Qwen3Model.Config(
        dim=s["dim"], vocab_size=s["vocab"], layers=layers, norm=qwen3._qwen3_norm(s["dim"]),
        tok_embeddings=Embedding.Config(num_embeddings=s["vocab"], embedding_dim=s["dim"],
                                        param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=s["dim"], out_features=s["vocab"], param_init=qwen3._LINEAR_INIT))
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    return config


def say(line: str) -> None:
    """One line in one write: both ranks print to the same output, and print() writes its newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(sp: bool) -> int:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # deprecations and CPU notes: known, and not the finding
    shims()
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models import qwen3

    tp = dist.get_world_size()
    job = ParallelismConfig(tensor_parallel_degree=tp, expert_parallel_degree=tp, enable_sequence_parallel=sp,
                            spmd_backend=BACKEND)
    dims = ParallelDims.from_config(job, tp)
    dims.build_mesh()
    dist_utils.set_spmd_backend(job.spmd_backend)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = qwen3_moe(job).build()
    model = qwen3.model_registry("debugmodel").parallelize_fn(
        model, parallel_dims=dims, parallelism=job, compile_config=CompileConfig(enable=False), ac_config=None,
        training=TrainingConfig(mixed_precision_param="float32", local_batch_size=SIZES["batch"]),
        dump_folder=tempfile.gettempdir())
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    for module in model.modules():  # gloo has no PREMUL_SUM: a plain SUM, the same sum (the factor is 1)
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    g = torch.Generator().manual_seed(0)  # the same batch on every rank, as tp hands it over
    tokens = torch.randint(0, SIZES["vocab"], (SIZES["batch"], SIZES["seq"] + 1), generator=g)
    rank, setup = dist.get_rank(), f"{BACKEND}, tp={tp}, ep={tp} (borrowed from tp), sequence parallel {'on' if sp else 'off'}"
    try:
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
    except Exception as error:  # noqa: BLE001  the finding: say it, once per rank
        say(f"rank {rank}: {setup}: {type(error).__name__}: {str(error).splitlines()[0]}")
        return 1
    say(f"rank {rank}: {setup}: forward and backward ran, loss {loss.item():.6f}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sp", choices=("on", "off"), default="off", help="sequence parallelism (default: off)")
    code = main(parser.parse_args().sp == "on")
    sys.exit(code)
