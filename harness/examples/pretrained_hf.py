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

import torch
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


class LoadMismatch(AssertionError):
    """``from_pretrained`` loaded parameters other than those ``save_pretrained`` was given."""


def parallelize(model, meshes, tp_plan="auto"):
    """Save ``model``, load it with the TP plan, and check the load before any step: every loaded
    parameter, gathered (``full_tensor()``), must be the one saved; then the round trip, the
    sharded model saved as a training run saves it (``save_pretrained`` on every rank) and loaded
    again on one process, must give the saved parameters back. :class:`LoadMismatch` names each
    parameter that is not and where its rows came from."""
    from harness.examples.hf import DistributedConfig

    path = cell_dir()
    if dist.get_rank() == 0:
        model.save_pretrained(path)
    dist.barrier()
    loader = loading_class(model)
    loaded = loader.from_pretrained(path, distributed_config=DistributedConfig(tp_plan=tp_plan))
    saved = dict(model.named_parameters())
    if wrong := loaded_wrong(saved, dict(loaded.named_parameters())):
        raise LoadMismatch(f"from_pretrained loaded {len(wrong)} parameter(s) other than save_pretrained was given "
                           f"(each gathered with full_tensor()): {'; '.join(wrong)}")
    again = path / "saved-sharded"
    loaded.save_pretrained(again)  # every rank: transformers gathers the shards, one rank writes
    dist.barrier()
    if wrong := loaded_wrong(saved, dict(loader.from_pretrained(again).named_parameters())):
        raise LoadMismatch(f"the round trip: save_pretrained of the model from_pretrained loaded, loaded again on one "
                           f"process, holds {len(wrong)} parameter(s) other than the ones first saved: {'; '.join(wrong)}")
    return loaded


def loading_class(model):
    """What loads ``model``'s checkpoints as its users load them: ``AutoModelForCausalLM`` where it
    maps the model's config to the model's own class (the checkpoint's own config type is read then,
    whose model_type names its conversion: exaone's, built as a ``LlamaForCausalLM``, loaded by that
    class would come back a ``LlamaConfig`` and save ``model_type: llama``), else the class itself (a
    user's own subclass, a head the Auto class does not map)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    config = type(model.config)
    if config in MODEL_FOR_CAUSAL_LM_MAPPING and MODEL_FOR_CAUSAL_LM_MAPPING[config] is type(model):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM
    return type(model)


def loaded_wrong(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> list[str]:
    """One line per parameter of ``saved`` that ``loaded`` holds otherwise (missing, another
    shape, other values: where each of its rows came from), in ``saved``'s order."""
    from torch.distributed.tensor import DTensor

    wrong: dict[str, str | torch.Tensor] = {}  # name -> what is wrong, or the loaded tensor with other values
    for name, want in saved.items():
        got = loaded.get(name)
        if got is None:
            wrong[name] = "not loaded"
            continue
        got = (got.full_tensor() if isinstance(got, DTensor) else got).detach().to(want.dtype)
        if got.shape != want.shape:
            wrong[name] = f"shape {tuple(got.shape)}, saved {tuple(want.shape)}"
        elif not torch.equal(got, want.detach()):
            wrong[name] = got
    # only then, every saved row (the last dim's vectors) by its bytes: a wrong row is often another tensor's
    origin: dict[bytes, tuple[str, int]] = {}
    if any(isinstance(what, torch.Tensor) for what in wrong.values()):
        for name, tensor in reversed(list(saved.items())):
            for i, row in reversed(list(enumerate(_rows(tensor)))):
                origin[row] = (name, i)
    return [f"{name}: {what if isinstance(what, str) else rows_moved(name, what, origin)}"
            for name, what in wrong.items()]


def _rows(tensor: torch.Tensor) -> list[bytes]:
    flat = tensor.detach().reshape(-1, tensor.shape[-1]) if tensor.dim() else tensor.detach().reshape(1, 1)
    return [row.numpy().tobytes() for row in flat]


def rows_moved(name: str, loaded: torch.Tensor, origin: dict[bytes, tuple[str, int]]) -> str:
    """Where the rows of ``loaded`` (parameter ``name``; rows: its last dim's vectors, numbered
    through the leading dims) came from: ``rows 0-3 hold saved rows 8-11``, ``rows 4-7 hold
    k_proj.weight's rows 0-3``, ``rows 8-9 match no saved row``; runs of consecutive rows
    together, rows in their own place left out."""
    runs: list[list] = []  # [first row, last row, source name, first source row]
    for i, row in enumerate(_rows(loaded)):
        src, j = origin.get(row, (None, None))
        last = runs[-1] if runs else None
        if last and src == last[2] and (src is None or j == last[3] + i - last[0]):
            last[1] = i
        else:
            runs.append([i, i, src, j])
    moved = [f"rows {a}-{b} " + ("match no saved row" if src is None else
                                 f"hold saved rows {j}-{j + b - a}" if src == name else
                                 f"hold {src}'s rows {j}-{j + b - a}")
             for a, b, src, j in runs if not (src == name and j == a)]
    return ", ".join(moved) if moved else "its rows are the saved rows, in order, its values are not"


def tp_only(spec):
    used = [d for d in ("pp", "rep", "dp", "cp") if getattr(spec, d) > 1]
    return f"tp_plan='auto' shards over the whole world as tp, not {', '.join(used)}" if used else None


CASE = ModelCase(build=build, batch=batch, loss=loss, forward=forward, parallelize={"auto": parallelize},
                 supports={"auto": tp_only})


def cells():
    """The hfpretrained cells of ``cases/test_models.py``: the auto TP plan over worlds of 2 and 4."""
    return model_cells("hfpretrained", meshes=["tp=2", "tp=4"])
