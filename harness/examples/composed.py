"""The composed model: this project's five parallel components in one small transformer (issue 20).

The model (:func:`build`, the single-process reference the harness runs in fp64) is assembled from
``reference/``: a vocab embedding (``reference.tp`` op ``embed``), ``LAYERS`` blocks of RMSNorm ->
causal softmax attention (``reference.ring_attention``) -> residual, RMSNorm -> a dense GELU MLP
(``reference.tp`` op ``mlp``, block 1) or a top-k mixture of experts (``reference.moe.moe``, block 0)
-> residual, a final RMSNorm and the output head (``reference.tp`` op ``xent``); loss: mean
next-token cross-entropy. Parameters are plain ``nn.Parameter`` attributes named as the components
name them (``layers.0.attention.wq``, ``layers.1.moe.w_gate``, ...).

``parallelize(model, meshes)`` swaps each module for its ``harness/parallel/`` counterpart holding this rank's
shards, under the same parameter names, and applies every dim the mesh has:

* tp: the embedding and head vocab-parallel, wq/wk/wv column-parallel and wo row-parallel (heads over
  tp), the MLP column- then row-parallel (``harness/parallel/tp.py``); the experts' FFN over etp = tp
  (``harness/parallel/moe.py``'s ``run_experts``);
* cp: ring attention over the sequence chunks (``harness/parallel/ring_attention.py``, contiguous layout: the
  harness cuts the sequence in cp chunks);
* ep: the experts over the sparse mesh's ep, borrowed from dp·cp (dp2ep), tokens dispatched and
  combined with ``harness/parallel/moe.py``'s all-to-all pair;
* dp·cp (FSDP) and rep (HSDP): FSDP units as torchtitan wraps them (the embedding,
  each block, norm + head), each one ``harness/parallel/fsdp.py`` ``FSDPParam`` per shard group holding every
  parameter's dim-0 chunk side by side (FSDP1's flat parameter): all-gathered once per call of the
  unit, its gradient reduce-scattered once, all-reduced over rep and divided by the loss
  ranks (rep·dp·cp: each rank's loss is a mean over its own tokens). The shard group is the
  flattened fsdp group (times tp for a tensor tp cuts on dim 0; the experts' efsdp·ep is the same
  ranks), the tp or ep chunk being cut from the gathered tensor. Each parameter is a DTensor over the
  dense mesh (rep, dp, cp, tp) sharing the shard's storage: the harness reads its
  placements and ``torch.distributed.checkpoint`` saves and reshards it;
* pp: two stages (embedding + block 0, block 1 + norm + head) run by ``harness/parallel/pipeline.py``'s
  ``execute`` on the 1F1B action lists of ``harness/parallel/pipeline_schedule.py`` (``MICROBATCHES``
  microbatches), wrapped as :class:`harness.model.Pipelined`.

Implementations: ``composed`` (autograd everywhere) and ``manual`` (the 3D seed's dense MLP with a
hand-written backward, :class:`ManualMLP`, beside the autograd one). Both need etp = tp (switch
``etp_<tp>``) when the model has tp: the MoE's tokens are then those of the dense tp line.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness.events import paused
from harness.model import ModelCase
from reference import moe as ref_moe
from reference import tp as ref_tp
from reference.ring_attention import attention, merge_heads, split_heads

VOCAB, DIM, HEADS, HEAD_DIM, FFN, EXPERTS, TOPK, EXPERT_FFN = 32, 16, 4, 4, 32, 4, 2, 16
LAYERS, BATCH, SEQ = 2, 8, 8
MICROBATCHES = 2
EPS = 1e-5
# the MoE block first: a bug that makes the tp ranks' activations differ upstream of an MoE makes them
# route differently and its etp all-reduce mismatch (a crash, tests/model_composed_bugs.py's notpar)
MOE_LAYERS = (0,)


class MoEConfig:
    """What ``reference.moe.moe`` and ``harness.parallel.moe.moe`` read from a config: dropless softmax top-k,
    gates renormalised. No aux loss: a pipeline runs microbatches, and the Switch aux loss of a
    microbatch is not that of the batch (the model's loss would depend on the microbatch count)."""

    sizes = {"e": EXPERTS, "k": TOPK, "h": DIM, "f": EXPERT_FFN}
    switches = {"score": "softmax", "norm": "on", "cap": "none", "aux": "off"}

    def size(self, key):
        return self.sizes[key]

    def switch(self, key):
        return self.switches[key]


MOE = MoEConfig()


def _param(*shape, scale):
    return nn.Parameter(torch.randn(*shape) * scale)


# ---- the reference model (one process; the harness runs it in fp64) ---------------------------------
class Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = _param(VOCAB, DIM, scale=1.0)

    def forward(self, ids):
        with paused():  # the model's events are its modules' (hooks), not the components' own
            return ref_tp.forward("embed", {"emb": self.weight}, {"ids": ids})


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(DIM) + 0.1 * torch.randn(DIM))

    def forward(self, x):
        return F.rms_norm(x, (DIM,), self.weight, EPS)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (_param(HEADS * HEAD_DIM, DIM, scale=DIM ** -0.5) for _ in range(3))
        self.wo = _param(DIM, HEADS * HEAD_DIM, scale=(HEADS * HEAD_DIM) ** -0.5)

    def forward(self, x):
        q, k, v = (split_heads(x @ w.T, HEADS) for w in (self.wq, self.wk, self.wv))
        out, _ = attention(q, k, v, causal=True)
        return merge_heads(out) @ self.wo.T


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.b1 = _param(FFN, DIM, scale=DIM ** -0.5), _param(FFN, scale=0.1)
        self.w2, self.b2 = _param(DIM, FFN, scale=FFN ** -0.5), _param(DIM, scale=0.1)

    def forward(self, x):
        p = {"w1": self.w1, "b1": self.b1, "w2": self.w2, "b2": self.b2}
        with paused():
            return ref_tp.forward("mlp", p, {"x": x})


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = _param(EXPERTS, DIM, scale=DIM ** -0.5)
        self.w_gate = _param(EXPERTS, EXPERT_FFN, DIM, scale=DIM ** -0.5)
        self.w_up = _param(EXPERTS, EXPERT_FFN, DIM, scale=DIM ** -0.5)
        self.w_down = _param(EXPERTS, DIM, EXPERT_FFN, scale=EXPERT_FFN ** -0.5)

    def params(self):
        return {n: getattr(self, n) for n in ref_moe.PARAMS}

    def forward(self, x):
        b, s, h = x.shape
        with paused():
            return ref_moe.moe(MOE, x.reshape(b * s, h), self.params())["out"].view(b, s, h)


class Block(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = Norm(), Norm()
        self.attention = Attention()
        if index in MOE_LAYERS:
            self.moe = MoE()
        else:
            self.mlp = MLP()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        return h + ffn(self.ffn_norm(h))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = _param(VOCAB, DIM, scale=DIM ** -0.5)

    def forward(self, x):
        with paused():
            return ref_tp.forward("xent", {"head": self.weight}, {"x": x})


class Composed(nn.Module):
    """Embedding, blocks, norm, head. A pipeline stage is this model with what it does not run set
    to None (every parameter keeps its name)."""

    def __init__(self):
        super().__init__()
        self.embed = Embedding()
        self.layers = nn.ModuleDict({str(i): Block(i) for i in range(LAYERS)})
        self.norm = Norm()
        self.head = Head()

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(self.norm(h)) if self.head is not None else h


def build() -> Composed:
    return Composed()


def batch(step: int) -> dict[str, torch.Tensor]:
    """Random tokens; the target is the input shifted by one."""
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return {"input": tokens[:, :-1].contiguous(), "target": tokens[:, 1:].contiguous()}


class VocabLogits:
    """A rank's logits cut over tp by vocabulary (``loss`` runs the vocab-parallel cross-entropy)."""

    def __init__(self, logits, tp):
        self.logits, self.tp = logits, tp


def cross_entropy(output, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (vocab-parallel on a :class:`VocabLogits`)."""
    if isinstance(output, VocabLogits):
        from harness.parallel.tp import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(output.logits, target, output.tp, VOCAB).mean()
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten(0, 1))


def loss(output, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return cross_entropy(output, batch["target"])


# the implementations are in harness/examples/composed_parallel.py (torch.distributed and harness/parallel/ imports stay
# out of the reference's import path)
def parallelize(model, meshes):
    from .composed_parallel import parallelize as run

    return run(model, meshes, manual=False)


def parallelize_manual(model, meshes):
    from .composed_parallel import parallelize as run

    return run(model, meshes, manual=True)


def supports(spec) -> str | None:
    if spec.tp > 1 and spec.etp != spec.tp:
        return (f"the experts' FFN runs over the dense tp ranks: give etp_{spec.tp} (etp=1 would hand each "
                "expert the same tokens from every tp rank)")
    if EXPERTS % spec.ep:
        return f"ep={spec.ep} does not divide the {EXPERTS} experts"
    return None


CASE = ModelCase(
    build=build,
    batch=batch,
    loss=loss,
    parallelize={"composed": parallelize, "manual": parallelize_manual},
    steps=10,
    seq_dim=1,
    supports={"composed": supports, "manual": supports},
)


def cells():
    """The composed model's cells on 8 ranks (cases/test_models.py)."""
    from harness.model import model_cells

    return (model_cells("composed", impls=["composed"], meshes=["pp=2,dp=2,cp=2"], switches={"ep": ["2"]})
            + model_cells("composed", meshes=["pp=2,dp=2,tp=2"], switches={"ep": ["2"], "etp": ["2"]})
            + model_cells("composed", impls=["composed"], meshes=["dp=2,cp=2,tp=2"], switches={"ep": ["2", "4"], "etp": ["2"]})
            # FSDP4·EP2 saved after step 5, loaded as HSDP 2×2·EP2 for steps 6-10 (4 ranks: the 8-rank
            # FSDP4·TP2·EP2 -> HSDP2×2·TP2·EP2 trip passes too, but takes ~30 s on a loaded 2-core
            # machine, the case deadline; it is reshard_tp in tests/test_composed.py)
            + model_cells("composed", impls=["composed"], meshes=["dp=4"],
                          switches={"ep": ["2"], "reshard": ["rep2dp2at5"]}))


def reshard_tp():
    """The issue's example trip: FSDP4·TP2·EP2 saved after step 5, HSDP 2×2·TP2·EP2 from step 6."""
    from harness.model import model_cells

    return model_cells("composed", impls=["composed"], meshes=["dp=4,tp=2"],
                       switches={"ep": ["2"], "etp": ["2"], "reshard": ["rep2dp2tp2at5"]})


def cells16():
    """The 16-rank cell (pp2·dp2·cp2·tp2, ep4): run under torchrun (tests/test_composed.py)."""
    from harness.model import model_cells

    return model_cells("composed", impls=["composed"], meshes=["pp=2,dp=2,cp=2,tp=2"],
                       switches={"ep": ["4"], "etp": ["2"]})
