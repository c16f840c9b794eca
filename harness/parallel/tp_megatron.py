"""Tensor parallelism through Megatron-Core's layers (``megatron.core.tensor_parallel``).

The same ops as ``harness/parallel/tp.py``, built from Megatron-Core 0.16.1's ColumnParallelLinear,
RowParallelLinear, VocabParallelEmbedding and vocab_parallel_cross_entropy, with the reference's
parameters copied into each rank's partition (Megatron splits evenly, so its partition is our
``torch.chunk`` piece whenever it accepts the size at all):

    colgather  ColumnParallelLinear(gather_output=True)
    colshard   ColumnParallelLinear(gather_output=False)
    rowsplit   RowParallelLinear(input_is_parallel=False)
    rowshard   RowParallelLinear(input_is_parallel=True)
    mlp        ColumnParallelLinear -> gelu -> RowParallelLinear
    embed      VocabParallelEmbedding
    xent       ColumnParallelLinear(bias=False) -> vocab_parallel_cross_entropy
    gateup     ColumnParallelLinear(h, 2f) holding [gate chunk; up chunk] per rank (Megatron's
               gated-linear-unit layout), chunk(2) of the local output, silu * up, RowParallelLinear

Skipped without CUDA (``harness/parallel/thirdparty.py``): ``sp``, and ``colgather``/``rowsplit`` at tp > 1,
whose gathers Megatron allocates on ``torch.cuda.current_device()``; at tp=3 Megatron refuses the
sizes itself (even division).

Process groups: the layers take ``tp_group=`` (the cell's tp group, built by the pool for every
rank). ``vocab_parallel_cross_entropy`` still reads ``parallel_state``'s module globals, so for the
duration of the cell those globals name the same group (``megatron_tp_group``) and are restored
after: ``initialize_model_parallel`` cannot be used, as it calls ``new_group`` over the whole pool
world (idle pool ranks would never join) and requires the world to equal tp * pp * cp * dp.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from harness.compare.tolerance import TORCH_DTYPE
from harness.config import Config
from harness.context import RankContext
from harness.layout import Piece, take
from harness.names import grad_name, param_name
from reference.common import probe_loss
from reference.tp import make_problem

from .step import reduce_and_step
from .tp import BATCH, INPUT_PLAN, OUTPUT_PLAN, PARAM_PLAN, local_batch

try:  # imported here so the pool's zygote pays for it once; absent, every cell skips in the parent
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                               vocab_parallel_cross_entropy)
except ImportError:  # pragma: no cover  the skip function says how to install it
    parallel_state = None


@contextlib.contextmanager
def megatron_tp_group(group, ranks: list[int]):
    """Point Megatron's global tensor-parallel state at ``group`` for the duration of a cell.

    Megatron reads the tp group, rank and size through ``parallel_state.get_tensor_model_parallel_*``,
    which return these globals; the group is the cell's own (its ranks are exactly ``ranks``).
    """
    names = ("_TENSOR_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS",
             "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK")
    saved = {n: getattr(parallel_state, n) for n in names}
    parallel_state._TENSOR_MODEL_PARALLEL_GROUP = group
    parallel_state._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = ranks
    parallel_state._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = None  # derived from the group
    parallel_state._MPU_TENSOR_MODEL_PARALLEL_RANK = None
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(parallel_state, n, v)


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value)


class Layer(torch.nn.Module):
    """The op of ``reference.tp.forward`` from Megatron-Core layers, holding this rank's shards."""

    def __init__(self, op: str, full: dict[str, torch.Tensor], local: dict[str, torch.Tensor], tp_group,
                 dtype: torch.dtype):
        super().__init__()
        self.op = op
        n = tp_group.size()
        config = ModelParallelConfig(tensor_model_parallel_size=n, use_cpu_initialization=True,
                                     perform_initialization=False, params_dtype=dtype)

        def column(name, bias=None, gather=False):
            out_dim, in_dim = full[name].shape
            layer = ColumnParallelLinear(in_dim, out_dim, config=config, init_method=torch.nn.init.zeros_,
                                         bias=bias is not None, gather_output=gather, tp_group=tp_group)
            _set(layer.weight, local[name])
            if bias is not None:
                _set(layer.bias, local[bias])
            return layer

        def row(name, bias, parallel_input=True):
            out_dim, in_dim = full[name].shape
            layer = RowParallelLinear(in_dim, out_dim, config=config, init_method=torch.nn.init.zeros_, bias=True,
                                      input_is_parallel=parallel_input, skip_bias_add=False, tp_group=tp_group)
            _set(layer.weight, local[name])
            _set(layer.bias, local[bias])
            return layer

        if op in ("colgather", "colshard"):
            self.lin = column("w", "b", gather=op == "colgather")
        elif op in ("rowsplit", "rowshard"):
            self.lin = row("w", "b", parallel_input=op == "rowshard")
        elif op == "mlp":
            self.w1, self.w2 = column("w1", "b1"), row("w2", "b2")
        elif op == "embed":
            v, h = full["emb"].shape
            self.emb = VocabParallelEmbedding(v, h, init_method=torch.nn.init.zeros_, config=config,
                                              tp_group=tp_group)
            _set(self.emb.weight, local["emb"])
        elif op == "xent":
            self.head = column("head")
        elif op == "gateup":
            self.gate_up, self.down = column("w_gu"), row("w_down", "b_down")
        else:
            raise ValueError(f"Megatron-Core tp implementation has no op {op!r}")

    def forward(self, x, ids=None):
        op = self.op
        if op in ("colgather", "colshard", "rowsplit", "rowshard"):
            return self.lin(x)[0]
        if op == "mlp":
            return self.w2(F.gelu(self.w1(x)[0]))[0]
        if op == "embed":
            return self.emb(ids)
        if op == "xent":
            return self.head(x)[0]
        gate, up = self.gate_up(x)[0].chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)[0]

    def parameter_names(self) -> dict[str, str]:
        """Module parameter name -> the reference's parameter name."""
        names = {"lin.weight": "w", "lin.bias": "b", "w1.weight": "w1", "w1.bias": "b1", "w2.weight": "w2",
                 "w2.bias": "b2", "emb.weight": "emb", "head.weight": "head", "gate_up.weight": "w_gu",
                 "down.weight": "w_down", "down.bias": "b_down"}
        return {k: names[k] for k, _ in self.named_parameters()}


def run(ctx: RankContext, cfg: Config) -> dict[str, Piece]:
    """One training step of the op through Megatron-Core's layers on this rank."""
    op, problem = cfg.switch("op"), make_problem(cfg)
    tp = ctx.group("tp")
    dp = ctx.group("dp") if "dp" in ctx.layout.names else None
    n, c = ctx.degree("tp"), ctx.coord("tp")


    plan = PARAM_PLAN[op]
    local = {k: take(t, plan[k], n, c) for k, t in problem.params.items()}
    ranks = [r for group in ctx.layout.groups("tp") if ctx.rank in group for r in group]
    with megatron_tp_group(tp, ranks):
        model = Layer(op, problem.params, local, tp, TORCH_DTYPE[cfg.dtype])
        inputs = {k: local_batch(ctx, t) for k, t in problem.inputs.items()}
        x = None
        if "x" in problem.inputs:
            x = local_batch(ctx, problem.inputs["x"], INPUT_PLAN.get(op)).requires_grad_()
        out = model(x, inputs.get("ids"))
        if op == "xent":
            per_token = vocab_parallel_cross_entropy(out.float(), inputs["labels"])
            loss = per_token.sum() / problem.tokens
        else:
            probe = local_batch(ctx, problem.probe, OUTPUT_PLAN.get(op))
            loss = probe_loss(out, probe, problem.tokens)
        loss.backward()
        value = loss.detach().clone()
        if op in OUTPUT_PLAN and op != "xent":  # each tp rank saw part of the output: its loss is partial
            torch.distributed.all_reduce(value, group=tp)
    params = dict(model.named_parameters())
    total = reduce_and_step(list(params.values()), value, [dp])

    mesh_out = {"dp": BATCH} | ({"tp": OUTPUT_PLAN[op]} if op in OUTPUT_PLAN else {})
    pieces = {"out": Piece.sharded(out, problem.out_shape, **mesh_out), "loss": Piece.full(total)}
    if x is not None:
        mesh_x = {"dp": BATCH} | ({"tp": INPUT_PLAN[op]} if op in INPUT_PLAN else {})
        pieces[grad_name("x")] = Piece.sharded(x.grad, problem.inputs["x"].shape, **mesh_x)
    for module_name, name in model.parameter_names().items():
        placement = {"tp": plan[name]} if plan[name] is not None else {}
        shape = problem.params[name].shape
        pieces[grad_name(name)] = Piece.sharded(params[module_name].grad, shape, **placement)
        pieces[param_name(name)] = Piece.sharded(params[module_name].detach(), shape, **placement)
    return pieces
