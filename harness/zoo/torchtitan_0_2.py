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
import sys
import types
from functools import lru_cache, partial
from importlib import import_module
from importlib.util import find_spec, module_from_spec, spec_from_file_location
from pathlib import Path

import torch

from harness.known import Known
from harness.model import ModelCase, Pipelined, load_shards, model_cells, running, switches
from harness.model.register import model_component
from harness.registry import register_component
from harness.zoo import require_release, stand_in
from harness.zoo.torchtitan import (BF16_MESHES, BF16_MOE_MESHES, EXPERT_DEGREES, MESHES, MOE_MESHES, SCHEDULES,
                                    SIZES, TorchtitanMissing, batch, forward, loss, materialised, name_of, plain_sums,
                                    share, version)

VERSION = "0.2.2"  # the release the shims and tiny args are written against
INSTALL = f"pip install -e '.[torchtitan]' && pip install --no-deps torchtitan=={VERSION}"
PLANS = ("partial",)
# the TrainSpec each zoo model is built from, the args it starts from, and what this zoo changes besides SIZES
SPECS = {"llama3": ("llama3", "debugmodel", {}), "qwen3": ("qwen3", "debugmodel", {"enable_weight_tying": False}),
         "qwen3_tied": ("qwen3", "debugmodel", {"enable_weight_tying": True}),
         "qwen3_moe": ("qwen3", "debugmodel_moe", {}), "deepseek_v3": ("deepseek_v3", "debugmodel", {}),
         "llama4": ("llama4", "debugmodel", {})}
CONFIGS = dict.fromkeys(SPECS)  # what --only may name
TIED = ("qwen3_tied",)
MOE = ("qwen3_moe", "deepseek_v3", "llama4")
NOT_RUN = {
    "qwen3 (tied, MoE too), pp meshes": "0.2's qwen3 TrainSpec has no pipelining_fn",
    "qwen3 (tied, MoE too), tp meshes": "its attention runs SDPA on DTensors (q/k norms sharded over heads, "
                                        "use_local_output=False), and a CPU's SDPA kernel has no DTensor sharding rule",
    "expert tensor parallel (etp=tp)": "not built: the cells keep 0.3's ids, whose ep borrows tp's ranks (0.2's "
                                       "etp=1; 0.3's ParallelDims has no etp)",
    "sequence parallel off": "0.2 has no enable_sequence_parallel: its tp plans always shard the sequence",
    "loss parallel": "off (disable_loss_parallel): the harness computes the loss and its backward outside the "
                     "trainer's loss_parallel context, which a vocabulary-sharded output needs",
    "rep=2,tp=2": "0.2's data parallel without a shard degree is DDP, whose apply_ddp raises 'DDP has not supported "
                  "> 1D parallelism' with tp, by design (0.3 runs the mesh)",
    "context parallel": "its SDPA on a CPU has no DTensor sharding rule",
    "bf16 on the other meshes": "BF16_MESHES (dp=2,tp=2 and pp=2,dp=2; the MoE models' dp=2 with ep=2) run it, "
                                "to keep the zoo's time",
}
SHIMS = {
    "torchtitan.models.moe.kernels": "imported with triton stood in for that import alone (its GPU kernel is "
                                     "defined, never launched); expert parallel's token permutation calls its "
                                     "generate_permute_indices on torchtitan's own CPU path (use_cpu=True)",
    "torchtitan.hf_datasets.text_datasets": "a stand-in: every model's package imports it for the dataloader, "
                                            "which needs the datasets library; no cell loads data",
    "torchdata.stateful_dataloader": "a stand-in StatefulDataLoader: torchtitan's dataloader module subclasses it "
                                     "at import; no cell loads data",
    "torch.utils.tensorboard": "a stand-in SummaryWriter: the metrics module imports it; no cell logs",
    "MoEArgs.use_grouped_mm": "False for qwen3 MoE too, as deepseek_v3's and llama4's args set it themselves "
                              "without an SM90 GPU: the for-loop experts, in the cell's dtype (the grouped_mm "
                              "path casts to bf16 whatever the cell's dtype)",
    "torch.histc": "of integers, counted on a float64 copy and returned in their dtype: a CPU's histc has no integer "
                   "kernel (a GPU's has), and 0.2's router counts the tokens per expert with it; the same counts",
    "device_type": "cpu, where torchtitan.tools.utils and ParallelDims read 'cuda' at import",
    "FSDP's PREMUL_SUM": "a plain SUM (gloo has no PREMUL_SUM; the factor is 1)",
}


# torchtitan bugs the zoo found in this release: their cells run as strict xfails held to the line they show
KNOWN_TIED_FSDP = (
    "0.2.2", "tied qwen3 under FSDP: its apply_fsdp (llama4's) puts the tied embedding and output head in two FSDP "
    "groups, which torch 2.13's fully_shard refuses (a shared parameter belongs to one group); fixed by "
    "pytorch/torchtitan#2522 (in 0.3.0, where the same cells pass)",
    r"is shared with a parameter already managed by another FSDP group")
KNOWN_ROUTER_TP = (
    "0.2.2", "the MoE router's gate gradient under tp is each tp rank's partial sum, never all-reduced: with "
    "its scores applied after the experts (deepseek_v3), or with ep borrowed from tp (llama4, whose scores go "
    "before); pytorch/torchtitan#2387, fixed by #2416 (in 0.3.0, where the same cells pass)",
    r"router\.gate\.weight\s+\(module\s+layers\.\d+\.moe\.router\.gate:\s+partial\s+sums\s+over\s+tp")
KNOWN_EP_WITHOUT_FSDP = (
    "0.2.2", "ep with no dp shard (tp=2 lending ep its ranks) crashes in deepseek_v3's and llama4's parallelize_fn: "
    "they apply FSDP when ep is on (`fsdp_enabled or ep_enabled`) and ask for the 'fsdp' mesh, which 0.2.2's "
    "ParallelDims builds only when dp shards; 0.3.0 runs the same cells (its fix not identified)",
    r"Mesh '\['fsdp'\]' is not available")


def _known(cfg) -> Known | None:
    """Why a cell fails in this release, or None: tied qwen3 where FSDP shards; ep without a dp shard;
    an MoE model's router under tp (#2416's two cases: scores after the experts; ep borrowed from tp,
    etp=1 here)."""
    mesh, model = dict(cfg.mesh), next(m for m in SPECS if name_of(m) == cfg.component)
    ep = int(dict(cfg.switches).get("ep", 1))
    if model in TIED and mesh.get("dp", 1) > 1:
        release, reason, shows = KNOWN_TIED_FSDP
    elif model in ("deepseek_v3", "llama4") and ep > 1 and mesh.get("dp", 1) == 1:
        release, reason, shows = KNOWN_EP_WITHOUT_FSDP
    elif model in MOE and mesh.get("tp", 1) > 1 and (
            not _spec(model).model_args[SPECS[model][1]].moe_args.score_before_experts or ep > 1):
        release, reason, shows = KNOWN_ROUTER_TP
    else:
        return None
    return Known(f"torchtitan {release}: {reason}", shows=shows) if version() == release else None


@lru_cache(maxsize=1)
def _shim() -> types.ModuleType:
    """Import torchtitan 0.2 for a CPU, once per process; its ``torchtitan`` package."""
    if find_spec("torchtitan") is None:
        raise TorchtitanMissing(f"the torchtitan zoo needs torchtitan, which is not installed: {INSTALL}")
    require_release(TorchtitanMissing, "torchtitan", version(), VERSION, INSTALL, {})
    _kernels_without_triton()
    stand_in("torchtitan.hf_datasets.text_datasets")
    stand_in("torchdata")
    stand_in("torchdata.stateful_dataloader", StatefulDataLoader=type("StatefulDataLoader", (), {}))
    stand_in("torch.utils.tensorboard", SummaryWriter=type("SummaryWriter", (), {}))
    import torchtitan
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as utils

    utils.device_type, utils.device_module = "cpu", torch.cpu  # read at import: "cuda" without a GPU
    parallel_dims.device_type = "cpu"
    _permutation_on_cpu()
    torch.histc = _histc_of_integers(torch.histc)
    from torchtitan.protocols.train_spec import get_train_spec

    for spec, _, _ in SPECS.values():  # imported before a pool forks (its imports patch torch)
        get_train_spec(spec)
    import torchtitan.components.loss  # noqa: F401
    return torchtitan


def _kernels_without_triton() -> None:
    """``torchtitan.models.moe.kernels`` loaded from its file before torchtitan (whose package imports
    it), with triton stood in for that module alone: its GPU kernel is defined and never launched
    (:func:`_permutation_on_cpu`), and torch never sees a triton that is not there."""
    name = "torchtitan.models.moe.kernels"
    if name in sys.modules:
        return
    path = Path(find_spec("torchtitan").origin).parent / "models" / "moe" / "kernels.py"
    spec = spec_from_file_location(name, path)
    kernels = module_from_spec(spec)
    language = types.ModuleType("triton.language")
    language.constexpr = int
    saved = {n: sys.modules.pop(n, None) for n in ("triton", "triton.language")}
    sys.modules.update({"triton": types.SimpleNamespace(jit=lambda kernel: kernel, language=language),
                        "triton.language": language})
    try:
        spec.loader.exec_module(kernels)
    finally:
        for module, was in saved.items():
            sys.modules.pop(module)
            if was is not None:
                sys.modules[module] = was
    sys.modules[name] = kernels


def _permutation_on_cpu() -> None:
    """Expert parallel's token permutation on torchtitan's own CPU path: ``generate_permute_indices``
    called with ``use_cpu=True``, the reference its module keeps beside the triton kernel."""
    moe_utils = import_module("torchtitan.models.moe.utils")
    moe_utils.generate_permute_indices = partial(sys.modules["torchtitan.models.moe.kernels"].generate_permute_indices,
                                                 use_cpu=True)


def _histc_of_integers(histc):
    """``torch.histc`` that counts integers on a CPU as a GPU does (the router's tokens per expert);
    installed once, by :func:`_shim`."""
    def counted(input, bins=100, min=0, max=0, *, out=None):
        if out is None and not input.is_floating_point() and input.device.type == "cpu":
            return histc(input.double(), bins=bins, min=min, max=max).to(input.dtype)
        return histc(input, bins=bins, min=min, max=max, out=out)
    return counted


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
         expert_parallel_degree=int(cell.switches.get("ep", 1)), expert_tensor_parallel_degree=1,  # NOT_RUN: etp
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
    """The model's args, tiny (SIZES; deepseek_v3's latent attention to match), updated from the job as
    the trainer updates them."""
    _, flavor, own = SPECS[model]
    start, s = _spec(model).model_args[flavor], SIZES
    tiny = dict(dim=s["dim"], n_layers=s["layers"], n_heads=s["heads"], n_kv_heads=s["kv_heads"],
                vocab_size=s["vocab"], head_dim=s["dim"] // s["heads"], hidden_dim=2 * s["dim"],
                inter_dim=2 * s["dim"], moe_inter_dim=s["dim"],
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    changes = {name: value for name, value in tiny.items() if name in {f.name for f in dataclasses.fields(start)}}
    if model in MOE:
        moe = start.moe_args
        # use_grouped_mm off (SHIMS): as deepseek_v3's and llama4's args turn it off without an SM90 GPU
        changes["moe_args"] = dataclasses.replace(moe, num_experts=s["experts"], top_k=min(moe.top_k, s["top_k"]),
                                                  num_shared_experts=min(moe.num_shared_experts, 1),
                                                  use_grouped_mm=False)
    args = dataclasses.replace(start, **changes, **own)
    args.update_from_config(job)
    return args


def _on_meta(model: str, job):
    with torch.device("meta"):
        return _spec(model).model_cls(_args(model, job))


def _dims(job, world: int):
    from torchtitan.distributed.parallel_dims import ParallelDims

    p = job.parallelism
    return ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree, cp=1,
                        tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
                        etp=p.expert_tensor_parallel_degree, world_size=world)


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
    moe = model in MOE  # 0.3's switches, for 0.3's cell ids: ep for an MoE model, a schedule for a dense one
    return ModelCase(build=lambda: _build(model), batch=batch, loss=loss, forward=forward, loss_reduction="sum",
                     parallelize={"partial": _parallelize(model)},
                     switches={"sp": ("on", "off"), **({"ep": EXPERT_DEGREES} if moe else {"sched": tuple(SCHEDULES)})},
                     acts_with={"sp": ("tp",), **({} if moe else {"sched": ("pp",)})}, mixed_precision="params",
                     # an MoE layer's plain activations are flattened tokens in each rank's order (the reorderer's
                     # indices): a guess from their shapes would misread them as diverging
                     judge_plain_activations=not moe, xfail={"partial": _known} if model in TIED + MOE else {})


def zoo_cells(only: list[str] | None = None, plans: tuple[str, ...] = PLANS,
              meshes: tuple[str, ...] = MESHES) -> list:
    """Register each model (``only``: these) and return its cells: on every mesh of ``meshes`` (no pp
    or tp for qwen3: NOT_RUN; an MoE model those of 0.3's ``MOE_MESHES``, each with its ep), SP on
    where tp splits (0.2's plans always shard the sequence), both schedules where pp does, fp32, and bf16
    too on ``BF16_MESHES`` (``BF16_MOE_MESHES``)."""
    out = []
    for model in only or SPECS:
        if model not in SPECS:
            raise ValueError(f"no torchtitan {VERSION} model {model!r} in the zoo; it has {', '.join(SPECS)}")
        register_component(model_component(name_of(model), f"harness.zoo.torchtitan_0_2:case({model})", list(PLANS),
                                           preload=("harness.zoo.torchtitan_0_2",), fresh=True))
        if "partial" not in plans:
            continue
        chosen = ([(m, ep) for m, ep, _ in MOE_MESHES if m in meshes] if model in MOE else
                  [(m, None) for m in meshes if m != "rep=2,tp=2"])
        for mesh, ep in chosen:
            if model.startswith("qwen3") and ("pp=" in mesh or "tp=" in mesh):
                continue  # NOT_RUN says why
            own = {"ep": [ep]} if model in MOE else {"sched": list(SCHEDULES) if "pp=" in mesh else ["1f1b"]}
            low = (mesh, ep) in BF16_MOE_MESHES if model in MOE else mesh in BF16_MESHES
            out += model_cells(name_of(model), impls=["partial"], meshes=[mesh],
                               dtypes=["fp32", "bf16"] if low else ["fp32"],
                               switches={"sp": ["on"] if "tp=" in mesh else ["off"], **own})
    if not out:
        raise ValueError(f"no cell of {', '.join(only or SPECS)} on {'; '.join(meshes)} in torchtitan {VERSION}")
    return out


try:  # here, so that a pool's keeper, which imports this module before it forks, imports torchtitan once
    _shim()
except TorchtitanMissing:
    pass  # case() says how to install it
