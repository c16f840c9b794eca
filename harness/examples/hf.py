"""transformers' model classes for the transformers models of ``harness/examples/`` (``llama_hf.py``,
``qwen3moe_hf.py``, ``qwen3moe_grouped_hf.py``, ``pretrained_hf.py``, ``accelerate_hf.py``), imported here.

Those models name this module in their ``preload``, so the pools import it (and transformers, ~3 s)
once before they fork, and only in runs that select their cells; the model modules themselves
import it inside functions, so collecting and resolving their cells in the pytest process stays
cheap. Their ``skip`` paths (:mod:`harness.examples.needs`) find transformers without importing it.
"""
from __future__ import annotations

from harness.examples.needs import accelerate as skip_accelerate, transformers as skip  # noqa: F401  the old paths

try:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.distributed import DistributedConfig
except ImportError:  # pragma: no cover  skip() says how to install it
    LlamaConfig = LlamaForCausalLM = Qwen3MoeConfig = Qwen3MoeForCausalLM = DistributedConfig = None

__all__ = ["DistributedConfig", "LlamaConfig", "LlamaForCausalLM", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "skip",
           "skip_accelerate"]
