"""A torch-native small Llama, parallelized the way torchtitan parallelizes its Llama 3.

The model (``torchtitan/models/llama3/model``, shrunk): token embedding, ``LAYERS`` blocks of
RMSNorm -> causal attention with rotary positions -> residual, RMSNorm -> SwiGLU feed-forward ->
residual, a final RMSNorm and the output head. Layers sit in a ``ModuleDict`` keyed by index and
the forward skips modules set to None, so a pipeline stage is the whole model with what it does not
run deleted, and every parameter keeps its name.

``parallelize`` follows ``torchtitan/models/llama3/infra/parallelize.py`` and
``torchtitan/distributed/pipeline_parallel.py``, applying each dim the mesh has:

1. pp > 1: split into stages (:func:`stages`; 2 per rank for the interleaved schedule), each
   stage parallelized by steps 2-3 below, and return :class:`harness.model.Pipelined` with
   ``Schedule1F1B`` or ``ScheduleInterleaved1F1B`` over ``MICROBATCHES`` microbatches;
2. tp > 1: ``parallelize_module`` with sequence parallel on every norm, colwise wq/wk/wv/w1/w3,
   rowwise wo/w2 returning to the sequence shard, a rowwise embedding, and a colwise output head
   whose logits stay sharded for ``loss_parallel`` (under pp too: the harness runs the schedule,
   which computes the loss, under it);
3. dp > 1 (FSDP) or rep > 1 (HSDP): ``fully_shard`` each block, the embedding,
   norm+output, then the root, on ``dense["dp"]`` or ``dense["rep", "dp"]``.

``MIXED`` is the same model as bf16 users of FSDP2 train it (``parallelize_mixed``): FSDP2 or HSDP
with ``MixedPrecisionPolicy(param_dtype=<the cell's dtype>, reduce_dtype=torch.float32)``, the
cell's dtype read from :func:`harness.model.running` (``mixed_precision="params"``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

import dataclasses

from harness.model import ModelCase, Pipelined, running

VOCAB, DIM, HEADS, HIDDEN, LAYERS = 64, 32, 4, 64, 2
BATCH, SEQ = 8, 8
MICROBATCHES = 2


def rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary positions on (batch, seq, heads, head_dim), rotating pairs (first half, second half)."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), freqs).to(x.dtype)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds HEADS / tp of them
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rope(q), rope(k)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5), nn.RMSNorm(DIM, eps=1e-5)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def batch(step: int) -> dict[str, torch.Tensor]:
    """Random tokens; the target is the input shifted by one (next-token prediction)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return {"input": tokens[:, :-1].contiguous(), "target": tokens[:, 1:].contiguous()}


def cross_entropy(output, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (``loss_parallel`` computes it on vocab-sharded logits)."""
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten(0, 1))


def loss(output, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return cross_entropy(output, batch["target"])


# ---- parallelize, as torchtitan ----------------------------------------------------------------------
def block_plan(sequence_parallel_norms: tuple[str, ...] = ("attention_norm", "ffn_norm"), wo=None) -> dict:
    """torchtitan's per-block TP plan (``apply_tp``). The arguments exist for the planted bugs in
    tests/model_bugs.py, which call it with a norm left out or ``wo`` cut the wrong way."""
    plan = {
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": wo or RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    plan.update({norm: SequenceParallel() for norm in sequence_parallel_norms})
    return plan


def apply_tp(model: Transformer, tp_mesh, loss_parallel: bool = True, plan=None) -> None:
    """Tensor and sequence parallelism over ``tp_mesh`` (``plan``: the per-block plan)."""
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan or block_plan())


def fsdp_mesh(meshes, hsdp_dims: tuple[str, str] = ("rep", "dp")):
    """The mesh FSDP2 shards over: dp, or (rep, dp) for HSDP; None without dp."""
    spec = meshes.spec
    if spec.rep > 1:
        return meshes.dense[hsdp_dims]
    return meshes.dense["dp"] if spec.dp > 1 else None


def apply_fsdp(model: Transformer, mesh, mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """torchtitan's ``apply_fsdp``: each block, the embedding, norm+output, then the root."""
    mp_policy = mp_policy or MixedPrecisionPolicy()
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=mp_policy)
    if model.output is not None:
        fully_shard([model.norm, model.output], mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def parallelize_stage(model: Transformer, meshes, loss_parallel: bool, plan=None, hsdp_dims=("rep", "dp")):
    if meshes.spec.tp > 1:
        apply_tp(model, meshes.dense["tp"], loss_parallel, plan)
    mesh = fsdp_mesh(meshes, hsdp_dims)
    if mesh is not None:
        apply_fsdp(model, mesh)
    return model


def split(model: Transformer, stages: int) -> list[Transformer]:
    """The model cut into ``stages`` stages of consecutive layers, embedding first, head last
    (4 stages of a 2-layer model: embedding, layer 0, layer 1, norm + head)."""
    import copy

    cuts = {2: [(0, 1), (1, 2)], 4: [(0, 0), (0, 1), (1, 2), (2, 2)]}[stages]
    out = []
    for index, (first, last) in enumerate(cuts):
        stage = copy.deepcopy(model)
        for name in list(stage.layers):
            if not first <= int(name) < last:
                del stage.layers[name]
        if index > 0:
            stage.tok_embeddings = None
        if index < stages - 1:
            stage.norm, stage.output = None, None
        out.append(stage)
    return out


def pipeline(model: Transformer, meshes, interleaved: bool, **stage_args) -> Pipelined:
    """torchtitan's ``pipeline_llama``: this rank's stages (loop style: rank r holds stages r and
    r + pp), each parallelized, and the schedule over them."""
    # here, not at the top: it imports torch._dynamo (0.6 s), which pytest processes that collect these
    # cells never need; the pools preload it (TITAN's registration)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    pp = meshes.spec.pp
    per_rank = 2 if interleaved else 1
    total = pp * per_rank
    rank = meshes.dense["pp"].get_local_rank()
    modules = split(model, total)
    device = next(model.parameters()).device
    stages = []
    for index in range(rank, total, pp):
        module = parallelize_stage(modules[index], meshes, loss_parallel=True, **stage_args)
        stages.append(PipelineStage(module, index, total, device, group=meshes.group("pp")))
    schedule_type = ScheduleInterleaved1F1B if interleaved else Schedule1F1B
    schedule = schedule_type(stages if interleaved else stages[0], n_microbatches=MICROBATCHES, loss_fn=cross_entropy)
    return Pipelined(stages, schedule)


def parallelize(model: Transformer, meshes) -> Transformer | Pipelined:
    """torchtitan's order: pipeline split first, then TP, then FSDP/HSDP, for the dims the mesh has."""
    if meshes.spec.pp > 1:
        return pipeline(model, meshes, interleaved=False)
    return parallelize_stage(model, meshes, loss_parallel=True)


def parallelize_interleaved(model: Transformer, meshes) -> Pipelined:
    return pipeline(model, meshes, interleaved=True)


def parallelize_mixed(model: Transformer, meshes) -> Transformer:
    """FSDP2 (HSDP with rep) in mixed precision, as torchtitan's ``mixed_precision_param``: forward
    and backward in the cell's dtype, gradients reduced and stepped in fp32."""
    policy = MixedPrecisionPolicy(param_dtype=running().dtype, reduce_dtype=torch.float32)
    apply_fsdp(model, fsdp_mesh(meshes), policy)
    return model


def needs_pp(spec) -> str | None:
    return None if spec.pp > 1 else "the interleaved schedule needs pp > 1"


def no_cp(spec) -> str | None:
    return "context parallel is not applied by this model's parallelize" if spec.cp > 1 else None


def data_parallel_only(spec) -> str | None:
    return None if spec.dp > 1 and spec.pp == spec.cp == spec.tp == 1 else "FSDP2 or HSDP alone: a mesh of dp (and rep)"


CASE = ModelCase(
    build=Transformer,
    batch=batch,
    loss=loss,
    parallelize={"titan": parallelize, "interleaved": parallelize_interleaved},
    supports={"titan": no_cp, "interleaved": lambda spec: needs_pp(spec) or no_cp(spec)},
)

MIXED = dataclasses.replace(CASE, parallelize={"fsdpmp": parallelize_mixed}, supports={"fsdpmp": data_parallel_only},
                            mixed_precision="params")
