"""Planted bugs in users' parallelize functions for the shipped users' cases (tests/test_users_cases.py):
each a mistake made in the user's own code, through the framework's own API, never a flag in production code.

* ``PARTIAL``: ``harness/examples/pretrained_hf.py`` loading with a ``tp_plan`` that overrides
  ``model.layers.*.mlp.down_proj`` with a rowwise style that does not reduce (registered as transformers'
  users register a style): each rank keeps its partial sum of the down projection;
* ``LOSSWORLD``: the same model under its shipped TP plan, its loss divided by the world size (as if
  averaged by hand for data parallelism): every gradient is the reference over tp;
* ``ACCEL``: ``harness/examples/accelerate_hf.py`` with ``ParallelismConfig(dp_shard_size=WORLD_SIZE,
  tp_size=2)``: the dp_shard dim built from the whole world, the tp ranks not taken out;
* ``NOFP64``: ``harness/examples/qwen3moe_grouped_hf.py`` as a user first writes it, without
  ``fp32_ops``: its ``grouped_mm`` experts have no fp64 kernel for the reference;
* ``SAVEDSWAPPED``: ``harness/examples/pretrained_hf.py`` with a user's model class whose
  ``save_pretrained`` of a sharded model writes the first query projection's two tp shards in the
  wrong order (as a gather that puts rank 1's rows first): it loads right and saves wrong;
* ``CONVERTERSWAPPED``: a tiny model family of the user's own, ``FusedMLPLlamaForCausalLM``, whose
  checkpoints hold each MLP's gate and up projections as one fused ``gate_up_proj`` (the converter
  registered with transformers' ``register_checkpoint_conversion_mapping``: a ``Chunk`` on load, its
  reverse, a ``Concatenate``, on save), its TP plan the attention's; the load's split takes the two
  halves in the wrong order (written for a checkpoint that fuses up before gate): every MLP loads
  gate's rows as up's and up's as gate's.
"""
import dataclasses

import torch.distributed as dist

from harness.examples import accelerate_hf, pretrained_hf, qwen3moe_grouped_hf
from harness.model import ModelCase


def rowwise_without_reduce(model, meshes):
    """``from_pretrained(..., distributed_config=DistributedConfig(tp_plan={"model.layers.*.mlp.down_proj":
    "rowwise_local"}))`` with ``rowwise_local`` a ``RowwiseParallel`` whose output stays ``Partial()``."""
    from torch.distributed.tensor import Partial
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
    from transformers.distributed.tensor_parallel import RowwiseParallel

    ALL_PARALLEL_STYLES.register("rowwise_local", RowwiseParallel(output_layouts=Partial()))
    return pretrained_hf.parallelize(model, meshes, tp_plan={"model.layers.*.mlp.down_proj": "rowwise_local"})


def loss_over_world(out, batch):
    """The model's loss divided by the world size."""
    return pretrained_hf.loss(out, batch) / dist.get_world_size()


def dp_shard_over_the_world(model, meshes):
    """accelerate's ND parallelism with the dp_shard degree taken from the whole world."""
    from accelerate import ParallelismConfig

    config = ParallelismConfig(dp_shard_size=dist.get_world_size(), tp_size=meshes.spec.tp)
    return accelerate_hf.parallelize(model, meshes, config=config)


PARTIAL = ModelCase(build=pretrained_hf.build, batch=pretrained_hf.batch, loss=pretrained_hf.loss,
                    forward=pretrained_hf.forward, parallelize={"partial": rowwise_without_reduce})
LOSSWORLD = dataclasses.replace(PARTIAL, loss=loss_over_world, parallelize={"auto": pretrained_hf.parallelize})
ACCEL = ModelCase(build=accelerate_hf.build, batch=accelerate_hf.batch, loss=accelerate_hf.loss,
                  forward=accelerate_hf.forward, parallelize={"worldshard": dp_shard_over_the_world})
NOFP64 = dataclasses.replace(qwen3moe_grouped_hf.CASE, fp32_ops=())


SWAPPED = "model.layers.0.self_attn.q_proj.weight"


def shards_saved_swapped():
    """A tiny Llama whose class saves a sharded model with :data:`SWAPPED`'s two halves of rows
    swapped (a plain model, as rank 0 saves the seeded start, is saved right)."""
    from safetensors.torch import load_file, save_file
    from torch.distributed.tensor import DTensor

    from harness.examples.hf import LlamaForCausalLM

    class ShardsSavedSwapped(LlamaForCausalLM):
        def save_pretrained(self, save_directory, *args, **kwargs):
            super().save_pretrained(save_directory, *args, **kwargs)
            if any(isinstance(p, DTensor) for p in self.parameters()):  # every rank saves a sharded model
                if dist.get_rank() == 0:
                    file = f"{save_directory}/model.safetensors"
                    tensors = load_file(file)
                    rows = tensors[SWAPPED].shape[0] // 2
                    tensors[SWAPPED] = tensors[SWAPPED].roll(rows, 0).contiguous()
                    save_file(tensors, file, metadata={"format": "pt"})
                dist.barrier()

    return ShardsSavedSwapped(pretrained_hf.config())


SAVEDSWAPPED = dataclasses.replace(LOSSWORLD, build=shards_saved_swapped, loss=pretrained_hf.loss)


def converter_swapped():
    """A tiny model of the fused-MLP family (``CONVERTERSWAPPED``); its converter is registered once
    per process, by class name, as a family's own module registers it on import."""
    from transformers.conversion_mapping import (USER_REGISTERED_MAPPINGS, register_checkpoint_conversion_mapping)
    from transformers.core_model_loading import Chunk, WeightConverter

    from harness.examples.hf import LlamaConfig, LlamaForCausalLM

    class SplitGateUp(Chunk):
        """The fused rows into gate and up: the halves in the wrong order (the planted bug)."""

        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            out = super().convert(input_dict, source_patterns, target_patterns, **kwargs)
            return dict(zip(out, reversed(list(out.values()))))

    class FusedMLPLlamaConfig(LlamaConfig):
        # the attention's TP plan: the fused MLP stays whole on every rank, so the load splits it alone
        base_model_tp_plan = {k: v for k, v in LlamaConfig.base_model_tp_plan.items() if ".mlp." not in k}

    class FusedMLPLlamaForCausalLM(LlamaForCausalLM):
        config_class = FusedMLPLlamaConfig

    if "FusedMLPLlamaForCausalLM" not in USER_REGISTERED_MAPPINGS:
        register_checkpoint_conversion_mapping("FusedMLPLlamaForCausalLM", [WeightConverter(
            source_patterns="mlp.gate_up_proj.weight", target_patterns=["mlp.gate_proj.weight", "mlp.up_proj.weight"],
            operations=[SplitGateUp(dim=0)])])
    return FusedMLPLlamaForCausalLM(FusedMLPLlamaConfig(**pretrained_hf.config().to_dict()))


CONVERTERSWAPPED = dataclasses.replace(SAVEDSWAPPED, build=converter_swapped)
