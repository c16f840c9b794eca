"""Single-process reference for context parallelism: plain softmax attention, in fp64.

Run as a layer, so that the projection gradients are checked too::

    q, k, v = heads(x Wq^T), heads(x Wk^T), heads(x Wv^T)     q: [b, hq, s, d], k/v: [b, hkv, s, d]
    attn, lse = attention(q, k, v, causal)                  lse: log-sum-exp of each query's scores
    out = merge_heads(attn) Wo^T

Grouped-query attention (switch ``gqa_on``): hkv = hq / 2 key/value heads, each shared by a group of
consecutive query heads. Loss: ``probe_loss(out)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from harness import events
from harness.config import Config
from harness.context import generator
from harness.layout import Shard, shard_indices
from harness.compare.tolerance import TORCH_DTYPE
from harness.names import grad_name

from .common import in_cell_dtype, probe_loss, record_step

SIZES = dict(b=2, h=16, q=4, d=4)  # batch, model dim, query heads, head dim; s is swept
PARAMS = ("wq", "wk", "wv", "wo")


def kv_heads(cfg: Config) -> int:
    return cfg.size("q") // 2 if cfg.switch("gqa") == "on" else cfg.size("q")


@dataclass
class Problem:
    x: torch.Tensor
    params: dict[str, torch.Tensor]
    probe: torch.Tensor
    tokens: int


def make_problem(cfg: Config) -> Problem:
    g = generator("ring_attention", cfg.problem_key)
    b, s, h, hq, d = (cfg.size(k) for k in "bshqd")
    dtype = TORCH_DTYPE[cfg.dtype]

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(dtype)

    hkv = kv_heads(cfg)
    params = {"wq": randn(hq * d, h, scale=h**-0.5), "wk": randn(hkv * d, h, scale=h**-0.5),
              "wv": randn(hkv * d, h, scale=h**-0.5), "wo": randn(h, hq * d, scale=(hq * d) ** -0.5)}
    # Unit-scale x: scores of order 1, a softmax far from uniform yet not peaked. Sharper inputs make
    # the softmax backward ill-conditioned: with x scaled by 2, plain single-process fp32 attention
    # is already ~180 eps (of the tensor's rms) off fp64 in dQ, at scale 1 ~20 eps.
    return Problem(randn(b, s, h), params, torch.randn((b, s, h), generator=g), b * s)


def split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, s, heads*d] -> [b, heads, s, d]"""
    b, s, _ = t.shape
    return t.view(b, s, heads, -1).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """[b, heads, s, d] -> [b, s, heads*d]"""
    b, heads, s, d = t.shape
    return t.transpose(1, 2).reshape(b, s, heads * d)


def attention(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention written out; returns the output and the per-query log-sum-exp."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = q.shape[2]
        hidden = torch.ones(s, s, dtype=torch.bool).triu(1)  # key j > query i
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def record_ring_steps(cfg: Config, q, k, v, causal: bool) -> None:
    """Events for bisect: the running output after each step of a ring over ``cp`` ranks. After step
    ``t`` a query held by cp rank r has met the keys of ranks r, r-1, ..., r-t (mod cp), which is what
    ring attention has merged by then; rows that have met no visible key yet are zero."""
    cp, s = cfg.degree("cp"), q.shape[2]
    shard = Shard(0, zigzag=cfg.switch("layout") == "zigzag")
    owner = torch.empty(s, dtype=torch.long)
    for r in range(cp):
        owner[shard_indices(torch.arange(s), shard, cp, r)] = r
    lag = (owner.unsqueeze(1) - owner.unsqueeze(0)) % cp  # [query, key]: the step that brings the key
    visible = torch.ones(s, s, dtype=torch.bool).tril() if causal else torch.ones(s, s, dtype=torch.bool)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).detach()
    before = torch.zeros_like(q)
    for step in range(cp):
        seen = visible & (lag <= step)
        weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1).nan_to_num(0.0)
        after = weights @ v.detach()
        events.record("ring", {"before": before}, {"after": after}, ring_step=step)
        before = after


def reference(cfg: Config, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """The reference results, in fp64 (in ``dtype``: the calibration)."""
    problem = make_problem(cfg)
    hq, hkv = cfg.size("q"), kv_heads(cfg)
    params = {k: t.to(dtype).requires_grad_() for k, t in problem.params.items()}
    x = problem.x.to(dtype).requires_grad_()
    q, k, v = (split_heads(x @ params[w].T, n) for w, n in (("wq", hq), ("wk", hkv), ("wv", hkv)))
    for t in (q, k, v):
        t.retain_grad()
    causal = cfg.switch("mask") == "causal"
    if events.active():
        record_ring_steps(cfg, q, k, v, causal)
    attn, lse = attention(q, k, v, causal)
    events.op("attention", {"q": q, "k": k, "v": v}, {"attn": attn})
    out = merge_heads(attn) @ params["wo"].T
    loss = probe_loss(out, problem.probe.to(dtype), problem.tokens)
    loss.backward()
    result = {"out": out.detach(), "loss": loss.detach(), "attn": attn.detach(), "lse": lse.detach(),
              grad_name("x"): x.grad, grad_name("q"): q.grad, grad_name("k"): k.grad, grad_name("v"): v.grad}
    return record_step(params, result)


calibration = in_cell_dtype(reference)


def reduction_size(cfg: Config) -> dict[str, int]:
    """Terms each result adds: keys per query and features per projection; a weight gradient sums
    over tokens, dK/dV over the queries of a K/V head's group, the loss over every output element."""
    b, s, h, hq, d = (cfg.size(k) for k in "bshqd")
    group = hq // kv_heads(cfg)
    sizes = {"*": max(s, h, hq * d), "loss": b * s * h, "grad/k": s * group, "grad/v": s * group}
    sizes.update({f"grad/{w}": b * s for w in PARAMS})
    return sizes
