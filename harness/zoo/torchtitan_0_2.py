"""torchtitan 0.2, the release before, through its own functions (``python -m harness.zoo torchtitan``
with torchtitan 0.2 installed; docs/zoo.md).

The same cells as :mod:`harness.zoo.torchtitan`'s, where this release has them, by the same ids, so
that ``python -m harness.zoo diff`` says what changed between the two releases. 0.2 builds a model
from its ``TrainSpec`` (``get_train_spec(name)``: the model class, its ``debugmodel`` args, shrunk to
:data:`~harness.zoo.torchtitan.SIZES`) and parallelizes it from a ``JobConfig`` over a
``ParallelDims`` of explicit degrees, where 0.3 reads ``model_registry`` and its configs; the order is
the trainer's: built on meta, ``parallelize_fn`` (or, on a pp mesh, ``pipelining_fn``), ``to_empty``,
``init_weights``, then the seeded start loaded by name. One implementation, ``partial``: 0.2's DTensor
path is what 0.3 calls ``partial_dtensor`` (0.2 has no SPMD backends).

CPU shims, none touching the parallel math: :data:`SHIMS` (the reports list them).
"""
from __future__ import annotations

import dataclasses
import types
from functools import lru_cache
from importlib.util import find_spec

import torch

from harness.known import Known
from harness.model import ModelCase, Pipelined, load_shards, model_cells, running, switches
from harness.model.register import model_component
from harness.registry import register_component
from harness.zoo import require_release, stand_in
from harness.zoo.torchtitan import (BF16_MESHES, MESHES, SCHEDULES, SIZES, TorchtitanMissing, batch, forward, loss,
                                    materialised, name_of, plain_sums, share, version)

VERSION = "0.2.2"  # the release the shims and tiny args are written against
INSTALL = f"pip install -e '.[torchtitan]' && pip install --no-deps torchtitan=={VERSION}"
PLANS = ("partial",)
# the TrainSpec each zoo model is built from, and its debugmodel's args this zoo changes besides SIZES
SPECS = {"llama3": ("llama3", {}), "qwen3": ("qwen3", {"enable_weight_tying": False}),
         "qwen3_tied": ("qwen3", {"enable_weight_tying": True})}
CONFIGS = dict.fromkeys(SPECS)  # what --only may name
TIED = ("qwen3_tied",)
NOT_RUN = {
    "qwen3, pp meshes": "0.2's qwen3 TrainSpec has no pipelining_fn",
    "qwen3, tp meshes": "its attention runs SDPA on DTensors (q/k norms sharded over heads, use_local_output=False), "
                        "and a CPU's SDPA kernel has no DTensor sharding rule",
    "the MoE models (qwen3 MoE, deepseek_v3, llama4)": "not built for 0.2 yet: its expert parallel permutes "
                                                        "tokens with a triton kernel (models/moe/kernels.py)",
    "sequence parallel off": "0.2 has no enable_sequence_parallel: its tp plans always shard the sequence",
    "loss parallel": "off (disable_loss_parallel): the harness computes the loss and its backward outside the "
                     "trainer's loss_parallel context, which a vocabulary-sharded output needs",
    "rep=2,tp=2": "0.2's data parallel without a shard degree is DDP, whose apply_ddp raises 'DDP has not supported "
                  "> 1D parallelism' with tp, by design (0.3 runs the mesh)",
    "context parallel": "its SDPA on a CPU has no DTensor sharding rule",
    "bf16 on the other meshes": "BF16_MESHES (dp=2,tp=2 and pp=2,dp=2) run it, to keep the zoo's time",
}
SHIMS = {
    "torchtitan.models.moe.kernels": "a stand-in: its triton kernels are imported by every model and run by none "
                                     "here (GPU only)",
    "torchtitan.hf_datasets.text_datasets": "a stand-in: every model's package imports it for the dataloader, "
                                            "which needs the datasets library; no cell loads data",
    "torchdata.stateful_dataloader": "a stand-in StatefulDataLoader: torchtitan's dataloader module subclasses it "
                                     "at import; no cell loads data",
    "torch.utils.tensorboard": "a stand-in SummaryWriter: the metrics module imports it; no cell logs",
    "device_type": "cpu, where torchtitan.tools.utils and ParallelDims read 'cuda' at import",
    "FSDP's PREMUL_SUM": "a plain SUM (gloo has no PREMUL_SUM; the factor is 1)",
}


# torchtitan bugs the zoo found in this release: their cells run as strict xfails held to the line they show
KNOWN_TIED_FSDP = (
    "0.2.2", "tied qwen3 under FSDP: its apply_fsdp (llama4's) puts the tied embedding and output head in two FSDP "
    "groups, which torch 2.13's fully_shard refuses (a shared parameter belongs to one group); fixed by "
    "pytorch/torchtitan#2522 (in 0.3.0, where the same cells pass)",
    r"is shared with a parameter already managed by another FSDP group")


def _known(cfg) -> Known | None:
    """Why a cell of tied qwen3 fails in this release, or None: FSDP is applied where dp shards."""
    release, reason, shows = KNOWN_TIED_FSDP
    if version() == release and cfg.component == name_of("qwen3_tied") and dict(cfg.mesh).get("dp", 1) > 1:
        return Known(f"torchtitan {release}: {reason}", shows=shows)
    return None


@lru_cache(maxsize=1)
def _shim() -> types.ModuleType:
    """Import torchtitan 0.2 for a CPU, once per process; its ``torchtitan`` package."""
    if find_spec("torchtitan") is None:
        raise TorchtitanMissing(f"the torchtitan zoo needs torchtitan, which is not installed: {INSTALL}")
    require_release(TorchtitanMissing, "torchtitan", version(), VERSION, INSTALL, {})
    stand_in("torchtitan.models.moe.kernels")
    stand_in("torchtitan.hf_datasets.text_datasets")
    stand_in("torchdata")
    stand_in("torchdata.stateful_dataloader", StatefulDataLoader=type("StatefulDataLoader", (), {}))
    stand_in("torch.utils.tensorboard", SummaryWriter=type("SummaryWriter", (), {}))
    import torchtitan
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as utils

    utils.device_type, utils.device_module = "cpu", torch.cpu  # read at import: "cuda" without a GPU
    parallel_dims.device_type = "cpu"
    from torchtitan.protocols.train_spec import get_train_spec

    for spec, _ in SPECS.values():  # imported before a pool forks (its imports patch torch)
        get_train_spec(spec)
    import torchtitan.components.loss  # noqa: F401
    return torchtitan


def _spec(model: str):
    from torchtitan.protocols.train_spec import get_train_spec

    return get_train_spec(SPECS[model][0])


def _job():
    """The ``JobConfig`` of the running cell, as a trainer's command line would set it."""
    from torchtitan.config import JobConfig

    cell, job = running(), JobConfig()
    # sequence parallel is no option in 0.2: its tp plans always shard the sequence (the sp switch says so)
    _set(job.parallelism, data_parallel_replicate_degree=cell.mesh.get("rep", 1),
         data_parallel_shard_degree=cell.mesh.get("dp", 1), tensor_parallel_degree=cell.mesh.get("tp", 1),
         pipeline_parallel_degree=cell.mesh.get("pp", 1), disable_loss_parallel=True,  # NOT_RUN says why
         pipeline_parallel_schedule=SCHEDULES[switches().get("sched", "1f1b")], pipeline_parallel_microbatch_size=1)
    _set(job.training, mixed_precision_param="bfloat16" if cell.dtype == torch.bfloat16 else "float32",
         mixed_precision_reduce="float32", seq_len=SIZES["seq"],
         local_batch_size=SIZES["batch"] // (cell.mesh.get("rep", 1) * cell.mesh.get("dp", 1)))
    _set(job.activation_checkpoint, mode="none")
    _set(job.compile, enable=False)
    return job


def _set(section, **values) -> None:
    """Set fields of a ``JobConfig`` section; a field this release lacks is an error, not a new attribute
    that nothing reads (a dataclass takes one silently, and the cell would check what it did not set)."""
    fields = {f.name for f in dataclasses.fields(section)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise AttributeError(f"torchtitan {version()}'s {type(section).__name__} has no {', '.join(unknown)}")
    for name, value in values.items():
        setattr(section, name, value)


def _args(model: str, job):
    """The model's debugmodel args, tiny, updated from the job as the trainer updates them."""
    s = SIZES
    args = dataclasses.replace(_spec(model).model_args["debugmodel"], dim=s["dim"], n_layers=s["layers"],
                               n_heads=s["heads"], n_kv_heads=s["kv_heads"], vocab_size=s["vocab"], **SPECS[model][1])
    if hasattr(args, "head_dim"):  # qwen3
        args = dataclasses.replace(args, head_dim=s["dim"] // s["heads"], hidden_dim=2 * s["dim"])
    args.update_from_config(job)
    return args


def _on_meta(model: str, job):
    with torch.device("meta"):
        return _spec(model).model_cls(_args(model, job))


def _dims(job, world: int):
    from torchtitan.distributed.parallel_dims import ParallelDims

    p = job.parallelism
    return ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree, cp=1,
                        tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree, ep=1, etp=1, world_size=world)


def _parallelize(model_name: str):
    def parallelize(model, meshes):
        job = _job()
        dims = _dims(job, meshes.spec.world)
        spec = _spec(model_name)
        if dims.pp_enabled:  # the trainer's pipelining_fn: stages split from the model, each parallelized
            schedule, parts, _, _ = spec.pipelining_fn(
                _on_meta(model_name, job), dims, job, torch.device("cpu"), _args(model_name, job),
                spec.parallelize_fn, share)
            for part in parts:
                materialised(part)
            made = Pipelined(stages=getattr(schedule, "_stages", None) or [schedule._stage], schedule=schedule)
            for part in parts:
                load_shards(part, model, {})
        else:  # the trainer's order: parallelized on meta, materialised (re-tying a tied model), the start loaded
            made = materialised(spec.parallelize_fn(_on_meta(model_name, job), dims, job))
            load_shards(made, model, {})
        return plain_sums(made)
    return parallelize


def _build(model: str):
    return materialised(_on_meta(model, _job()))


def case(model: str) -> ModelCase:
    """The cell family of one torchtitan 0.2 model (registered as ``harness.zoo.torchtitan_0_2:case(<model>)``)."""
    _shim()
    return ModelCase(build=lambda: _build(model), batch=batch, loss=loss, forward=forward, loss_reduction="sum",
                     parallelize={"partial": _parallelize(model)}, switches={"sp": ("on", "off"),
                                                                             "sched": tuple(SCHEDULES)},
                     acts_with={"sp": ("tp",), "sched": ("pp",)}, mixed_precision="params",
                     xfail={"partial": _known} if model in TIED else {})


def zoo_cells(only: list[str] | None = None, plans: tuple[str, ...] = PLANS,
              meshes: tuple[str, ...] = MESHES) -> list:
    """Register each model (``only``: these) and return its cells: on every mesh of ``meshes`` (no pp
    or tp for qwen3: NOT_RUN), SP on where tp splits (0.2's plans always shard the sequence), both schedules where pp
    does, fp32, and bf16 too on ``BF16_MESHES``."""
    out = []
    for model in only or SPECS:
        if model not in SPECS:
            raise ValueError(f"no torchtitan {VERSION} model {model!r} in the zoo; it has {', '.join(SPECS)}")
        register_component(model_component(name_of(model), f"harness.zoo.torchtitan_0_2:case({model})", list(PLANS),
                                           preload=("harness.zoo.torchtitan_0_2",), fresh=True))
        for mesh in meshes:
            if model != "llama3" and ("pp=" in mesh or "tp=" in mesh) or mesh == "rep=2,tp=2" or "partial" not in plans:
                continue  # NOT_RUN says why
            out += model_cells(name_of(model), impls=["partial"], meshes=[mesh],
                               dtypes=["fp32", "bf16"] if mesh in BF16_MESHES else ["fp32"],
                               switches={"sp": ["on"] if "tp=" in mesh else ["off"],
                                         "sched": list(SCHEDULES) if "pp=" in mesh else ["1f1b"]})
    if not out:
        raise ValueError(f"no cell of {', '.join(only or SPECS)} on {'; '.join(meshes)} in torchtitan {VERSION}")
    return out


try:  # here, so that a pool's keeper, which imports this module before it forks, imports torchtitan once
    _shim()
except TorchtitanMissing:
    pass  # case() says how to install it
