"""transformers' tiny Llama, parallelized the way transformers parallelizes it: a model case to copy.

The model is ``LlamaForCausalLM`` from a ``LlamaConfig`` (2 layers, hidden 16, 4 query and 2 key/value
heads, vocab 64; nothing downloaded), trained on next-token cross-entropy. Its parallelize functions
are transformers' own code path, ``PreTrainedModel.maybe_distribute_model(model, DistributedConfig,
mesh manager)`` (what ``from_pretrained(distributed_config=...)`` runs after building the model): the
model's own plans (``base_model_tp_plan`` + ``LlamaForCausalLM._tp_plan``: attention and MLP
colwise/rowwise, the embedding ``embedding_rowwise``, ``lm_head`` ``colwise_gather_output``; and its
FSDP plan: ``free_full_weight`` per decoder layer and the embedding, ``keep_full_weight`` for the
final norm and ``lm_head``) applied by ``apply_tensor_parallelism`` and
``apply_fully_sharded_data_parallelism`` on the harness's meshes:

    impl   mesh          DistributedConfig
    tp     tp=N          tp_size=N              transformers' TP plan
    fsdp   dp=N          fsdp_size=N            its FSDP2 plan over dp
    fsdp   rep=R,dp=N    + dp_replicate_size=R  HSDP
    tpfsdp dp=N,tp=M     both                   TP then FSDP2, as maybe_distribute_model orders them

:class:`MeshManager` is the one piece of glue: it hands transformers the harness's meshes under the
names ``TransformersDeviceMesh.get_mesh`` answers to (``fsdp`` is the harness's ``dp``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.model import ModelCase, model_cells

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 16, 32, 2, 4, 2
BATCH, SEQ = 4, 8  # the global batch: 4 sequences (dp up to 4), 8 tokens


def config():
    """The tiny ``LlamaConfig`` (eager attention: the same arithmetic in fp32 and in the fp64 reference)."""
    from harness.examples.hf import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2 * SEQ,
                       attn_implementation="eager", tie_word_embeddings=False)


def build():
    from harness.examples.hf import LlamaForCausalLM

    return LlamaForCausalLM(config())


def batch(step: int) -> dict[str, torch.Tensor]:
    """Random token ids and their next-token targets, a fresh draw per step."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
    return {"input": ids[:, :-1], "target": ids[:, 1:]}


def forward(model, batch):
    return model(input_ids=batch["input"]).logits


def loss(logits, batch):
    """Mean next-token cross-entropy over the batch's tokens, in at least fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), batch["target"].flatten())


# ---- transformers' own parallelization on the harness's meshes -------------------------------------
class MeshManager:
    """The harness's meshes as transformers' ``TransformersDeviceMesh``: ``get_mesh(dims)`` answers
    with the dense mesh's dims (``fsdp`` = the harness's ``dp``) or, for ``ep``/``efsdp``, the
    sparse (expert) mesh's."""

    DENSE = {"pp": "pp", "dp_replicate": "rep", "fsdp": "dp", "tp": "tp"}

    def __init__(self, meshes):
        self.meshes = meshes

    def get_mesh(self, dims):
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        if "ep" in dims or "efsdp" in dims:
            return self.meshes.sparse[dims]
        return self.meshes.dense[tuple(self.DENSE[d] for d in dims)]


def distribute(model, meshes, **sizes):
    """``maybe_distribute_model`` with a ``DistributedConfig`` of the harness mesh's degrees: the
    model's own TP/EP/FSDP plans, applied by transformers, in ``from_pretrained``'s order: it runs
    before tied weights are tied (a tied ``lm_head.weight`` is no parameter of its own, and the plan
    names it), so a built model's tied weights are untied for it, with their values, and tied again
    after, to the parallelized source."""
    from harness.examples.hf import DistributedConfig

    spec = meshes.spec
    if spec.cp > 1 or spec.pp > 1:
        raise ValueError("transformers parallelizes this model over tp, dp, rep and ep only")
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})  # target -> source
    for target, source in tied.items():
        owner, _, name = target.rpartition(".")
        setattr(model.get_submodule(owner), name, torch.nn.Parameter(model.get_parameter(source).detach().clone()))
    dc = DistributedConfig(**sizes)
    model = type(model).maybe_distribute_model(model, dc, MeshManager(meshes))
    if tied:
        model.tie_weights(recompute_mapping=False)
    return model


def tp(model, meshes):
    return distribute(model, meshes, tp_size=meshes.spec.tp)


def fsdp(model, meshes):
    spec = meshes.spec
    return distribute(model, meshes, fsdp_size=spec.dp, dp_replicate_size=spec.rep)


def tpfsdp(model, meshes):
    spec = meshes.spec
    return distribute(model, meshes, tp_size=spec.tp, fsdp_size=spec.dp, dp_replicate_size=spec.rep)


def _only(*dims):
    """``supports``: the mesh may use only ``dims`` (each implementation's DistributedConfig sizes)."""
    def check(spec):
        used = [d for d in ("pp", "rep", "dp", "cp", "tp") if getattr(spec, d) > 1 and d not in dims]
        return f"it parallelizes over {', '.join(dims)} only, not {', '.join(used)}" if used else None
    return check


CASE = ModelCase(
    build=build, batch=batch, loss=loss, forward=forward,
    parallelize={"tp": tp, "fsdp": fsdp, "tpfsdp": tpfsdp},
    supports={"tp": _only("tp"), "fsdp": _only("dp", "rep"),
              "tpfsdp": _only("tp", "dp", "rep")},
)


def cells():
    """The llama cells of ``cases/test_models.py``: a covering set (each plan once in fp32, TP x FSDP2
    in bf16 too, reshard from each parallel layout kind to FSDP2, to one process, and HSDP to FSDP2)."""
    return (model_cells("llama", impls=["tp"], meshes=["tp=2"])
            + model_cells("llama", impls=["fsdp"], meshes=["rep=2,dp=2"])
            + model_cells("llama", impls=["tpfsdp"], meshes=["dp=2,tp=2"], dtypes=["fp32", "bf16"])
            # reshard round trips (harness.model.tasks.round_trip): TP x FSDP2 saved, loaded under FSDP2
            # and on one process
            + model_cells("llama", impls=["tpfsdp"], meshes=["dp=2,tp=2"], switches={"reshard": ["dp4", "one"]})
            + model_cells("llama", impls=["fsdp"], meshes=["rep=2,dp=2"], switches={"reshard": ["dp2"]}))
