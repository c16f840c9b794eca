"""Tensor parallelism through Hugging Face transformers' TP styles (``transformers.distributed``).

The same ops as ``harness/parallel/tp.py``, as small modules parallelized by transformers' own
``apply_tensor_parallelism(model, tp_mesh, plan)`` with an expanded plan (every module and parameter
name mapped to a style name from ``ALL_PARALLEL_STYLES``), the way a ``PreTrainedModel``'s
``base_model_tp_plan`` is applied. Switch ``style`` picks which registered style(s) carry the op, so
every style transformers ships is run by the cases:

    op         style           plan
    colgather  colwiserep      lin: colwise_rep
    colgather  colwisegather   lin: colwise_gather_output
    colshard   colwise         lin: colwise
    rowsplit   rowwiserep      lin: rowwise_rep
    rowsplit   rowwisesplit    lin: rowwise_split_input
    rowshard   rowwise         lin: rowwise
    mlp        colrow          w1: colwise, w2: rowwise
    mlp        localparams     core: local_params (w1/b1 colwise, w2 rowwise shards), reduce: all_reduce,
                               b2: replicate; the input's gradient summed by transformers' _AllReduceBackward
    sp         seqpar          norm: sequence_parallel, w1/w2: colwise/rowwise with the sequence dim
    sp         gradallreduce   norm: replicated_with_grad_allreduce (its contract: a norm whose input
                               is sharded), w1/w2 as above
    embed      embedrow        emb: embedding_rowwise (vocab-parallel)
    embed      embedcol        emb: embedding_colwise (hidden-sharded)
    xent       colwisegather   head: colwise_gather_output, then plain cross-entropy (transformers has
                               no vocab-parallel loss; this is what its causal-LM plans do)
    gateup     packedcol       gate_up: packed_colwise, down: rowwise
    gateup     packedrow       gate_up stored [h, 2f] (experts' layout): packed_rowwise on it,
                               local_params on its module, down: rowwise

For ``sp`` the sequence dim is moved by transformers' ColwiseParallel(input_layouts=Shard(1)) and
RowwiseParallel(output_layouts=Shard(1)): the classes its registered styles are instances of (no
registered name carries a sequence-sharded input), installed the way apply_tensor_parallelism does.
Skips and declared divergences live in ``harness/parallel/thirdparty.py`` (importable without transformers).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from harness.config import Config
from harness.context import RankContext
from harness.layout import Piece, Shard
from harness.names import grad_name, param_name
from reference.common import probe_loss
from reference.tp import make_problem

from .step import reduce_and_step
from .tp import BATCH, INPUT_PLAN, OUTPUT_PLAN, local_batch
from . import tp_dtensor as dtensor
from .tp_dtensor import _linear

try:  # imported here so the pool's zygote pays for it once; absent, every cell skips in the parent
    from transformers.distributed.parallel_utils import _AllReduceBackward
    from transformers.distributed.tensor_parallel import ColwiseParallel, RowwiseParallel, apply_tensor_parallelism
except ImportError:  # pragma: no cover  harness.parallel.thirdparty.hf_skip says how to install it
    apply_tensor_parallelism = None

class _Lin(nn.Module):
    """A module owning one weight of the experts' layout ``[in, out]``, used as ``x @ W``."""

    def __init__(self, w_t: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(w_t.clone())

    def forward(self, x):
        return x @ self.weight


class _Core(nn.Module):
    """MLP on this rank's shards, owning its parameters (local_params swaps only a module's own),
    the second layer's bias left out (added once, after the sum)."""

    def __init__(self, p):
        super().__init__()
        self.w1, self.b1, self.w2 = (nn.Parameter(p[k].clone()) for k in ("w1", "b1", "w2"))

    def forward(self, x):
        return F.linear(F.gelu(F.linear(x, self.w1, self.b1)), self.w2)


class _Reduce(nn.Module):
    """Holds the core; its (partial) output is what the all_reduce style sums."""

    def __init__(self, p):
        super().__init__()
        self.core = _Core(p)

    def forward(self, x):
        return self.core(x)


class _Bias(nn.Module):
    def __init__(self, b):
        super().__init__()
        self.bias = nn.Parameter(b.clone())


class Layer(dtensor.Layer):
    """The op of ``reference.tp.forward`` as modules, for transformers' plan to name: DTensor's
    modules, plus the layouts only transformers' styles take (local_params MLP, packed gate/up)."""

    def __init__(self, op: str, style: str, p: dict[str, torch.Tensor], tp_group=None):
        super().__init__(op, p)
        self.style, self.tp_group = style, tp_group
        if op == "mlp" and style == "localparams":
            del self.w1, self.w2
            self.reduce, self.b2 = _Reduce(p), _Bias(p["b2"])
        elif op == "gateup":
            self.gate_up = _Lin(p["w_gu"].t().contiguous()) if style == "packedrow" else _linear(p["w_gu"], None)
            self.down = _linear(p["w_down"], p["b_down"])

    def forward(self, x, ids=None):
        if self.op == "mlp" and self.style == "localparams":
            # replicated input, sharded weights: its gradient is partial on each rank
            return self.reduce(_AllReduceBackward.apply(x, self.tp_group)) + self.b2.bias
        if self.op != "gateup":
            return super().forward(x, ids)
        if self.style == "packedrow":
            x = _AllReduceBackward.apply(x, self.tp_group)  # as moe_tp_experts does for its input
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)

    def parameter_names(self) -> dict[str, str]:
        """Module parameter name -> the reference's parameter name."""
        names = {**dtensor.PARAMETER_NAMES, "gate_up.weight": "w_gu", "down.weight": "w_down",
                 "down.bias": "b_down", "reduce.core.w1": "w1", "reduce.core.b1": "b1", "reduce.core.w2": "w2",
                 "b2.bias": "b2"}
        return {k: names[k] for k, _ in self.named_parameters()}


def _with_params(model: nn.Module, module_styles: dict[str, str]) -> dict[str, str]:
    """Expand a module plan the way transformers expands a PreTrainedModel's: each module's
    parameters get its style too (apply_tensor_parallelism wants every name spelled out)."""
    plan = {}
    for module_name, style in module_styles.items():
        plan[module_name] = style
        for p, _ in model.get_submodule(module_name).named_parameters(recurse=False):
            plan[f"{module_name}.{p}"] = style
    return plan


def _plan(op: str, style: str) -> dict[str, str]:
    """The registered-style plan of a cell (modules; parameters added by ``_with_params``)."""
    return {
        "colwiserep": {"lin": "colwise_rep"},
        "colwisegather": {"head" if op == "xent" else "lin": "colwise_gather_output"},
        "colwise": {"lin": "colwise"},
        "rowwiserep": {"lin": "rowwise_rep"},
        "rowwisesplit": {"lin": "rowwise_split_input"},
        "rowwise": {"lin": "rowwise"},
        "colrow": {"w1": "colwise", "w2": "rowwise"},
        "seqpar": {"norm": "sequence_parallel"},
        "gradallreduce": {"norm": "replicated_with_grad_allreduce"},
        "embedrow": {"emb": "embedding_rowwise"},
        "embedcol": {"emb": "embedding_colwise"},
        "packedcol": {"gate_up": "packed_colwise", "down": "rowwise"},
        "packedrow": {"gate_up": "local_params", "down": "rowwise"},
        "localparams": {"reduce": "all_reduce", "reduce.core": "local_params", "b2": "replicate"},
    }[style]


def parallelize(model: Layer, tp_mesh, op: str, style: str) -> Layer:
    """Apply transformers' styles to ``model`` on ``tp_mesh``."""
    from torch.distributed.tensor import Shard as DShard

    plan = _with_params(model, _plan(op, style))
    if style == "packedrow":
        plan["gate_up.weight"] = "packed_rowwise"
    if style == "localparams":  # the core's parameters are sharded by their own entries
        plan.update({"reduce.core.w1": "colwise", "reduce.core.b1": "colwise", "reduce.core.w2": "rowwise"})
    apply_tensor_parallelism(model, tp_mesh, plan)
    if op == "sp":  # the sequence-sharded input of w1 and output of w2: transformers' classes, by hand
        for name, cls in (("w1", ColwiseParallel(input_layouts=DShard(1))),
                          ("w2", RowwiseParallel(output_layouts=DShard(1)))):
            module = model.get_submodule(name)
            for p in ("weight", "bias"):
                cls.shard_param(module, p, tp_mesh)
            cls.install_forward(module, tp_mesh)
    return model


def _piece(t: torch.Tensor, shape, tp_placement: Shard | None = None, transpose: bool = False,
           **extra: Shard) -> Piece:
    """A Piece from a DTensor (placements as DTensor reports them, _StridedShard as a packed
    Shard) or from a plain local tensor."""
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(t, DTensor):
        if any(isinstance(p, Partial) for p in t.placements):
            t = t.redistribute(placements=[Replicate()] * len(t.placements))
        (placement,) = t.placements  # parallelized over the 1-D tp mesh
        if isinstance(placement, _StridedShard):
            tp_placement = Shard(placement.dim % t.ndim, packs=placement.split_factor)
        elif isinstance(placement, DShard):
            tp_placement = Shard(placement.dim % t.ndim)
        else:
            tp_placement = None
        t = t.to_local()
    if transpose:  # experts' layout [in, out] back to the reference's [out, in]
        t = t.t()
        if tp_placement is not None:
            tp_placement = Shard(1 - tp_placement.dim, packs=tp_placement.packs)
    placements = dict(extra) | ({"tp": tp_placement} if tp_placement is not None else {})
    return Piece.sharded(t, shape, **placements)


def run(ctx: RankContext, cfg: Config) -> dict[str, Piece]:
    """One training step of the op through transformers' styles on this rank."""
    from torch.distributed.tensor import DTensor, Partial

    op, style, problem = cfg.switch("op"), cfg.switch("style"), make_problem(cfg)
    tp_mesh = ctx.device_mesh["tp"]
    dp = ctx.group("dp") if "dp" in ctx.layout.names else None


    model = parallelize(Layer(op, style, problem.params, ctx.group("tp")), tp_mesh, op, style)
    inputs = {k: local_batch(ctx, t) for k, t in problem.inputs.items()}
    in_plan = INPUT_PLAN.get(op)
    out_plan = None if op == "xent" else OUTPUT_PLAN.get(op)  # xent: logits gathered by the head
    x = local_batch(ctx, problem.inputs["x"], in_plan).requires_grad_() if "x" in problem.inputs else None
    out = model(x, inputs.get("ids"))
    if op == "xent":
        loss = F.cross_entropy(out.flatten(0, 1).float(), inputs["labels"].flatten(), reduction="sum")
        loss = loss / problem.tokens
    else:
        probe = local_batch(ctx, problem.probe, out_plan)
        loss = probe_loss(out, probe, problem.tokens)
        if out_plan is not None:  # a sharded output gives a partial loss: sum it over tp
            loss = DTensor.from_local(loss, tp_mesh, [Partial()]).full_tensor()
    loss.backward()
    params = dict(model.named_parameters())
    total = reduce_and_step(list(params.values()), loss, [dp])

    pieces = {"out": _piece(out, problem.out_shape, out_plan, dp=BATCH), "loss": Piece.full(total)}
    if x is not None:
        pieces[grad_name("x")] = _piece(x.grad, problem.inputs["x"].shape, in_plan, dp=BATCH)
    for module_name, name in model.parameter_names().items():
        shape, transpose = problem.params[name].shape, module_name == "gate_up.weight" and style == "packedrow"
        pieces[grad_name(name)] = _piece(params[module_name].grad, shape, transpose=transpose)
        pieces[param_name(name)] = _piece(params[module_name].detach(), shape, transpose=transpose)
    return pieces
