"""torchtitan's models, parallelized by torchtitan's own functions, against one process
(``python -m harness.zoo torchtitan``; docs/zoo.md).

Each cell runs what torchtitan's trainer runs, in its order: the model's config from torchtitan's own
layer builder, shrunk (:data:`SIZES`), updated from the job's ``ParallelismConfig`` (the cell's
degrees, its implementation's SPMD backend, sequence parallel as its ``sp`` switch), built on meta,
``to_empty`` and ``init_weights``; then the registry's ``parallelize_fn`` over torchtitan's own
``ParallelDims`` (its ``build_mesh`` over the cell's world; a tied model, in the trainer's own order:
parallelized on meta, materialised, which re-ties it, then the seeded start loaded by name), or on a
pp mesh its ``pipelining_fn``
(the stages split from the model, each parallelized, and the schedule the cell's ``sched`` switch
names, handed to the harness as :class:`harness.model.Pipelined`); inputs and labels as
``Trainer.forward_backward_step`` hands them over; torchtitan's ``cross_entropy_loss`` (a sum) over
the global token count, the ranks' losses and gradients summed (``ModelCase(loss_reduction="sum")``).

CPU shims, none touching the parallel math: :data:`SHIMS`, each with its reason (the reports list them).

Implementations (the cell id's second field) are the SPMD backends: ``partial`` (``partial_dtensor``)
and ``full`` (``full_dtensor``); ``spmd_types`` does not run on torch 2.13 (its ``fully_shard``
rejects the meshes).
"""
from __future__ import annotations

import sys
import tempfile
import types
from functools import lru_cache
from importlib import import_module
from importlib.util import find_spec

import torch

from harness.known import Known
from harness.model import ModelCase, Pipelined, load_shards, model_cells, running, switches
from harness.model.register import model_component
from harness.registry import register_component
from harness.zoo import ZooMissing, installed_release, require_release, stand_in

VERSION = "0.3.0"  # the release the shims and tiny configs are written against
INSTALL = f"pip install -e '.[torchtitan]' && pip install --no-deps torchtitan=={VERSION}"
SIZES = dict(vocab=64, dim=64, heads=8, kv_heads=4, layers=2, batch=8, seq=8, experts=4, top_k=2)
BACKENDS = {"partial": "partial_dtensor", "full": "full_dtensor"}
# the pipeline schedules a pp cell runs (its ``sched`` switch): torchtitan's names for them
SCHEDULES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B"}
MESHES = ("dp=2", "tp=2", "dp=2,tp=2", "rep=2,dp=2", "rep=2,tp=2", "dp=4", "dp=2,tp=4", "rep=2,dp=2,tp=2",
          "pp=2", "pp=2,dp=2", "pp=2,tp=2")
# where bf16 cells run beside fp32 (the trainer's default, mixed_precision_param="bfloat16"): FSDP with tp
# and SP on and off, and FSDP under both pipeline schedules, for the dense models; the MoE models' dp=2 with
# ep=2. Elsewhere fp32 alone, to keep the zoo's time
BF16_MESHES = ("dp=2,tp=2", "pp=2,dp=2")
BF16_MOE_MESHES = (("dp=2", "2"),)
# release series the zoo's glue cannot run, with why (the zoo refuses them in one line, before any import)
# (0.2, the release before, has glue of its own: harness.zoo.torchtitan_0_2, which glue() picks)
OTHER_RELEASES: dict[str, str] = {}
# registry models the zoo cannot run here, with why (every other model of the registry is built below)
NOT_RUN = {
    "qwen3 tied, pp meshes": "torchtitan ties no weights under pipeline parallel (NotImplementedError)",
    "kimi_k2_7, full_dtensor": "its parallelize_kimi_k2_5 raises NotImplementedError('full_dtensor is not "
                               "supported yet'); its vision encoder (the zoo trains its language model alone)",
    "qwen3 moe, full_dtensor, rep=2,dp=2,tp=2 with ep=2":
        "not a hang: past the 300 s deadline every rank is still in DTensor's sharding propagation of the MoE "
        "router's Linear (models/common/moe.py, under full_dtensor's forward_with_redistribution), whose "
        "redistribute_cost plans each candidate strategy's path with the graph search find_min_cost_path "
        "(torch/distributed/tensor/_redistribute.py); torch 2.13's CPU cost on this mesh, no collective waiting "
        "(partial_dtensor passes the same mesh)",
    "gpt_oss, qwen3_5": "their attention needs FlexAttention's sinks or a kernel with no CPU backward",
    "flux, muse_glimmer": "not token-id language models",
    "pp meshes, full_dtensor": "its first stage takes the inputs as the DTensors the trainer's "
                               "post_dataloading_process makes; a harness.model.Pipelined schedule is handed "
                               "the plain batch",
    "context parallel": "its SDPA on a CPU has no DTensor sharding rule",
    "the spmd_types backend": "torch 2.13's fully_shard rejects its meshes",
    "expert tensor parallel": "0.3.0's ParallelDims has no etp degree: its experts' tp is ep borrowed from tp, "
                              "which the MoE meshes run",
    "bf16 on the other meshes": "BF16_MESHES (dp=2,tp=2 and pp=2,dp=2; the MoE models' dp=2 with ep=2) run it, "
                                "to keep the zoo's time",
}
# what the zoo changes for a CPU, each with why; none touches the parallel math
SHIMS = {
    "torchtitan.distributed.minimal_async_ep.kernels": "a stand-in: its triton kernels are imported by every "
                                                       "model and run by none here (GPU only)",
    "torchtitan.trainer": "a stand-in holding Trainer.Config alone, all the models read; the real one imports "
                          "the data and tracker stack",
    "device_type": "cpu, where torchtitan.tools.utils and ParallelDims read 'cuda' at import",
    "FlexAttention": "torchtitan's own ScaledDotProductAttention instead: FlexAttention has no CPU backward",
    "FSDP's PREMUL_SUM": "a plain SUM (gloo has no PREMUL_SUM; the factor is 1)",
    "GroupedExperts.forward": "without its hard-coded .bfloat16() casts: an fp32 cell computes its experts in "
                              "fp32 (the reference in fp64, _grouped_mm from its fp32 kernel)",
}


class TorchtitanMissing(ZooMissing):
    pass


@lru_cache(maxsize=1)
def _shim() -> types.ModuleType:
    """Import torchtitan for a CPU, once per process; its ``torchtitan`` package."""
    if find_spec("torchtitan") is None:  # before any stand-in goes into sys.modules
        raise TorchtitanMissing(f"the torchtitan zoo needs torchtitan {VERSION}, which is not installed: {INSTALL}")
    # before the stand-ins and imports below, which another release's modules would not match
    require_release(TorchtitanMissing, "torchtitan", version(), VERSION, INSTALL, OTHER_RELEASES)
    stand_in("torchtitan.distributed.minimal_async_ep.kernels")  # triton kernels: imported by every model, run by none
    stand_in("torchtitan.trainer", Trainer=type("Trainer", (), {"Config": type("Config", (), {})}))  # its Config alone
    try:
        import torchtitan
        import torchtitan.distributed.parallel_dims as parallel_dims
        import torchtitan.tools.utils as utils
    except ImportError as error:
        raise TorchtitanMissing(f"the torchtitan zoo needs torchtitan {VERSION} ({error}): {INSTALL}") from None
    utils.device_type, utils.device_module = "cpu", torch.cpu  # read at import: "cuda" without a GPU
    parallel_dims.device_type = "cpu"
    from torchtitan.models.common.moe import GroupedExperts

    GroupedExperts.forward = _experts_in_their_dtype  # its experts cast to bf16 whatever the cell's dtype
    # what a cell uses, imported before a pool forks: importing them inside a cell patches torch
    # (torch._dynamo), which the next cell's clean start would undo and report
    for module in sorted({_module(m) for m in CONFIGS}) + [
            "torchtitan.components.loss", "torchtitan.config.configs", "torchtitan.distributed.full_dtensor",
            "torchtitan.models.common.attention"]:
        import_module(module)
    return torchtitan


def version() -> str | None:
    """The installed release of torchtitan; None for a source checkout on the path (no metadata)."""
    return installed_release("torchtitan")


def glue() -> types.ModuleType:
    """The zoo's glue for the installed release: this module for 0.3, :mod:`harness.zoo.torchtitan_0_2`
    for 0.2 (the release before: built from a TrainSpec and parallelized from a JobConfig)."""
    if (version() or "").startswith("0.2."):
        return import_module("harness.zoo.torchtitan_0_2")
    return sys.modules[__name__]


# ---- the models, tiny, from torchtitan's own builders ------------------------------------------------------
def _sdpa(config):
    """Each layer's inner attention as torchtitan's own SDPA module: FlexAttention has no CPU backward."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _ends(family) -> dict:
    """The embedding, final norm and output head of a tiny model of a torchtitan family (its module)
    that initialises them as llama3 does (``_EMBEDDING_INIT``, ``_NORM_INIT``, ``_output_linear_init``)."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    s = SIZES
    return dict(dim=s["dim"], vocab_size=s["vocab"],
                tok_embeddings=Embedding.Config(num_embeddings=s["vocab"], embedding_dim=s["dim"],
                                                param_init=family._EMBEDDING_INIT),
                norm=RMSNorm.Config(normalized_shape=s["dim"], param_init=family._NORM_INIT),
                lm_head=Linear.Config(in_features=s["dim"], out_features=s["vocab"],
                                      param_init=family._output_linear_init(s["dim"])))


def _llama3():
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, compute_ffn_hidden_dim

    s = SIZES
    return llama3.Llama3Model.Config(
        **_ends(llama3),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=s["layers"], dim=s["dim"], n_heads=s["heads"], n_kv_heads=s["kv_heads"],
            hidden_dim=compute_ffn_hidden_dim(s["dim"], multiple_of=16),
            rope=ComplexRoPE.Config(dim=s["dim"] // s["heads"], max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex"))


def _qwen3(moe: bool = False, tied: bool = False):
    """qwen3 with its q/k norms; ``moe``: its MoE layers (``SIZES``' experts, top-k, softmax router,
    the all-to-all dispatcher when ep > 1) in place of the dense FFN; ``tied``: its embedding and
    output head one parameter, as its shipped sizes up to 4B have them."""
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    s, head_dim = SIZES, SIZES["dim"] // SIZES["heads"]
    shared = dict(n_layers=s["layers"], dim=s["dim"], n_heads=s["heads"], n_kv_heads=s["kv_heads"], head_dim=head_dim,
                  attn_backend="flex", rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1000000.0))
    layers = (qwen3._build_qwen3_moe_layers(moe_hidden_dim=s["dim"], num_experts=s["experts"], top_k=s["top_k"],
                                            moe_comm_backend="standard", **shared) if moe
              else qwen3._build_qwen3_layers(hidden_dim=2 * s["dim"], **shared))
    return qwen3.Qwen3Model.Config(
        dim=s["dim"], vocab_size=s["vocab"], enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(num_embeddings=s["vocab"], embedding_dim=s["dim"],
                                        param_init=qwen3._EMBEDDING_INIT),
        norm=qwen3._qwen3_norm(s["dim"]),
        lm_head=Linear.Config(in_features=s["dim"], out_features=s["vocab"], param_init=qwen3._LINEAR_INIT),
        layers=layers)


def _deepseek_v3():
    """deepseek_v3 as its debug model is made (multi-head latent attention without a q low-rank
    projection, yarn rope, one dense layer, then MoE with a shared expert), tiny: a softmax router
    over :data:`SIZES`' experts and top-k, the all-to-all dispatcher when ep > 1."""
    from torchtitan.models import deepseek_v3
    from torchtitan.models.common import ComplexRoPE

    s, rope = SIZES, 4
    layers = deepseek_v3._build_dsv3_layers(
        n_layers=s["layers"], n_dense_layers=1, dim=s["dim"], n_heads=s["heads"], q_lora_rank=0, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=rope, v_head_dim=8, mscale=0.70, dense_hidden_dim=2 * s["dim"],
        moe_hidden_dim=s["dim"], num_experts=s["experts"], num_shared_experts=1, router_top_k=s["top_k"],
        router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope, max_seq_len=64, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=16))
    return deepseek_v3.DeepSeekV3Model.Config(**_ends(deepseek_v3), layers=layers, mtp_layers=[])


def _kimi_k2_7():
    """kimi_k2_7's language model as its debug model is made (deepseek_v3's multi-head latent
    attention and MoE with shared experts, under Kimi's initialisers, a top-3 router), tiny, without
    its vision encoder (its forward runs text alone without pixels)."""
    from torchtitan.models import kimi_k2_7
    from torchtitan.models.common import ComplexRoPE

    s, rope = SIZES, 4
    layers = kimi_k2_7._build_kimi_layers(
        n_layers=s["layers"], n_dense_layers=1, dim=s["dim"], n_heads=s["heads"], q_lora_rank=0, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=rope, v_head_dim=8, mscale=0.70, dense_hidden_dim=2 * s["dim"],
        moe_hidden_dim=s["dim"], num_experts=s["experts"], num_shared_experts=2, router_top_k=3,
        router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope, max_seq_len=64, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=16))
    return kimi_k2_7.KimiK25Model.Config(**_ends(kimi_k2_7), layers=layers, vision_encoder=None)


def _experts_in_their_dtype(self, x_RD, num_tokens_per_expert_E):
    """torchtitan's ``GroupedExperts.forward`` without its hard-coded ``.bfloat16()`` casts: an fp32
    cell computes its experts in fp32 and the reference in fp64 (``_grouped_mm`` from its fp32 kernel,
    ``fp32_ops``), as every other op of the model; the dispatch and combine around it are torchtitan's."""
    from torch.distributed.tensor import DTensor

    w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    offsets = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    h = torch.nn.functional.silu(self._grouped_mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offsets))
    h = h * self._grouped_mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offsets)
    return self._grouped_mm(A=h, B_t=w2.transpose(-2, -1), offs=offsets)


CONFIGS = {"llama3": _llama3, "qwen3": _qwen3, "qwen3_tied": lambda: _qwen3(tied=True),
           "qwen3_moe": lambda: _qwen3(moe=True), "deepseek_v3": _deepseek_v3, "kimi_k2_7": _kimi_k2_7}
# backends a model's parallelize_fn refuses (NOT_RUN says why)
PARTIAL_ONLY = {"kimi_k2_7": ("full",)}
TIED = ("qwen3_tied",)  # torchtitan ties no weights under pp ("not supported with Pipeline Parallel")
MOE = ("qwen3_moe", "deepseek_v3", "kimi_k2_7")
EXPERT_DEGREES = ("1", "2", "4")
# the MoE models' meshes: (dense mesh, ep, backends that cannot run it here: NOT_RUN says why), ep
# borrowed from dp_shard and tp as torchtitan's ParallelDims borrows it (efsdp = dp * tp / ep)
MOE_MESHES = (("dp=2", "2", ()), ("dp=4", "4", ()), ("dp=4", "2", ()), ("dp=2,tp=2", "1", ()), ("dp=2,tp=2", "2", ()),
              ("tp=2", "2", ()), ("rep=2,dp=2", "2", ()), ("rep=2,dp=2,tp=2", "2", ("full",)),
              ("pp=2,dp=2", "2", ("full",)))
# torchtitan bugs the zoo found, by the releases that have them: their cells run as strict xfails
# held to the line the crash shows, so a release that fixes one turns them into XPASS, reported as
# ``fixed``, and one that fails them otherwise into a crash that says so
KNOWN_EP_TP_SP_OFF = (
    "0.3.0", "ep borrowed from tp with sequence parallel off crashes in the MoE's routed experts "
    "(`Can not redistribute from S(1) to P(sum), redistributing to Partial is for internal use only`); with "
    "SP on the same mesh passes", r"Can not redistribute from S\(1\) to P\(sum\)")


def _known(cfg) -> Known | None:
    """Why a cell of an MoE model fails in this torchtitan release, or None."""
    release, reason, shows = KNOWN_EP_TP_SP_OFF
    switched, mesh = dict(cfg.switches), dict(cfg.mesh)
    if version() == release and int(switched.get("ep", 1)) > 1 and mesh.get("tp", 1) > 1 and switched["sp"] == "off":
        return Known(f"torchtitan {release}: {reason}", shows=shows)
    return None


def _module(model: str) -> str:
    """The torchtitan package of a zoo model (its registry and ``parallelize_fn``)."""
    return f"torchtitan.models.{model.removesuffix('_moe').removesuffix('_tied')}"


# ---- one case per model: the trainer's order ----------------------------------------------------------------
def _parallelism():
    """The job's ``ParallelismConfig`` for the running cell."""
    from torchtitan.config.configs import ParallelismConfig

    cell = running()
    # the reference (one process, never parallelized) reads no backend: its sharding declarations stay inert
    backend = BACKENDS.get(cell.id.split("-")[1], "partial_dtensor")
    return ParallelismConfig(data_parallel_replicate_degree=cell.mesh.get("rep", 1),
                             data_parallel_shard_degree=cell.mesh.get("dp", 1),
                             tensor_parallel_degree=cell.mesh.get("tp", 1), spmd_backend=backend,
                             enable_sequence_parallel=switches()["sp"] == "on",
                             expert_parallel_degree=int(cell.switches.get("ep", 1)),
                             pipeline_parallel_degree=cell.mesh.get("pp", 1),
                             pipeline_parallel_schedule=SCHEDULES[switches().get("sched", "1f1b")],
                             pipeline_parallel_microbatch_size=1)


_DIMS: dict[str, object] = {}  # this rank's ParallelDims once parallelize made them (the reference has none)


def _config(model: str, parallelism):
    """The model's tiny config as the trainer makes it for the job's ``parallelism``."""
    config = _sdpa(CONFIGS[model]())
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    return config


def _build(model: str):
    return materialised(_on_meta(model))


def _on_meta(model: str):
    """The model as the trainer first builds it: on meta, from the job's config."""
    from torchtitan.distributed import utils as dist_utils

    parallelism = _parallelism()
    # the trainer sets the process's backend before it builds: building under another one (the module's
    # default, or the last cell's) makes full_dtensor's fully_shard reject the parameters' meshes
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    with torch.device("meta"):
        return _config(model, parallelism).build()


def materialised(built):
    """``to_empty`` and ``init_weights``, as the trainer materialises a model (parallelized or not)."""
    built.to_empty(device="cpu")
    with torch.no_grad():
        built.init_weights(buffer_device=torch.device("cpu"))
    return built


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, SIZES["vocab"], (SIZES["batch"], SIZES["seq"] + 1), generator=g)
    return {"input": tokens[:, :-1].contiguous(), "target": tokens[:, 1:].contiguous()}


def _feeds(batch: dict[str, torch.Tensor]):
    """Inputs and labels as the trainer hands them over: DTensors under ``full_dtensor``."""
    dims = _DIMS.get("dims")
    if dims is not None and dims.spmd_backend == "full_dtensor":
        from torchtitan.distributed import full_dtensor

        inputs, labels, _ = full_dtensor.parallelize_inputs(dims, batch["input"], batch["target"], {})
        return inputs, labels
    return batch["input"], batch["target"]


def forward(model, batch):
    return model(_feeds(batch)[0])


def loss(output, batch):
    return share(output, _feeds(batch)[1])


def share(output, labels):
    """torchtitan's ``cross_entropy_loss`` (a sum) over the global token count: this rank's (or this
    microbatch's) share of the global mean, as the trainer normalises it."""
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(output, labels) / (SIZES["batch"] * SIZES["seq"])


def _parallelize(model_name: str):
    def parallelize(model, meshes):
        from torchtitan.config.configs import CompileConfig, TrainingConfig
        from torchtitan.distributed.parallel_dims import ParallelDims

        job = _parallelism()  # its backend set by build
        dims = ParallelDims.from_config(job, meshes.spec.world)
        dims.build_mesh()
        _DIMS["dims"] = dims
        spec = import_module(_module(model_name)).model_registry("debugmodel")
        # the trainer's local batch: the global one over the data ranks, one microbatch per sample under pp
        # the trainer's mixed precision (FSDP2's policy, installed on every mesh): parameters kept in fp32,
        # computed in the cell's dtype, gradients reduced in fp32
        low = running().dtype == torch.bfloat16
        training = TrainingConfig(mixed_precision_param="bfloat16" if low else "float32",
                                  mixed_precision_reduce="float32",
                                  local_batch_size=SIZES["batch"] // (dims.dp_replicate * dims.dp_shard))
        common = dict(parallel_dims=dims, training=training, parallelism=job, compile_config=CompileConfig(enable=False),
                      ac_config=None, dump_folder=tempfile.gettempdir())
        if dims.pp_enabled:  # the trainer's pipelining_fn: stages split from the model, each parallelized
            schedule, _, _, _ = spec.pipelining_fn(
                model, device=torch.device("cpu"), model_config=_config(model_name, job),
                parallelize_fn=spec.parallelize_fn, loss_fn=lambda output, labels: (share(output, labels), None),
                **common)
            # it returns the stages' modules, not the stages: the schedule holds them (one, or a rank's several)
            made = Pipelined(stages=getattr(schedule, "_stages", None) or [schedule._stage], schedule=schedule)
        elif model_name in TIED:
            # the trainer's order: parallelize on meta, materialise (init_weights re-ties the embedding to
            # the output head), then the start loaded by name as its checkpoint would be; parallelizing
            # the built model instead leaves the two parameters apart
            made = materialised(spec.parallelize_fn(_on_meta(model_name), **common))
            load_shards(made, model, {})
        else:
            made = spec.parallelize_fn(model, **common)
        return plain_sums(made)
    return parallelize


def plain_sums(made):
    """``made`` with each FSDP module reducing by a plain SUM: gloo has no PREMUL_SUM (the factor is 1,
    the same sum)."""
    from torch.distributed.fsdp import FSDPModule

    for part in made.modules if isinstance(made, Pipelined) else [made]:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return made


def case(model: str) -> ModelCase:
    """The cell family of one torchtitan model (registered as ``harness.zoo.torchtitan:case(<model>)``)."""
    _shim()  # torchtitan missing: how to install it
    moe = model in MOE
    return ModelCase(build=lambda: _build(model), batch=batch, loss=loss, forward=forward, loss_reduction="sum",
                     parallelize={impl: _parallelize(model) for impl in BACKENDS},
                     switches={"sp": ("on", "off"), **({"ep": EXPERT_DEGREES} if moe else {"sched": tuple(SCHEDULES)})},
                     acts_with={"sp": ("tp",), **({} if moe else {"sched": ("pp",)})},
                     fp32_ops=("_grouped_mm",) if moe else (), mixed_precision="params",
                     xfail={impl: _known for impl in BACKENDS} if moe else {})


def name_of(model: str) -> str:
    return "tt" + model.replace("_", "")


PLANS = tuple(BACKENDS)


def zoo_cells(only: list[str] | None = None, plans: tuple[str, ...] = PLANS,
              meshes: tuple[str, ...] = MESHES) -> list:
    """Register each model (``only``: these) and return its cells: every backend of ``plans`` on
    every mesh of ``meshes`` (an MoE model: those of :data:`MOE_MESHES`, each with its ep), SP on and
    off where tp splits, off elsewhere."""
    out = []
    for model in only or CONFIGS:
        if model not in CONFIGS:
            raise ValueError(f"no torchtitan model {model!r} in the zoo; it has {', '.join(CONFIGS)}")
        # fresh: torchtitan keeps state across builds in a process (a second full_dtensor build with SP
        # off puts a parameter on the first build's mesh), so a warm rank's verdict hung on the cells before
        register_component(model_component(name_of(model), f"harness.zoo.torchtitan:case({model})", list(plans),
                                           preload=("harness.zoo.torchtitan",), fresh=True))
        # an MoE model runs the meshes of MOE_MESHES that were asked for, each with its ep
        # a dense model runs every mesh asked for, full_dtensor none with pp (NOT_RUN says why)
        chosen = ([m for m in MOE_MESHES if m[0] in meshes] if model in MOE else
                  [(m, None, ("full",) if "pp=" in m else ()) for m in meshes
                   if not (model in TIED and "pp=" in m)])
        for mesh, ep, cannot in chosen:
            runs = [plan for plan in plans if plan not in cannot + PARTIAL_ONLY.get(model, ())]
            if not runs:
                continue
            # sequence parallelism acts with tp only: without tp, sp_on would certify what sp_off does;
            # a schedule with pp only
            sp = ["on", "off"] if "tp=" in mesh else ["off"]
            own = {"ep": [ep]} if model in MOE else {"sched": list(SCHEDULES) if "pp=" in mesh else ["1f1b"]}
            low = (mesh, ep) in BF16_MOE_MESHES if model in MOE else mesh in BF16_MESHES
            out += model_cells(name_of(model), impls=runs, meshes=[mesh], dtypes=["fp32", "bf16"] if low else ["fp32"],
                               switches={"sp": sp, **own})
    if not out:
        raise ValueError(f"no cell of {', '.join(only or CONFIGS)} on {'; '.join(meshes)}: the MoE models run "
                         f"{'; '.join(sorted({m[0] for m in MOE_MESHES}))}")
    return out


try:  # here, so that a pool's keeper, which imports this module before it forks, imports torchtitan once
    _shim()
except TorchtitanMissing:
    pass  # case() says how to install it
