"""accelerate's ND parallelism as its users write it: ``ParallelismConfig`` -> ``Accelerator`` ->
``from_pretrained(tp_plan="auto", device_mesh=accelerator.torch_device_mesh)`` -> ``accelerator.prepare``.

The parallelize of accelerate's ``examples/torch_native_parallelism/nd_parallel.py`` (accelerate 1.15.0)
on ``harness/examples/pretrained_hf.py``'s tiny Llama: the cell's degrees as its command line
(``dp_replicate_size`` = rep, ``dp_shard_size`` = dp, ``tp_size`` = tp), an FSDP2 plugin wrapping each
``LlamaDecoderLayer`` when dp_shard > 1, the model saved on the main process to ``cell_dir()`` and loaded
by every rank (with transformers' TP plan when tp > 1), then ``prepare(model, optimizer)``: FSDP2 over
accelerate's ``dp_shard_cp`` mesh. The harness trains with its own optimizer, made after ``prepare``
on the same (in-place sharded) parameters.

Declared (strict xfail, :func:`known`): accelerate runs a ``ParallelismConfig`` only on GPUs, and
transformers 5.23.0 does not take accelerate's mesh for TP when the world also has dp_shard.
"""
from __future__ import annotations

import torch

from harness.known import Known
from harness.model import ModelCase, cell_dir, model_cells

from harness.examples.llama_hf import batch, forward, loss
from harness.examples.pretrained_hf import build


def parallelize(model, meshes, config=None):
    from accelerate import Accelerator, ParallelismConfig
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin

    # a script makes one Accelerator per process; the harness runs cells one after another in its rank
    # processes, and accelerate keeps the first one's state (its ParallelismConfig, its mesh) process-wide
    AcceleratorState._reset_state(reset_partial_state=True)
    spec = meshes.spec
    config = config or ParallelismConfig(dp_replicate_size=spec.rep, dp_shard_size=spec.dp, tp_size=spec.tp)
    fsdp2_plugin = None
    if config.dp_shard_enabled:
        fsdp2_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                      transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    accelerator = Accelerator(parallelism_config=config, fsdp_plugin=fsdp2_plugin, cpu=not torch.cuda.is_available())
    path = cell_dir()
    if accelerator.is_main_process:
        model.save_pretrained(path)
    accelerator.wait_for_everyone()
    tp = {"tp_size": config.tp_size, "tp_plan": "auto", "device_mesh": accelerator.torch_device_mesh} \
        if config.tp_enabled else {}
    model = type(model).from_pretrained(path, **tp)
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    return model


CPU = ("accelerate 1.15.0 runs a ParallelismConfig on GPUs only: on CPU, Accelerator(parallelism_config=..., "
       "cpu=True) raises 'ParallelismConfig is only compatible DistributedType.FSDP (version 2) or "
       "DistributedType.Multi{Device} or DistributedType.DEEPSPEED, but got DistributedType.MULTI_CPU' "
       "(accelerate's multi-process CPU path is DDP, and FSDP is enabled only for GPU-like devices)")
TP_MESH = ("transformers 5.23.0's from_pretrained(tp_size=N, tp_plan='auto', device_mesh=accelerator.torch_device_mesh) "
           "ignores device_mesh and builds its own mesh of tp_size ranks, which must be the whole world: with dp_shard "
           "it raises 'The parallel mesh requires 2 processes, but world_size is 4' (measured with dp_shard=2, tp=2 "
           "on 4 CPU ranks, no accelerate involved)")


def known(cfg) -> str | None:
    """The cells accelerate 1.15.0 with transformers 5.23.0 cannot run (strict xfail), with why."""
    if not torch.cuda.is_available():
        return Known(CPU, shows=r"^ValueError: ParallelismConfig is only compatible")
    if cfg.degree("tp") > 1 and cfg.degree("tp") < cfg.world:
        return TP_MESH
    return None


def no_cp_pp(spec):
    return "this parallelize sets dp_replicate, dp_shard and tp only" if spec.cp > 1 or spec.pp > 1 else None


CASE = ModelCase(build=build, batch=batch, loss=loss, forward=forward, parallelize={"nd": parallelize},
                 supports={"nd": no_cp_pp}, xfail={"nd": known})


def cells():
    """The accelerate cells of ``cases/test_models.py``: FSDP2 alone and dp_shard x tp (both declared on CPU)."""
    return model_cells("accelerate", meshes=["dp=2", "dp=2,tp=2"])
