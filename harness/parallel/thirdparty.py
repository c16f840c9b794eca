"""Skips and known divergences of the third-party tp implementations (``tp_hf``, ``tp_megatron``);
the moe component's transformers implementation has its own (:mod:`.thirdparty_moe`), so a change to
the moe component reaches the moe cells alone (``pytest --changed``).

Kept apart from the implementations so that the parent process resolves them without importing
transformers or Megatron-Core (seconds each; the pool's zygote imports those once instead), and so
that a version bump reviews one file: every declared divergence is data here, run as a strict xfail,
and an upstream fix turns it into a failure that says to remove the entry.
"""
from __future__ import annotations

import importlib.util

from harness.config import Config
from harness.versions import about, declared

INSTALL = "pip install -e '.[thirdparty]'"

# op -> the transformers style variants of it that tp_hf runs (the ``style`` switch)
HF_STYLES = {
    "colgather": ("colwiserep", "colwisegather"),
    "colshard": ("colwise",),
    "rowsplit": ("rowwiserep", "rowwisesplit"),
    "rowshard": ("rowwise",),
    "mlp": ("colrow", "localparams"),
    "sp": ("seqpar", "gradallreduce"),
    "embed": ("embedrow", "embedcol"),
    "xent": ("colwisegather",),
    "gateup": ("packedcol", "packedrow"),
}

# style -> the style it is an alias of: transformers registers both names as equal instances of the same
# class (ColwiseParallel / RowwiseParallel with input and output Replicate()), so the cases run the alias on
# one mesh only, to show the name resolves and behaves the same
HF_ALIASES = {"colwiserep": "colwisegather", "rowwiserep": "rowwisesplit"}

# op -> the sizes Megatron-Core divides by the tp degree (utils.divide / ensure_divisibility)
MEGATRON_DIVIDES = {
    "colgather": ("f",), "colshard": ("f",), "rowsplit": ("f",), "rowshard": ("f",), "mlp": ("f",),
    "embed": ("v",), "xent": ("v",), "gateup": ("2f", "f"),
}


# ops whose Megatron-Core path gathers along the last dim, which allocates on CUDA
CUDA_ONLY = {"colgather": "ColumnParallelLinear(gather_output=True)'s forward gather",
             "rowsplit": "RowParallelLinear(input_is_parallel=False)'s backward (the gather of the split input's gradient)"}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _missing(package: str) -> str | None:
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed: {INSTALL}"
    return None


def hf_skip(cfg: Config) -> str | None:
    """Skip when transformers is not installed (with the install command) or the style is not one
    tp_hf runs for the op."""
    if reason := _missing("transformers"):
        return reason
    op, style = cfg.switch("op"), dict(cfg.switches).get("style")
    if style not in HF_STYLES.get(op, ()):
        return f"tp_hf runs op {op} with style one of {HF_STYLES.get(op)}, not {style!r}"
    tp = cfg.degree("tp")
    if op == "sp" and cfg.size("s") % tp:
        # Not a strict xfail: the mismatched all-gather aborts a rank (gloo enforce, SIGABRT), which
        # costs the pool a restart every run; the reason is the precondition DTensor imposes.
        return about("transformers", f"SequenceParallel and ColwiseParallel(input_layouts=Shard(1)) wrap the sequence "
                f"shard with DTensor.from_local without its global shape, which assumes even shards: s={cfg.size('s')} "
                f"over tp={tp} gives a mismatched all-gather (gloo: 'Received data size doesn't match expected "
                f"size', the rank aborts)")
    return None


def hf_xfail(cfg: Config) -> str | None:
    """Cells the pinned transformers is known to get wrong, with the upstream behaviour (none now;
    a reason goes through :func:`harness.versions.declared`, as the others do)."""
    return None


def megatron_skip(cfg: Config) -> str | None:
    """Skip when megatron-core is missing, for ops it has no CPU layer for, and where Megatron's
    own even-division precondition refuses the sizes (its message, as ``ensure_divisibility`` says it)."""
    if reason := _missing("megatron"):
        return reason.replace("megatron ", "megatron-core ")
    op, tp = cfg.switch("op"), cfg.degree("tp")
    if op == "sp":
        return about("megatron-core", "its sequence-parallel layers allocate their gather and reduce-scatter "
                "buffers on torch.cuda.current_device() (mappings._gather_along_first_dim, LinearWithGradAccumulation"
                "AndAsyncCommunication.backward): CUDA only, not wired for this CPU harness")
    if op in CUDA_ONLY and tp > 1 and not _cuda():
        return about("megatron-core", f"raises 'Torch not compiled with CUDA enabled': {CUDA_ONLY[op]} allocates "
                "its output on torch.cuda.current_device() (mappings._gather_along_last_dim)")
    for key in MEGATRON_DIVIDES[op]:
        size = 2 * cfg.size("f") if key == "2f" else cfg.size(key)
        if size % tp:
            return about("megatron-core", f"refuses it: {size} is not divisible by {tp} ({key} over tp)")
    return None


def megatron_xfail(cfg: Config) -> str | None:
    """Cells the pinned Megatron-Core is known to get wrong, with the upstream behaviour."""
    if cfg.switch("op") == "xent" and cfg.dtype == "fp32":
        return declared("megatron-core", "vocab_parallel_cross_entropy overwrites its fp32 logits in place with "
                "exp(logits - max) (calculate_predicted_logits: 'In-place subtraction reduces memory pressure'; a bf16 input is "
                "first copied by .float(), so only fp32 logits are clobbered): the layer's output 'out' reads back "
                "as unnormalised probabilities after the loss",
                        shows=r"^ +out +mismatch ")
    return None
