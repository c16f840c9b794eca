"""Expert parallelism on torch.distributed: token dispatch and combine with uneven all-to-all.

Read beside ``reference/moe.py``: the same layer, with the experts sharded over an ``ep`` dim (each
ep rank holds e/ep whole experts), optionally each expert's FFN split over ``etp`` (Megatron-style:
gate/up column-parallel, down row-parallel), and the tokens split over the ranks. Per step, on every
rank:

1. route its tokens (router replicated, run in fp32 as trainers do), pick the top-k experts;
2. count slots per expert; gather those counts from every rank that holds other tokens, to apply the
   capacity rule over the whole global batch (below);
3. sort the kept slots by expert (so by destination), exchange the per-expert counts with
   ``all_to_all_single``, then the tokens with uneven splits (:class:`Dispatch`), and regroup the
   received rows by local expert;
4. run the local experts; send the results back with the reverse all-to-all (:class:`Combine`),
   restore the tokens' original order, and combine them with the gates (plain autograd, so the
   router gets its gradient through the gates).

Capacity is counted **over the whole global batch**, as in the reference: ranks hold the tokens in
global order (rank order, then local order), so a slot's place in its expert's queue is the number
of slots routed to that expert by lower ranks (from the gathered counts) plus those of earlier local
tokens; it is kept when that place is below C. The decision is made at the source, before the
dispatch, and so is the ``dropped`` mask. Counting per source rank instead would make the result
depend on the mesh.

Meshes (switch ``emesh``):

* ``dense``: the cell's mesh is the expert mesh, dims ``ep`` (and ``etp``). Tokens split over ep,
  replicated over etp; the router's gradients are summed over ep.
* ``ep<N>`` or ``ep<N>etp<M>``: the cell's mesh is the dense one, dims ``dp`` (and ``tp``), and the
  expert mesh ``edp × ep=N × etp=M`` over the same ranks, row-major, is declared beside it
  (:func:`meshes`): ep is borrowed from the data-parallel ranks ("dp2ep", torchtitan). The router
  is replicated over the whole data-parallel world and its gradients summed over it; expert
  parameters are sharded over ep and their gradients summed only over ``edp``, the ranks that hold
  the same experts. With etp=1 and a dense tp>1, each tp rank routes its own chunk of its dp
  shard's tokens (sequence-parallel style) and the output is gathered back over tp; with etp=tp the
  dense tp ranks are the expert's FFN shards.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import events
from harness.config import Config, ConfigError
from harness.context import RankContext
from harness.events import At
from harness.layout import Piece, Shard, take
from harness.names import grad_name, param_name
from reference.common import probe_loss, sgd_step
from reference.moe import AUX_WEIGHT, EXPERT_PARAMS, capacity, has_aux, make_problem, probs_of, scores_of, swiglu

from .collectives import (all_reduce_, all_to_all_rows, copy_to_group, gather_from_group, group_rank, group_size,
                          reduce_from_group, split_to_group)

SCORES = ("softmax", "sigmoid")
ROUTES = ("rand", "one", "skew")
_EMESH = re.compile(r"dense|ep(\d+)(?:etp(\d+))?")
# Expert weights: which dim the etp split cuts (the FFN dim f). Gate/up column-parallel, down row-parallel.
FFN_DIM = {"w_gate": 1, "w_up": 1, "w_down": 2}


@dataclass(frozen=True)
class Layout:
    """Where tokens and experts live for one config; pure, so validate, meshes and run share it."""

    expert_dims: tuple[tuple[str, int], ...]  # the expert mesh (the cell's mesh for emesh=dense)
    token_dim: str  # the cell-mesh dim that splits the batch: ep (emesh=dense) or dp
    split_tp: bool  # the MoE tokens are further split over the cell's tp dim (etp=1 < tp)
    ep: int
    etp: int
    edp: int

    @property
    def token_dims(self) -> tuple[str, ...]:
        """Cell-mesh dims whose ranks hold distinct MoE tokens, outer to inner (global token order)."""
        return (self.token_dim, "tp") if self.split_tp else (self.token_dim,)


def layout(cfg: Config) -> Layout:
    emesh = cfg.switch("emesh")
    m = _EMESH.fullmatch(emesh)
    if not m:
        raise ConfigError(f"switch emesh={emesh!r}: use 'dense' (the cell's mesh is ep[,etp]) or "
                          "'ep<N>' / 'ep<N>etp<M>' (an expert mesh borrowed from the cell's dp[,tp])")
    allowed = ("ep", "etp") if emesh == "dense" else ("dp", "tp")
    extra = [name for name, _ in cfg.mesh if name not in allowed]
    if extra:
        raise ConfigError(f"moe cells with emesh_{emesh} take mesh dims {' and '.join(allowed)}, not {extra}"
                          + ("" if emesh == "dense" else "; the expert mesh is named by emesh"))
    if emesh == "dense":
        return Layout(cfg.mesh, "ep", False, cfg.degree("ep"), cfg.degree("etp"), 1)
    if [name for name, _ in cfg.mesh] == ["tp", "dp"]:
        # the expert mesh is laid over dp x tp row-major (Shard inner factors in expert_placements);
        # tp outermost gave wrong expert gradients (found by harness.explore: tp2.dp2 emesh_ep2)
        raise ConfigError(f"moe cells with emesh_{emesh} take dp before tp (dp outermost, as a trainer's dense "
                          f"mesh lays them out), got {','.join(f'{n}={d}' for n, d in cfg.mesh)}")
    ep, etp = int(m.group(1)), int(m.group(2) or 1)
    dp, tp, world = cfg.degree("dp"), cfg.degree("tp"), cfg.world
    if ep < 1 or etp < 1:
        raise ConfigError(f"switch emesh={emesh}: ep and etp must be at least 1")
    if etp not in (1, tp):
        raise ConfigError(f"emesh ep{ep}etp{etp}: etp={etp} must equal the dense tp={tp} (the dense tensor-parallel "
                          "ranks then hold each expert's FFN shards), or be 1")
    if etp > 1 and dp % ep:
        raise ConfigError(f"ep={ep} does not fit the data-parallel dim it borrows from: dp={dp} is not a multiple "
                          f"of ep={ep}; choose ep dividing dp")
    if etp == 1 and not (tp % ep == 0 or (ep % tp == 0 and dp % (ep // tp) == 0)):
        raise ConfigError(f"ep={ep} does not fit the data-parallel ranks it borrows from (dp={dp} x tp={tp} = "
                          f"{world}, row-major): choose ep dividing tp, or tp times a divisor of dp")
    dims = (("edp", world // (ep * etp)), ("ep", ep), ("etp", etp))
    dims = tuple((n, d) for n, d in dims if d > 1 or n == "ep")
    return Layout(dims, "dp", etp == 1 and tp > 1, ep, etp, world // (ep * etp))


def meshes(cfg: Config) -> list[tuple[tuple[str, int], ...]]:
    """The expert mesh, when it is not the cell's own."""
    return [] if cfg.switch("emesh") == "dense" else [layout(cfg).expert_dims]


def validate(cfg: Config) -> None:
    """Rules of the moe component, checked before any rank runs."""
    lay = layout(cfg)
    score, norm, route, cap = (cfg.switch(k) for k in ("score", "norm", "route", "cap"))
    aux = dict(cfg.switches).get("aux", "on")
    if score not in SCORES or norm not in ("on", "off") or route not in ROUTES or aux not in ("on", "off"):
        raise ConfigError(f"moe switches: score in {SCORES}, norm in (on, off), route in {ROUTES}, aux in (on, off) "
                          f"(optional, default on); got score={score} norm={norm} route={route} aux={aux}")
    e, k = cfg.size("e"), cfg.size("k")
    if e % lay.ep:
        raise ConfigError(f"e={e} experts do not split over ep={lay.ep}: each ep rank holds whole experts, "
                          f"choose e a multiple of {lay.ep}")
    if k > e:
        raise ConfigError(f"top-k k={k} is larger than the number of experts e={e}: choose k <= e")
    if cap != "none" and not (cap.isdigit() and int(cap) > 0):
        raise ConfigError(f"capacity factor cap_{cap} must be > 0: give it in percent (cap_100 = 1.0, "
                          "cap_125 = 1.25) or cap_none for dropless")
    if route == "skew" and k > e // 2:
        raise ConfigError(f"route_skew starves the last half of the experts: k={k} must be at most e/2={e // 2}")
    shards = cfg.world // lay.etp
    if cfg.size("t") % shards:
        raise ConfigError(f"t={cfg.size('t')} tokens do not split over the {shards} ranks that hold distinct "
                          f"tokens: choose t a multiple of {shards}")
    if cfg.size("f") % lay.etp:
        raise ConfigError(f"etp={lay.etp} does not divide the expert FFN dim f={cfg.size('f')}: "
                          f"choose f a multiple of {lay.etp}")


def expert_placements(cfg: Config, name: str) -> dict[str, Shard]:
    """How an expert weight's pieces sit on the cell's mesh: experts (dim 0) over ep, FFN over etp."""
    lay = layout(cfg)
    if cfg.switch("emesh") == "dense":
        return {"ep": Shard(0)} | ({"etp": Shard(FFN_DIM[name])} if lay.etp > 1 else {})
    tp = cfg.degree("tp")
    if lay.etp > 1:  # ep coordinate = dp coordinate % ep; the dense tp ranks are the etp shards
        return {"dp": Shard(0, inner=lay.ep), "tp": Shard(FFN_DIM[name])}
    if tp % lay.ep == 0:  # ep inside each tp line: ep coordinate = tp coordinate % ep
        return {"tp": Shard(0, inner=lay.ep)} if lay.ep > 1 else {}
    # ep spans whole tp lines: ep coordinate = (dp coordinate % (ep/tp)) * tp + tp coordinate
    return {"dp": Shard(0, inner=lay.ep // tp)} | ({"tp": Shard(0)} if tp > 1 else {})


# ---- the exchange ----------------------------------------------------------------------------------
@dataclass
class Exchange:
    """Who sends which rows where, for one step: built once, used by Dispatch and Combine."""

    order: torch.Tensor  # kept slots (flat index i*k+j), sorted by expert: the send order
    send: list[int]  # rows to each ep rank
    recv: list[int]  # rows from each ep rank
    to_local: torch.Tensor  # received rows (by source, then local expert) -> by local expert, then source
    local_counts: list[int]  # rows for each local expert
    slots: int  # n*k
    k: int
    group: object


def plan_exchange(route: torch.Tensor, kept: torch.Tensor, experts: int, group) -> Exchange:
    """Sort the kept slots by expert, exchange per-expert counts with ``all_to_all_single``."""
    ep = group_size(group)
    local = experts // ep
    flat = route.flatten()
    kept_slots = kept.flatten().nonzero().squeeze(1)
    order = kept_slots[torch.argsort(flat[kept_slots], stable=True)]
    counts = torch.bincount(flat[order], minlength=experts)
    # from each source ep rank, how many rows it sends to each of this rank's experts: [source, local]
    got = all_to_all_rows(counts, [local] * ep, [local] * ep, group).view(ep, local)
    starts = (got.flatten().cumsum(0) - got.flatten()).view(ep, local)
    to_local = torch.cat([torch.arange(int(starts[s, l]), int(starts[s, l] + got[s, l]))
                          for l in range(local) for s in range(ep)] + [torch.zeros(0, dtype=torch.long)])
    return Exchange(order, counts.view(ep, local).sum(1).tolist(), got.sum(1).tolist(), to_local,
                    got.sum(0).tolist(), flat.numel(), route.shape[1], group)


def _from_local(y: torch.Tensor, plan: Exchange) -> torch.Tensor:
    """Rows in local-expert order -> back in received order (by source rank)."""
    out = torch.empty_like(y)
    out[plan.to_local] = y
    return out


class Dispatch(torch.autograd.Function):
    """Forward: each kept slot's token to the ep rank of its expert (all-to-all, uneven splits), then
    regrouped by local expert. Backward: the conjugate, Combine's movement: the reverse all-to-all
    brings each row's gradient home, where it is summed into the token it was copied from."""

    @staticmethod
    def forward(ctx, x, plan: Exchange):
        ctx.plan, ctx.tokens = plan, x.shape[0]
        sent = x[plan.order // plan.k]
        return all_to_all_rows(sent, plan.recv, plan.send, plan.group)[plan.to_local]

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        home = all_to_all_rows(_from_local(grad, plan), plan.send, plan.recv, plan.group)
        return grad.new_zeros(ctx.tokens, grad.shape[1]).index_add_(0, plan.order // plan.k, home), None


class Combine(torch.autograd.Function):
    """Forward: expert outputs back to their source rank (the reverse all-to-all) and into the
    tokens' original slots: [n, k, h], zero for dropped slots. Backward: the conjugate, Dispatch's
    movement: each slot's gradient to its expert's rank, regrouped by local expert."""

    @staticmethod
    def forward(ctx, y, plan: Exchange):
        ctx.plan = plan
        home = all_to_all_rows(_from_local(y, plan), plan.send, plan.recv, plan.group)
        slots = y.new_zeros(plan.slots, y.shape[1])
        slots[plan.order] = home  # the un-permutation: each result back to the slot it came from
        return slots.view(-1, plan.k, y.shape[1])

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        sent = grad.reshape(plan.slots, -1)[plan.order]
        return all_to_all_rows(sent, plan.recv, plan.send, plan.group)[plan.to_local], None


# ---- the layer -------------------------------------------------------------------------------------
def gather_counts(counts: torch.Tensor, groups: list) -> torch.Tensor:
    """[ranks holding distinct tokens, e]: every such rank's counts, in global token order.
    ``groups`` are outer to inner; gathering the inner one first keeps the row-major order."""
    out = counts.unsqueeze(0)
    for group in reversed(groups):
        if group_size(group) > 1:
            parts = [torch.empty_like(out) for _ in range(group_size(group))]
            dist.all_gather(parts, out.contiguous(), group=group)
            out = torch.cat(parts)
    return out


def shard_index(groups: list) -> int:
    """This rank's place among the ranks holding distinct tokens (global token order)."""
    index = 0
    for group in groups:
        index = index * group_size(group) + group_rank(group)
    return index


def keep_mask(route: torch.Tensor, experts: int, cap: int | None, token_groups: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept slots under the global capacity rule, and the global slot count per expert."""
    counts = torch.bincount(route.flatten(), minlength=experts)
    every = gather_counts(counts, token_groups)
    total = every.sum(0)
    if cap is None:
        return torch.ones(route.shape, dtype=torch.bool), total
    before = every[:shard_index(token_groups)].sum(0)  # slots of lower ranks, per expert
    onehot = F.one_hot(route.flatten(), experts)
    place = before[route.flatten()] + (onehot.cumsum(0) * onehot).sum(1) - 1  # queue place of each slot
    return (place < cap).view(route.shape), total


def run_experts(tokens: torch.Tensor, counts: list[int], p: dict, etp) -> torch.Tensor:
    """This rank's experts on their rows (FFN split over etp: partial outputs summed over it)."""
    rows = copy_to_group(tokens, etp)  # each etp shard contributes part of the input gradient
    outs = [swiglu(chunk, p["w_gate"][i], p["w_up"][i], p["w_down"][i]) for i, chunk in enumerate(rows.split(counts))]
    return reduce_from_group(torch.cat(outs + [tokens.new_zeros(0, tokens.shape[1])]), etp)


def record_experts(x: torch.Tensor, y: torch.Tensor, counts: list[int], ep, token_groups: list) -> None:
    """Events for bisect: each local expert's rows in and out. They are logical (every token routed
    to the expert, in global order) only when this rank's ep group holds every token, so with an
    edp > 1 layout the experts record nothing rather than a part."""
    if not events.active() or math.prod(group_size(g) for g in token_groups) != group_size(ep):
        return
    first = group_rank(ep) * len(counts)
    for i, (rows_in, rows_out) in enumerate(zip(x.split(counts), y.split(counts))):
        events.record("expert", {"x": rows_in}, {"y": rows_out}, expert=first + i)


def moe(cfg: Config, x, p: dict, ep, etp, token_groups: list, tokens: int, rows: dict | None = None):
    """The MoE layer on this rank's tokens; mirrors ``reference.moe.moe``. Returns the output, this
    rank's share of the aux loss, the chosen experts and the dropped slots. ``rows``: where this
    rank's tokens sit among all (placements), for the events."""
    e, k, score = cfg.size("e"), cfg.size("k"), cfg.switch("score")
    scores = scores_of(F.linear(x.float(), p["router"].float()), score)
    rows = rows or {}
    events.op("router", {"x": (x, At((tokens, x.shape[1]), **rows))}, {"scores": (scores, At((tokens, e), **rows))})
    gates, route = scores.topk(k, dim=-1)
    if cfg.switch("norm") == "on":
        gates = gates / gates.sum(-1, keepdim=True)
    kept, total = keep_mask(route, e, capacity(cfg), token_groups)
    plan = plan_exchange(route, kept, e, ep)
    mine = Dispatch.apply(x, plan)
    y = run_experts(mine, plan.local_counts, p, etp)
    record_experts(mine, y, plan.local_counts, ep, token_groups)
    combined = Combine.apply(y, plan)
    out = (gates.unsqueeze(-1) * combined.float()).sum(1).to(x.dtype)
    frac = total.float() / (tokens * k)
    aux = e * (frac * probs_of(scores, score).sum(0) / tokens).sum()  # this rank's tokens' share
    return out, aux, route, ~kept


def run(ctx: RankContext, cfg: Config) -> dict[str, Piece]:
    """One training step of the MoE layer on this rank; returns local pieces placed on the cell's mesh."""
    problem, lay = make_problem(cfg), layout(cfg)
    names = ctx.layout.names

    def dense(name):  # a dim of the cell's (dense) mesh, None when the mesh lacks it
        return ctx.group(name) if name in names else None

    xmesh = ctx.mesh(lay.expert_dims)
    expert_group = {name: xmesh.get_group(name) for name, _ in lay.expert_dims}
    ep, etp, edp = (expert_group.get(n) for n in ("ep", "etp", "edp"))
    token_groups = [dense(d) for d in lay.token_dims]
    tp = dense("tp")

    ep_rank, etp_rank = group_rank(ep), group_rank(etp)
    params = {"router": problem.params["router"].clone().requires_grad_()}
    for name in EXPERT_PARAMS:
        mine = take(problem.params[name], Shard(0), lay.ep, ep_rank)
        params[name] = take(mine, Shard(FFN_DIM[name]), lay.etp, etp_rank).requires_grad_()

    batch = Shard(0)
    x = take(problem.x, batch, ctx.degree(lay.token_dim), ctx.coord(lay.token_dim)).requires_grad_()
    xm = split_to_group(x, 0, tp) if lay.split_tp else x  # backward: all-gather dx over tp
    on_moe_tokens = {lay.token_dim: batch} | ({"tp": batch} if lay.split_tp else {})
    out_m, aux, route, dropped = moe(cfg, xm, params, ep, etp, token_groups, problem.tokens, on_moe_tokens)
    out = gather_from_group(out_m, 0, tp, x.shape[0]) if lay.split_tp else out_m
    probe = take(problem.probe, batch, ctx.degree(lay.token_dim), ctx.coord(lay.token_dim))
    main = probe_loss(out, probe, problem.tokens)  # complete over tp (out is gathered), partial over the batch
    weight = AUX_WEIGHT if has_aux(cfg) else 0.0  # aux_off: a layer without a load-balancing loss
    (main + weight * aux).backward()

    # the router saw this rank's tokens only; experts' gradients are complete within an ep group
    for group in token_groups:
        all_reduce_([params["router"].grad], group)
    all_reduce_([params[n].grad for n in EXPERT_PARAMS], edp)
    main, aux = main.detach().clone(), aux.detach().clone()
    all_reduce_([main], dense(lay.token_dim))
    for group in token_groups:
        all_reduce_([aux], group)
    with torch.no_grad():
        sgd_step(list(params.values()))

    t, h = problem.x.shape
    k = cfg.size("k")
    on_tokens = {lay.token_dim: batch}
    pieces = {
        "out": Piece.sharded(out, (t, h), **on_tokens),
        "loss": Piece.full(main + weight * aux),
        "route": Piece.sharded(route.float(), (t, k), **on_moe_tokens),
        "dropped": Piece.sharded(dropped.float(), (t, k), **on_moe_tokens),
        grad_name("x"): Piece.sharded(x.grad, (t, h), **on_tokens),
        grad_name("router"): Piece.full(params["router"].grad),
        param_name("router"): Piece.full(params["router"]),
    }
    if has_aux(cfg):
        pieces["aux"] = Piece.full(aux)
    for name in EXPERT_PARAMS:
        where = expert_placements(cfg, name)
        pieces[grad_name(name)] = Piece.sharded(params[name].grad, problem.params[name].shape, **where)
        pieces[param_name(name)] = Piece.sharded(params[name], problem.params[name].shape, **where)
    return pieces
