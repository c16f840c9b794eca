"""The built-in components, as the table the registry reads (``BUILTIN``). Each component mirrors
reference/<name>.py and harness/parallel/<name>.py; each whole model is harness/examples/<name>.py."""
from reference.tp import OPS as TP_OPS

from .model.register import model_component
from .registry import Component, Implementation, Space

# The spaces exploration draws from (harness.explore): dims, size ranges and switch values the rules
# then filter. Sizes are listed so that one a rule divides by another comes after it (pp: b after m).
# Sizes start near the matrix's scale: the tolerance policy bounds the rounding of reductions over
# enough terms; with one or two tokens or features, fp32 sums that cancel (a bias gradient, Adam's
# second moment, the probe loss) miss it by err/tol 1-7 on a single rank, and layer norm over one
# or two features is constant, its input gradient rounding noise; causal attention over two tokens
# gives the first row one key, whose softmax is 1 and whose gradient is noise; so does a router
# over one expert.
# (These limits were found by exploring the built-in implementations.)
CKPT_LAYOUTS = ("fsdp1", "fsdp2", "fsdp3", "fsdp4", "fsdp8", "hsdp2x2", "hsdp2x4", "hsdp4x2", "fsdptp2x2",
                "fsdptp4x2", "fsdptp2x3", "ours1", "ours2", "ours3", "ours4", "ours8", "ourshsdp2x2", "ourshsdp2x3")

TP = Component(
    name="tp",
    reference="reference.tp:reference",
    calibration="reference.tp:calibration",
    validate="harness.parallel.tp:validate",
    reduction="reference.tp:reduction_size",
    space=Space(dims=("dp", "tp"), sizes=dict(b=(1, 8), s=(2, 12), h=(4, 24), f=(4, 40), v=(4, 48)),
                switches={"op": TP_OPS}),
    implementations={
        "ours": Implementation("ours", "harness.parallel.tp:run"),
        "dtensor": Implementation("dtensor", "harness.parallel.tp_dtensor:run", skip="harness.parallel.tp_dtensor:skip_reason"),
        # third-party libraries (pip install -e '.[thirdparty]'); skips and known divergences as data
        "hf": Implementation("hf", "harness.parallel.tp_hf:run", skip="harness.parallel.thirdparty:hf_skip",
                             xfail="harness.parallel.thirdparty:hf_xfail"),
        "megatron": Implementation("megatron", "harness.parallel.tp_megatron:run", skip="harness.parallel.thirdparty:megatron_skip",
                                   xfail="harness.parallel.thirdparty:megatron_xfail"),
    },
)

RINGATTN = Component(
    name="ringattn",
    reference="reference.ring_attention:reference",
    calibration="reference.ring_attention:calibration",
    validate="harness.parallel.ring_attention:validate",
    reduction="reference.ring_attention:reduction_size",
    space=Space(dims=("dp", "cp", "tp"), sizes=dict(b=(1, 4), q=(2, 8), d=(2, 8), h=(4, 16), s=(8, 48))),
    simplest={"mask": ("full", "causal"), "layout": ("contig", "zigzag"), "gqa": ("off", "on")},
    implementations={
        "ours": Implementation("ours", "harness.parallel.ring_attention:run"),
        "torch": Implementation("torch", "harness.parallel.ring_attention_torch:run",
                                skip="harness.parallel.ring_attention_torch:skip_reason", omits=("lse",)),
    },
)

MOE = Component(
    name="moe",
    reference="reference.moe:reference",
    calibration="reference.moe:calibration",
    validate="harness.parallel.moe:validate",
    reduction="reference.moe:reduction_size",
    space=Space(dims=("ep", "etp", "dp", "tp"), sizes=dict(t=(4, 32), e=(2, 16), k=(1, 4), h=(4, 12), f=(4, 24)),
                switches={"route": ("rand", "one", "skew"),
                          "emesh": ("dense", "ep1", "ep2", "ep3", "ep4", "ep8", "ep2etp2", "ep4etp2", "ep2etp4")}),
    meshes="harness.parallel.thirdparty_moe:moe_meshes",  # harness.parallel.moe:meshes, plus transformers' 1-rank tp dim for hf
    simplest={"cap": ("none", "100", "125"), "score": ("softmax", "sigmoid"), "norm": ("off", "on")},
    implementations={
        "ours": Implementation("ours", "harness.parallel.moe:run"),
        # transformers' apply_expert_parallelism (pip install -e '.[thirdparty]'): dropless, no `dropped`
        "hf": Implementation("hf", "harness.parallel.moe_hf:run", skip="harness.parallel.thirdparty_moe:hf_moe_skip",
                             omits=("dropped",), xfail="harness.parallel.thirdparty_moe:hf_moe_xfail"),
    },
)

FSDP = Component(
    name="fsdp",
    reference="reference.fsdp:reference",
    calibration="reference.fsdp:calibration",
    validate="harness.parallel.fsdp:validate",
    reduction="reference.fsdp:reduction_size",
    space=Space(dims=("rep", "shard", "dp", "tp"), sizes=dict(m=(1, 4), b=(4, 48), h=(4, 8), f=(4, 16), o=(4, 6))),
    implementations={
        "ours": Implementation("ours", "harness.parallel.fsdp:run"),
        "fsdp2": Implementation("fsdp2", "harness.parallel.fsdp_torch:run", skip="harness.parallel.fsdp_torch:skip_reason"),
    },
)

PP = Component(
    name="pp",
    reference="reference.pipeline:reference",
    calibration="reference.pipeline:calibration",
    validate="harness.parallel.pipeline:validate",
    reduction="reference.pipeline:reduction_size",
    # l up to 8: deeper bf16 pipelines round past the bf16 tolerance (cases/test_pipeline.py, measured)
    space=Space(dims=("dp", "pp", "tp"), sizes=dict(m=(1, 12), vs=(1, 3), l=(1, 8), b=(2, 32), s=(2, 6), h=(4, 8),
                                                    f=(4, 16), v=(4, 24))),
    simplest={"sched": ("gpipe", "1f1b", "interleaved"), "tied": ("off", "on")},
    implementations={
        "ours": Implementation("ours", "harness.parallel.pipeline:run"),
        "torch": Implementation("torch", "harness.parallel.pipeline_torch:run", skip="harness.parallel.pipeline_torch:skip_reason"),
    },
)

CKPT = Component(
    name="ckpt",
    reference="reference.checkpoint:reference",
    calibration="reference.checkpoint:calibration",
    validate="harness.parallel.checkpoint:validate",
    reduction="reference.checkpoint:reduction_size",
    space=Space(dims=("w",), sizes=dict(b=(4, 24), h=(4, 8), f=(4, 12)), dtypes=("fp32",),
                switches={"save": CKPT_LAYOUTS, "load": CKPT_LAYOUTS}),
    meshes="harness.parallel.checkpoint:meshes",
    implementations={
        "dcp": Implementation("dcp", "harness.parallel.checkpoint:run"),
    },
)

# ---- whole models (harness.model): harness/examples/<name>.py, each a ModelCase and its parallelize functions ----
TITAN = model_component("titan", "harness.examples.titan:CASE", impls=("titan", "interleaved"),
                        preload=("torch.distributed.pipelining",))  # its pipeline() imports it inside
# the same model in FSDP2's mixed precision (bf16 parameters in compute, fp32 reduction and step)
TITANMP = model_component("titanmp", "harness.examples.titan:MIXED", impls=("fsdpmp",))
# the project's own five components in one transformer; ten steps of ~50 collectives each on 8 gloo
# ranks take up to ~40 s on a loaded 2-core machine
COMPOSED = model_component("composed", "harness.examples.composed.case:CASE", impls=("composed", "manual"),
                           deadline_factor=4.0)
# transformers' own models (pip install -e '.[thirdparty]'; without it their cells skip saying so); their
# case modules import transformers inside functions, and the pools import it once before they fork
NEEDS_TRANSFORMERS, HF = "harness.examples.needs:transformers", ("harness.examples.hf",)
LLAMA = model_component("llama", "harness.examples.llama_hf:CASE", impls=("tp", "fsdp", "tpfsdp"),
                        skip=NEEDS_TRANSFORMERS, preload=HF)
QWEN3MOE = model_component("qwen3moe", "harness.examples.qwen3moe_hf:CASE", impls=("ep",),
                           skip=NEEDS_TRANSFORMERS, preload=HF)
# transformers' tiny Llama through save_pretrained / from_pretrained(distributed_config=...), as users load it
HFPRETRAINED = model_component("hfpretrained", "harness.examples.pretrained_hf:CASE", impls=("auto",),
                               skip=NEEDS_TRANSFORMERS, preload=HF)
# transformers' Qwen3-MoE as transformers builds it: default grouped_mm experts (fp64 reference runs _grouped_mm in fp32)
QWEN3MOEGMM = model_component("qwen3moegmm", "harness.examples.qwen3moe_grouped_hf:CASE", impls=("ep",),
                              skip=NEEDS_TRANSFORMERS, preload=HF)
# torchtitan's way of making meshes: ParallelDims from a job config and the world (dp_shard=-1), TP + FSDP2 on them
TITANWORLD = model_component("titanworld", "harness.examples.titan_world:CASE", impls=("tp2",))
# accelerate's ND parallelism (ParallelismConfig + Accelerator.prepare) on the same tiny Llama
ACCELERATE = model_component("accelerate", "harness.examples.accelerate_hf:CASE", impls=("nd",),
                             skip="harness.examples.needs:accelerate", preload=(*HF, "accelerate"))

BUILTIN = [TP, RINGATTN, MOE, FSDP, PP, CKPT, TITAN, TITANMP, COMPOSED, LLAMA, QWEN3MOE, HFPRETRAINED, QWEN3MOEGMM, TITANWORLD,
           ACCELERATE]
