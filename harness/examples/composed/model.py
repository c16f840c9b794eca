"""The composed model on one process: the single-process reference the harness runs in fp64.

:func:`build` assembles it from ``reference/``: a vocab embedding (``reference.tp`` op ``embed``),
``LAYERS`` blocks of RMSNorm -> causal softmax attention (``reference.ring_attention``) -> residual,
RMSNorm -> a dense GELU MLP (``reference.tp`` op ``mlp``, block 1) or a top-k mixture of experts
(``reference.moe.moe``, block 0) -> residual, a final RMSNorm and the output head (``reference.tp`` op
``xent``); :func:`loss`: mean next-token cross-entropy over :func:`batch`'s random tokens. Parameters
are plain ``nn.Parameter`` attributes named as the components name them (``layers.0.attention.wq``,
``layers.1.moe.w_gate``, ...). The sizes (``VOCAB``, ``DIM``, ...) are this module's constants.

Imports torch, ``reference/`` and ``harness.events`` only: the parallel modules (``parallel.py``)
build on this module, never the other way.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.events import paused
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


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of whole-vocabulary logits."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(0, 1))


def loss(output, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return cross_entropy(output, batch["target"])
