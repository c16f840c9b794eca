"""Pipeline parallelism over the ``pp`` mesh dim: the schedule's action lists run with point-to-point sends.

Read beside ``reference/pipeline.py``. The L blocks are cut into ``pp * vs`` stages of equal depth;
stage ``s`` lives on pp coordinate ``s % pp`` (so with ``vs`` virtual stages, rank ``r`` holds
layers of stages ``r, r + pp, ...``: ``Shard(0, packs=vs)`` of the stacked layer dim). The first
stage also holds the embedding, the last the head and the loss.

1. ``validate`` builds every rank's action list (``harness/parallel/pipeline_schedule.py``) and simulates
   it without communication before any rank runs: a list that deadlocks, sends to the wrong rank,
   or runs a backward before its forward is a ConfigError naming rank, stage and microbatch.
2. Each rank runs its own list: ``F`` runs the stage on a microbatch, keeping input and output for
   ``B``, which back-propagates the received output gradient; sends are ``isend`` (waited for at
   the end), receives block. Peers are pp coordinates, turned into global ranks through the pp
   process group (``dist.get_global_rank``): the rank at that pp coordinate with our dp/tp
   coordinates, whatever the order of the mesh dims. Never a hand-written rank map.
3. Loss scaling: a microbatch's loss is its mean divided by ``m * dp``, so microbatches and dp
   ranks add up to the mean over the global batch for any ``m`` (all microbatches are equal in size).
4. After the schedule: tied embedding/head gradients summed between the first and the last stage
   (one exchange between those two ranks), then gradients summed over dp, then AdamW.

With ``tp`` in the mesh, each stage runs the tensor-parallel layers of ``harness/parallel/tp.py``: blocks
as column- then row-parallel MLPs, the embedding and the loss vocab-parallel; activations between
stages are replicated over tp, and each tp rank talks to the rank of its own tp coordinate.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import events
from harness.compare.tolerance import TORCH_DTYPE
from harness.config import Config, ConfigError
from harness.context import RankContext
from harness.events import At
from harness.layout import MeshLayout, Piece, Shard, empty_chunk_rule, piece_index, take
from harness.names import grad_name, param_name, state_name
from reference.common import adamw
from reference.pipeline import BLOCK, GRAD_SCALE, make_problem, tied

from . import pipeline_schedule as ps
from .collectives import all_reduce_, copy_to_group
from .tp import column_parallel, row_parallel, vocab_parallel_cross_entropy, vocab_parallel_embedding

MESH_DIMS = ("dp", "pp", "tp")
# How block parameters [L, ...] split over tp (None: replicated); their layer dim splits over pp.
TP_PLAN = {"w1": Shard(1), "b1": Shard(1), "w2": Shard(2), "b2": None}


# ---- rules ------------------------------------------------------------------------------------

def validate(cfg: Config) -> None:
    """Rules of the pp component, checked before any rank runs (the schedule is simulated here)."""
    extra = [name for name, _ in cfg.mesh if name not in MESH_DIMS]
    if extra:
        raise ConfigError(f"pp cells take mesh dims {', '.join(MESH_DIMS)}, not {extra}")
    name, tie = cfg.switch("sched"), cfg.switch("tied")
    if name not in ps.BUILDERS:
        raise ConfigError(f"unknown pipeline schedule sched_{name}; known: {', '.join(ps.BUILDERS)}")
    if tie not in ("on", "off"):
        raise ConfigError(f"switch tied is on or off, got tied_{tie}")
    pp, dp, tp = cfg.degree("pp"), cfg.degree("dp"), cfg.degree("tp")
    b, m, layers, vs = cfg.size("b"), cfg.size("m"), cfg.size("l"), cfg.size("vs")
    if ps.VIRTUAL[name] == "one" and vs != 1:
        raise ConfigError(f"sched_{name} runs one stage per rank: set vs1 (got vs{vs}), or use sched_interleaved")
    if ps.VIRTUAL[name] == "several" and vs < 2:
        raise ConfigError(f"sched_interleaved needs at least 2 virtual stages per rank: set vs2 or more (got vs{vs})")
    if layers % (pp * vs):
        raise ConfigError(f"layers l={layers} do not divide into pp×vs = {pp}×{vs} = {pp * vs} stages of equal depth: "
                          f"choose l a multiple of {pp * vs}")
    if b % (dp * m):
        raise ConfigError(f"batch b={b} does not divide into dp×m = {dp}×{m} = {dp * m} equal microbatches "
                          f"(dp={dp} ranks, m={m} microbatches each): choose b a multiple of {dp * m}")
    if name != "gpipe" and m < pp:
        raise ConfigError(f"sched_{name} needs at least pp={pp} microbatches to fill the pipeline, got m={m}: "
                          f"with fewer it never reaches its 1F1B steady state (use m≥{pp}, or sched_gpipe)")
    if name == "interleaved" and m % ps.rounds(pp, m):
        r = ps.rounds(pp, m)
        raise ConfigError(f"sched_interleaved runs m={m} microbatches in max(1, m // pp) = {r} rounds of equal size, "
                          f"and {r} does not divide {m}: choose m a multiple of {r}, or a multiple of pp={pp}")
    for key in ("f", "v"):
        if not empty_chunk_rule(cfg.size(key), tp):
            raise ConfigError(f"tp={tp} leaves a rank an empty chunk of {key}={cfg.size(key)}: "
                              f"choose {key} with ceil({key}/tp)*(tp-1) < {key}")
    ps.simulate(schedule(cfg))


def schedule(cfg: Config) -> ps.Schedule:
    """Every pp rank's action list for this config (the same on every process)."""
    return ps.build(cfg.switch("sched"), cfg.degree("pp"), cfg.size("m"), cfg.size("vs"))


# ---- peers from the mesh ---------------------------------------------------------------------

def peers(ctx: RankContext) -> dict[int, int]:
    """pp coordinate -> global rank of the rank there that shares our other coordinates (dp, tp).

    Derived from the pp process group of this rank's mesh line, so it holds for any order of the
    mesh dims; ``tests/test_pipeline_schedule.py`` checks it against ``harness.layout.MeshLayout``.
    """
    if "pp" not in ctx.layout.names:
        return {0: ctx.rank}
    group = ctx.group("pp")
    return {c: dist.get_global_rank(group, c) for c in range(ctx.degree("pp"))}


def describe_peers(ctx: RankContext, payload) -> dict[int, int]:
    """Pool task for the tests: this rank's :func:`peers`."""
    return peers(ctx)


# ---- the stages --------------------------------------------------------------------------------

class Stages:
    """This rank's stages: their layers (rows of the local stacked block parameters) and ends."""

    def __init__(self, cfg: Config, sched: ps.Schedule, coord: int, tp, dp_degree: int):
        self.cfg, self.sched, self.tp = cfg, sched, tp
        self.depth = cfg.size("l") // sched.stages  # layers per stage
        self.last = sched.stages - 1
        self.vocab = cfg.size("v")
        self.dp = dp_degree
        self.scale = cfg.size("m") * dp_degree  # microbatch mean / (m * dp): see the module docstring
        self.rows = {s: range(j * self.depth, (j + 1) * self.depth) for j, s in enumerate(sched.stages_of(coord))}

    def forward(self, s: int, mb: int, x: torch.Tensor, p: dict, labels: torch.Tensor | None) -> torch.Tensor:
        """Stage ``s`` on microbatch ``mb``: token ids in on the first stage, the scaled loss out of the last."""
        tp = self.tp
        if s == 0:
            x = vocab_parallel_embedding(x, p["emb"], tp, self.vocab)
        # events: a microbatch's activations, the rows of every dp rank's mb-th chunk
        rows = At((x.shape[0] * self.dp, *x.shape[1:]), dp=Shard(0))
        for j, k in enumerate(self.rows[s]):
            hidden = F.gelu(column_parallel(x, p["w1"][k], p["b1"][k], tp))
            y = x + row_parallel(hidden, p["w2"][k], p["b2"][k], tp)
            events.op("block", {"x": (x, rows)}, {"y": (y, rows)}, layer=s * self.depth + j, microbatch=mb)
            x = y
        if s < self.last:
            return x
        logits = F.linear(copy_to_group(x, tp), p["head"])
        per_token = vocab_parallel_cross_entropy(logits, labels, tp, self.vocab)
        events.op("head", {"x": (x, rows)}, {"token_loss": (per_token, At(rows.shape[:2], dp=Shard(0)))}, microbatch=mb)
        return per_token.mean() / self.scale


def execute(sched: ps.Schedule, coord: int, stages: Stages, params: dict, ids: list, labels: list,
            peer_rank: dict[int, int], group, act_shape: tuple, dtype) -> torch.Tensor:
    """Run this rank's action list; gradients accumulate in ``params``. Returns the summed loss (last stage)."""
    kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (stage, mb) -> (input, output)
    inbox: dict[tuple[str, int, int], torch.Tensor] = {}  # payloads received or handed over locally
    outbox: dict[tuple[str, int, int], torch.Tensor] = {}  # payloads waiting for their send
    sending, total = [], torch.zeros((), dtype=torch.float32)
    for i, a in enumerate(sched.lists[coord]):
        try:
            if a.kind in (ps.RF, ps.RB):
                buf = torch.empty(act_shape, dtype=dtype)
                dist.recv(buf, src=peer_rank[a.peer], group=group)
                inbox[ps.payload(a)] = buf
            elif a.kind in (ps.SF, ps.SB):
                t = outbox.pop(ps.payload(a))
                sending.append((dist.isend(t, dst=peer_rank[a.peer], group=group), t))
            elif a.kind == ps.F:
                s, m = a.stage, a.mb
                x = ids[m] if s == 0 else inbox.pop(("activation", s - 1, m)).requires_grad_()
                out = stages.forward(s, m, x, params, labels[m])
                kept[s, m] = (x, out)
                if s == stages.last:
                    total += out.detach().float()
                else:  # for SF, or for the next stage when it lives on this rank too (pp=1)
                    box = outbox if sched.rank_of(s + 1) != coord else inbox
                    box["activation", s, m] = out.detach()
            else:  # B
                s, m = a.stage, a.mb
                x, out = kept.pop((s, m))
                if s == stages.last:
                    (out * GRAD_SCALE).backward()
                else:
                    out.backward(inbox.pop(("gradient", s + 1, m)))
                if s > 0:
                    box = outbox if sched.rank_of(s - 1) != coord else inbox
                    box["gradient", s, m] = x.grad
        except Exception as error:
            raise RuntimeError(f"pp rank {coord} failed at action {i} {a} of {sched.name} "
                               f"(pp={sched.pp} m={sched.microbatches} vs={sched.virtual})") from error
    for work, _ in sending:
        work.wait()
    assert not kept and not outbox, f"pp rank {coord}: left over {sorted(kept)} {sorted(outbox)}"
    return total


def exchange_add_(tensors: list[torch.Tensor], peer: int, group) -> None:
    """In place, no autograd: ``t += peer's t`` between this rank and ``peer`` (global rank)."""
    theirs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, u, peer, group) for u in theirs]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for t, u in zip(tensors, theirs):
        t.add_(u)


# ---- what each rank holds and returns ----------------------------------------------------------

def placements(cfg: Config) -> dict[str, dict[str, Shard]]:
    """Per parameter, how it is placed over the mesh (pp and tp; replicated over dp)."""
    vs, out = cfg.size("vs"), {}
    emb_on = (0, -1) if tied(cfg) else (0,)  # tied: the last stage holds a replica of E as its head
    out["emb"] = {"pp": Shard(0, on=emb_on), "tp": Shard(0)}
    if not tied(cfg):
        out["head"] = {"pp": Shard(0, on=(-1,)), "tp": Shard(0)}
    for k in BLOCK:
        out[k] = {"pp": Shard(0, packs=vs)} | ({"tp": TP_PLAN[k]} if TP_PLAN[k] else {})
    return out


def held(t: torch.Tensor | None, shape, place: dict[str, Shard], layout: MeshLayout, rank: int, dtype) -> Piece:
    """This rank's piece of a logical tensor; an empty one where the rank holds none of it."""
    if t is None:
        t = torch.zeros([len(i) for i in piece_index(Piece(None, tuple(shape), place), layout, rank)], dtype=dtype)
    return Piece.sharded(t, shape, **place)


def local_params(cfg: Config, full: dict[str, torch.Tensor], coord: int, pp: int, tp_n: int, tp_c: int) -> dict:
    """This rank's leaves: its layers (and tp shards) of each block tensor, the ends it holds."""
    place, out = placements(cfg), {}
    for k, t in full.items():
        pp_shard = place[k]["pp"]
        if pp_shard.on and coord not in {c % pp for c in pp_shard.on}:
            continue
        out[k] = take(take(t, pp_shard, pp, coord), place[k].get("tp"), tp_n, tp_c).requires_grad_()
    if "emb" in out and coord == pp - 1 and tied(cfg):
        out["head"] = out["emb"]  # the last stage's copy of E is its head (one leaf when pp=1)
    return out


def run(ctx: RankContext, cfg: Config) -> dict[str, Piece]:
    """One training step through the pipeline on this rank; returns local pieces placed on the mesh."""
    problem, sched = make_problem(cfg), schedule(cfg)
    pp, coord = ctx.degree("pp"), ctx.coord("pp")
    dp_n, tp_n = ctx.degree("dp"), ctx.degree("tp")
    group = ctx.group("pp") if "pp" in ctx.layout.names else None
    tp = ctx.group("tp") if tp_n > 1 else None
    dp = ctx.group("dp") if dp_n > 1 else None
    params = local_params(cfg, problem.params, coord, pp, tp_n, ctx.coord("tp"))

    m = cfg.size("m")  # this dp rank's rows of the batch, cut into m microbatches
    ids = take(problem.ids, Shard(0), dp_n, ctx.coord("dp")).chunk(m)
    labels = take(problem.labels, Shard(0), dp_n, ctx.coord("dp")).chunk(m)
    act_shape = (ids[0].shape[0], cfg.size("s"), cfg.size("h"))
    stages = Stages(cfg, sched, coord, tp, dp_n)
    total = execute(sched, coord, stages, params, ids, labels, peers(ctx), group, act_shape, TORCH_DTYPE[cfg.dtype])

    leaves = {k: t for k, t in params.items() if not (k == "head" and tied(cfg))}
    if tied(cfg) and pp > 1 and coord in (0, pp - 1):  # E's gradient: the embedding's plus the head's
        exchange_add_([leaves["emb"].grad], peers(ctx)[pp - 1 - coord], group)
    all_reduce_([t.grad for t in leaves.values()], dp)
    if coord == pp - 1:
        all_reduce_([total], dp)
    grads = {k: t.grad.clone() for k, t in leaves.items()}
    optimizer = adamw(list(leaves.values()))
    optimizer.step()

    dtype = TORCH_DTYPE[cfg.dtype]
    layout, shapes, place = ctx.layout, {k: t.shape for k, t in problem.params.items()}, placements(cfg)
    pieces = {"loss": held(total.reshape(1) if coord == pp - 1 else None, (1,), {"pp": Shard(0, on=(-1,))},
                           layout, ctx.rank, torch.float32)}
    for k in shapes:
        t = leaves.get(k)
        state = optimizer.state[t] if t is not None else {}
        for name, value in ((grad_name(k), grads.get(k)), (param_name(k), t),
                            (state_name("exp_avg", k), state.get("exp_avg")),
                            (state_name("exp_avg_sq", k), state.get("exp_avg_sq"))):
            pieces[name] = held(None if value is None else value.detach(), shapes[k], place[k], layout, ctx.rank, dtype)
    return pieces
