"""Pipeline parallelism through PyTorch's ``torch.distributed.pipelining``, run by the same cases.

Each of this rank's stages becomes an ``nn.Module`` (the same layers as ``harness/parallel/pipeline.py``,
tensor-parallel over ``tp`` when the mesh has it) wrapped in a ``PipelineStage`` on the pp process
group; ``ScheduleGPipe``, ``Schedule1F1B`` or ``ScheduleInterleaved1F1B`` (stages placed the same
way, stage ``s`` on pp coordinate ``s % pp``) runs them. Torch splits the batch into microbatches
and finds the peers itself.

Loss scaling: torch's schedules divide the accumulated gradients by the number of microbatches
(``scale_grads=True``, the default), so the loss function returns a microbatch's *mean* (times
``GRAD_SCALE`` / dp), not the mean divided by ``m`` as ``harness/parallel/pipeline.py`` does. Tied
embeddings, dp reduction and the AdamW step are ours, after the schedule, as in our implementation.

That scaling is per stage: a parameter two stages of one rank share is divided by m twice. The one
cell where that happens (tied E at pp=1 interleaved: both stages on one rank) skips with that reason.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.compare.tolerance import TORCH_DTYPE
from harness.config import Config
from harness.context import RankContext
from harness.layout import Piece, Shard, take
from harness.names import grad_name, param_name, state_name
from reference.common import adamw
from reference.pipeline import BLOCK, GRAD_SCALE, make_problem, tied

from .collectives import all_reduce_, copy_to_group
from .pipeline import exchange_add_, held, peers, placements
from .tp import column_parallel, row_parallel, vocab_parallel_cross_entropy, vocab_parallel_embedding

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


def skip_reason(cfg: Config) -> str | None:
    if "pp" not in cfg.dims:  # found by harness.explore: without one, the stage group was the whole world
        return "torch.distributed.pipelining takes its stage group from the mesh's pp dim: name one (pp=1 for none)"
    if cfg.degree("pp") == 1 and cfg.size("vs") > 1 and tied(cfg):
        # measured: grad/emb norm ratio 0.69 (= (1/m + 1/m^2) / (2/m) at m=2), every element off
        return ("torch's schedules divide each stage's gradients by m separately (PipelineStage.scale_grads): "
                "the tied embedding, one parameter of both stages on this rank when pp=1, is divided twice")
    return None


class StageModule(nn.Module):
    """One pipeline stage: its rows of the stacked block parameters, the embedding or the head."""

    def __init__(self, blocks: dict[str, torch.Tensor], emb: nn.Parameter | None, head: nn.Parameter | None,
                 tp, vocab: int):
        super().__init__()
        self.blocks = nn.ParameterDict({k: nn.Parameter(t) for k, t in blocks.items()})
        # registered, so that the schedule's gradient scaling (by 1/m) reaches them too
        self.emb, self.head = emb, head
        self.tp, self.vocab = tp, vocab

    def forward(self, x):
        p, tp = self.blocks, self.tp
        if self.emb is not None:
            x = vocab_parallel_embedding(x, self.emb, tp, self.vocab)
        for k in range(p["w1"].shape[0]):
            hidden = F.gelu(column_parallel(x, p["w1"][k], p["b1"][k], tp))
            x = x + row_parallel(hidden, p["w2"][k], p["b2"][k], tp)
        if self.head is not None:  # logits (this tp rank's vocab chunk); the schedule applies loss_fn
            return F.linear(copy_to_group(x, tp), self.head)
        return x


def run(ctx: RankContext, cfg: Config) -> dict[str, Piece]:
    from torch.distributed import pipelining

    problem = make_problem(cfg)
    pp, coord, vs = ctx.degree("pp"), ctx.coord("pp"), cfg.size("vs")
    dp_n, tp_n, tp_c = ctx.degree("dp"), ctx.degree("tp"), ctx.coord("tp")
    group = ctx.group("pp") if "pp" in ctx.layout.names else None
    tp = ctx.group("tp") if tp_n > 1 else None
    dp = ctx.group("dp") if dp_n > 1 else None
    place, n_stages = placements(cfg), pp * vs
    depth = cfg.size("l") // n_stages

    # The ends this rank holds, as parameters (the last stage's head is its copy of E when tied).
    ends: dict[str, nn.Parameter] = {}
    for k in ("emb", "head"):
        if k in problem.params and coord in {c % pp for c in place[k]["pp"].on}:
            ends[k] = nn.Parameter(take(take(problem.params[k], place[k]["pp"], pp, coord), place[k]["tp"], tp_n, tp_c))
    if tied(cfg) and coord == pp - 1:
        ends["head"] = ends["emb"]
    # Local stacked block rows (our layout), cut per local stage.
    local = {k: take(take(problem.params[k], place[k]["pp"], pp, coord), place[k].get("tp"), tp_n, tp_c)
             for k in BLOCK}
    modules, stages = [], []
    for j in range(vs):
        s = j * pp + coord
        rows = {k: t[j * depth:(j + 1) * depth].clone() for k, t in local.items()}
        module = StageModule(rows, ends["emb"] if s == 0 else None, ends["head"] if s == n_stages - 1 else None,
                             tp, cfg.size("v"))
        modules.append(module)
        stages.append(pipelining.PipelineStage(module, s, n_stages, ctx.device, group=group))

    def loss_fn(logits, labels):  # a microbatch's mean; torch divides the gradients by m itself
        per_token = vocab_parallel_cross_entropy(logits, labels, tp, cfg.size("v"))
        return per_token.mean() * (GRAD_SCALE / dp_n)

    m = cfg.size("m")
    kind = getattr(pipelining, SCHEDULES[cfg.switch("sched")])
    schedule = kind(stages if vs > 1 else stages[0], n_microbatches=m, loss_fn=loss_fn)
    ids = take(problem.ids, Shard(0), dp_n, ctx.coord("dp"))
    labels = take(problem.labels, Shard(0), dp_n, ctx.coord("dp"))
    losses: list[torch.Tensor] = []
    holds_last = coord == pp - 1
    args = (ids,) if coord == 0 else ()
    kwargs = dict(target=labels, losses=losses) if holds_last else {}
    schedule.step(*args, **kwargs)

    leaves = [p for mod in modules for p in mod.blocks.values()] + [ends[k] for k in ends if not (k == "head" and tied(cfg))]
    if tied(cfg) and pp > 1 and coord in (0, pp - 1):
        exchange_add_([ends["emb"].grad], peers(ctx)[pp - 1 - coord], group)
    all_reduce_([t.grad for t in leaves], dp)
    total = None
    if holds_last:  # each loss is a microbatch mean * GRAD_SCALE / dp: their mean, summed over dp
        total = (torch.stack([loss.detach().float() for loss in losses]).sum() / (m * GRAD_SCALE)).reshape(1)
        all_reduce_([total], dp)
    grads = {k: torch.cat([mod.blocks[k].grad for mod in modules]) for k in BLOCK}
    grads |= {k: ends[k].grad.clone() for k in ends if not (k == "head" and tied(cfg))}
    optimizer = adamw(leaves)
    optimizer.step()

    def stacked(key: str, k: str):  # optimizer state of the local stages' rows, in our stacked layout
        return torch.cat([optimizer.state[mod.blocks[k]][key] for mod in modules])

    dtype, layout = TORCH_DTYPE[cfg.dtype], ctx.layout
    pieces = {"loss": held(total, (1,), {"pp": Shard(0, on=(-1,))}, layout, ctx.rank,
                           torch.float32)}
    for k, full in problem.params.items():
        if k in BLOCK:
            values = {grad_name(k): grads[k], param_name(k): torch.cat([mod.blocks[k].detach() for mod in modules]),
                      state_name("exp_avg", k): stacked("exp_avg", k), state_name("exp_avg_sq", k): stacked("exp_avg_sq", k)}
        elif k in ends:
            state = optimizer.state[ends[k]]
            values = {grad_name(k): grads[k], param_name(k): ends[k].detach(),
                      state_name("exp_avg", k): state["exp_avg"], state_name("exp_avg_sq", k): state["exp_avg_sq"]}
        else:
            values = dict.fromkeys((grad_name(k), param_name(k), state_name("exp_avg", k), state_name("exp_avg_sq", k)))
        for name, value in values.items():
            pieces[name] = held(None if value is None else value.detach(), full.shape, place[k], layout, ctx.rank, dtype)
    return pieces
