"""transformers' model classes for the transformers models of ``harness/examples/`` (``llama_hf.py``,
``qwen3moe_hf.py``, ``qwen3moe_grouped_hf.py``, ``pretrained_hf.py``, ``accelerate_hf.py``), imported here.

This module is those models' ``skip`` path, so the pool's zygote imports it (and transformers, ~3 s)
once before it forks the ranks, and only in runs that select their cells; the model modules
themselves import it lazily, so registering them (every ``harness.registry`` user) stays cheap.
"""
from __future__ import annotations

from harness.parallel.thirdparty import _missing

try:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.distributed import DistributedConfig
except ImportError:  # pragma: no cover  skip() says how to install it
    LlamaConfig = LlamaForCausalLM = Qwen3MoeConfig = Qwen3MoeForCausalLM = DistributedConfig = None

__all__ = ["DistributedConfig", "LlamaConfig", "LlamaForCausalLM", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "skip",
           "skip_accelerate"]


def skip(cfg) -> str | None:
    """Skip the transformers models' cells when transformers is not installed, saying how to install it."""
    return _missing("transformers")


def skip_accelerate(cfg) -> str | None:
    """Skip ``accelerate_hf.py``'s cells when transformers or accelerate is not installed (both in the thirdparty extra)."""
    return _missing("transformers") or _missing("accelerate")
