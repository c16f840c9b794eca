"""transformers' tiny Llama loaded the way transformers users load it: ``save_pretrained``, then
``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`` on every rank.

This is a training script's parallelize, not one written for the harness: it ignores ``meshes``.
Rank 0 saves the model it is given (the harness's seeded start, already in the cell's dtype, so
the reference and this run start from the same weights) to ``harness.model.cell_dir()``, the
directory every rank of the cell shares; after a barrier every rank loads it with transformers'
own TP plan. transformers makes the mesh itself over the whole world (``tp_size`` is
``WORLD_SIZE``, the cell's), as it does under torchrun. No ``device_mesh=``: transformers 5.23.0
ignores it when a ``tp_plan`` is given (the plan's mesh is always ``tp_size`` ranks, the whole world).
"""
from __future__ import annotations

import torch.distributed as dist

from harness.model import ModelCase, cell_dir, model_cells

from harness.examples.llama_hf import batch, forward, loss

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 16, 32, 2, 4, 4  # 4 key/value heads: tp up to 4


def config():
    from harness.examples.hf import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=32,
                       attn_implementation="eager", tie_word_embeddings=False)


def build():
    from harness.examples.hf import LlamaForCausalLM

    return LlamaForCausalLM(config())


def parallelize(model, meshes, tp_plan="auto"):
    from harness.examples.hf import DistributedConfig

    path = cell_dir()
    if dist.get_rank() == 0:
        model.save_pretrained(path)
    dist.barrier()
    return type(model).from_pretrained(path, distributed_config=DistributedConfig(tp_plan=tp_plan))


def tp_only(spec):
    used = [d for d in ("pp", "rep", "dp", "cp") if getattr(spec, d) > 1]
    return f"tp_plan='auto' shards over the whole world as tp, not {', '.join(used)}" if used else None


CASE = ModelCase(build=build, batch=batch, loss=loss, forward=forward, parallelize={"auto": parallelize},
                 supports={"auto": tp_only})


def cells():
    """The hfpretrained cells of ``cases/test_models.py``: the auto TP plan over worlds of 2 and 4."""
    return model_cells("hfpretrained", meshes=["tp=2", "tp=4"])
