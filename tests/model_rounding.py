"""Tiny GLM-4 and OLMo-2 from their transformers configs, parallelized by transformers' own TP plan
(``maybe_distribute_model``, as ``harness/examples/llama_hf.py`` applies it): right code whose fp32
cells differ from the fp64 reference by fp32 rounding alone, amplified by AdamW on a few elements of
small tensors (tests/test_tolerance_models.py). ``HALFGRAD`` is the same GLM-4 with a planted TP bug.
"""
from __future__ import annotations

import dataclasses

import torch

from harness.examples.llama_hf import batch, distribute, forward, loss
from harness.model import ModelCase

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 16, 32, 2, 4, 2


def _sizes():
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=32,
                attn_implementation="eager", tie_word_embeddings=False, pad_token_id=0)


def glm4():
    from transformers import Glm4Config, Glm4ForCausalLM

    return Glm4ForCausalLM(Glm4Config(**_sizes(), head_dim=HIDDEN // HEADS))


def olmo2():
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return Olmo2ForCausalLM(Olmo2Config(**_sizes()))


def tp(model, meshes):
    """transformers' own TP plan of the model over the cell's tp ranks."""
    return distribute(model, meshes, tp_size=meshes.spec.tp)


def tp_halving_a_gradient(model, meshes):
    """The plan, with the gradient of every layer's ``o_proj`` weight halved (a gradient divided by the
    tp degree twice, say)."""
    model = tp(model, meshes)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.register_hook(lambda g: g / 2)
    return model


GLM4 = ModelCase(build=glm4, batch=batch, loss=loss, forward=forward, parallelize={"tp": tp})
OLMO2 = ModelCase(build=olmo2, batch=batch, loss=loss, forward=forward, parallelize={"tp": tp})
HALFGRAD = dataclasses.replace(GLM4, parallelize={"halfgrad": tp_halving_a_gradient})
