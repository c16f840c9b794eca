"""What a user writes to check a whole model: :class:`ModelCase`; :class:`Pipelined` for
``parallelize`` functions that return a ``torch.distributed.pipelining`` schedule, and
:class:`Parallelized` for those whose trainer finishes the gradients itself.

A case is a plain value in the user's own module (``mypkg/cases.py: CASE = ModelCase(...)``); the
rank processes import it by path, as they import implementations, so it must be a module global.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from ..names import DEGREES, mesh_names
from ..parallel.optim import ShardwiseAdamW

# Applied to every parameter by the default optimizer. eps is large on purpose: with eps=1e-8 the
# first AdamW step is lr*sign(g), so rounding noise in a near-zero gradient would move a parameter by
# a full lr in one run and not in the other. lr is a model's usual order (a component's probe
# problems take 0.05, reference.common.ADAMW, so that one step shows in bf16).
ADAMW = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.01)

MIXED_PRECISION = ("autocast", "bf16", "params")
LOSS_REDUCTIONS = ("mean", "sum")
# the switches every model cell may take: the expert mesh and the reshard round trip (plan.py)
MESH_SWITCHES = ("ep", "etp", "reshard")


def default_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """``model(batch["input"])``."""
    return model(batch["input"])


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with :data:`ADAMW`, single-tensor path (``foreach=False``: the same arithmetic on a
    shard as on the whole tensor, so a sharded optimizer step is comparable element by element),
    run shard by shard on DTensor parameters (:class:`ShardwiseAdamW`)."""
    return ShardwiseAdamW(params, **ADAMW, foreach=False)


@dataclass(frozen=True)
class Pipelined:
    """What a ``parallelize`` function returns for a pipelined model.

    ``stages``: this rank's ``torch.distributed.pipelining.PipelineStage`` objects (one, or several
    for interleaved schedules); their ``submod`` modules keep the full model's parameter names
    (build each stage by deleting from the whole model what it does not run, as torchtitan does),
    so parameters are matched to the reference by name. ``schedule``: the schedule built over those
    stages with ``loss_fn=`` computing the loss of one microbatch as a *mean* (it is called as
    ``loss_fn(output, target)``, ``target`` being ``batch[target]`` of that microbatch); the harness
    calls ``schedule.step(batch[input], target=batch[target], losses=[...])`` on the stages that
    take input / compute the loss, once per step, with this rank's slice of the global batch.
    ``before_step``: called on every rank after each step's backward, before the optimizer step:
    where a parameter the unpipelined model ties (embedding and output head) but two stages hold
    as copies gets its gradients summed across them. The harness holds every copy of a tied
    parameter to the reference's one parameter (copies that drift apart fail as ``replicas``).
    """

    stages: tuple
    schedule: Any
    input: str = "input"
    target: str = "target"
    before_step: Callable[[], None] | None = None

    def __post_init__(self):
        object.__setattr__(self, "stages", tuple(self.stages) if isinstance(self.stages, (list, tuple))
                           else (self.stages,))

    @property
    def modules(self) -> list[nn.Module]:
        return [stage.submod for stage in self.stages]


@dataclass(frozen=True)
class Parallelized:
    """What a ``parallelize`` function returns when the module alone does not say how it trains
    (Megatron-Core's ``DistributedDataParallel`` and ``finalize_model_grads``).

    ``module``: the module that runs forward and holds this rank's parameters, named as the
    unparallelized model names them (or mapped by ``global_name``). ``step``: where the trainer runs
    a step's forward and backward itself (Megatron's ``forward_backward_func`` over its pipeline
    schedule), ``step(batch) -> loss``: both on this rank's slice of the step's global batch,
    returning the loss ``ModelCase.loss`` would (a pipeline's every stage returning the last
    stage's); None: the harness runs ``forward``, ``loss`` and backward. ``before_step``: called on every
    rank after each step's backward, before the harness reads the gradients and steps the optimizer:
    where a trainer's own code finishes the gradients and puts them in ``.grad`` (Megatron's
    ``finalize_model_grads``, then each ``param.main_grad`` into ``param.grad``). ``global_name``:
    this rank's name of a parameter -> the unparallelized model's name of what it holds, for
    parameters a rank names locally (Megatron's ``local_experts.<i>`` on expert-parallel rank ``r``
    is expert ``r * n_local + i`` of the whole model). A name held by some ranks only is judged where
    it is held: the ranks that hold it must be those of some coordinates of the cell's mesh dims.
    ``main_params``: where the trainer keeps fp32 main parameters for a model whose own are in the
    cell's low dtype (Megatron's mixed-precision optimizer), those tensors by the module's parameter
    names: the harness steps, reads and judges them in place of the module's (``before_step`` puts
    their gradients in their ``.grad``). ``after_step``: called on every rank after each optimizer
    step, where the trainer copies them into the model.
    """

    module: nn.Module
    step: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None
    before_step: Callable[[], None] | None = None
    global_name: Callable[[str], str] | None = None
    main_params: dict[str, torch.Tensor] | None = None
    after_step: Callable[[], None] | None = None


@dataclass(frozen=True)
class ModelCase:
    """A model, its data and loss, and the functions that parallelize it; see README "Your own model".

    * ``build()``: the model, in fp32. Called under the harness's seed, on every rank and in the
      reference, so every call returns the same initial parameters (do not seed it yourself).
    * ``batch(step)``: the **global** batch of step ``step`` (0-based) as a dict of tensors,
      deterministic (seed a ``torch.Generator`` from ``step``). The harness splits every tensor on
      dim 0 over the ``batch`` ranks (rep·dp) and, when ``seq_dim`` is set, on that
      dim over ``cp``; the global batch size must divide evenly.
    * ``loss(output, batch)``: the scalar loss of ``batch`` as one process computes it, a mean over
      its rows/tokens (each rank computes it on its own slice; the harness averages over the ranks
      that hold different data, which is what data-parallel gradient averaging assumes), or, with
      ``loss_reduction="sum"``, each rank's share of it.
    * ``loss_reduction``: how the ranks' losses make the global one. ``"mean"`` (default): each rank's
      loss is the mean over its own slice, the global loss their mean (gradients averaged over the
      data ranks). ``"sum"``: each rank's loss is its share of the global mean, its own sum over the
      global token count, as torchtitan's trainer computes it with FSDP's gradient division off; the
      global loss is their sum (a DTensor loss counts by its local value, its rank's share).
    * ``parallelize``: implementation name -> ``fn(model, meshes) -> nn.Module | Pipelined |
      Parallelized``, the
      function you train with, given :class:`harness.meshes.Meshes` (``meshes.dense["tp"]``,
      ``meshes.mesh("fsdp")``, ...). It may return the module it was given, changed in place.
      A module's output may be a DTensor (``loss_parallel``): the loss then runs under
      ``torch.distributed.tensor.parallel.loss_parallel()``.
    * ``forward(model, batch)``: how the model is called (default ``model(batch["input"])``).
    * ``optimizer(params)``: default :func:`default_optimizer` (AdamW, :data:`ADAMW`).
    * ``steps``: optimizer steps of a cell when the cell does not say (ids carry ``steps<N>``).
    * ``seq_dim``: the sequence dim of the batch tensors, split over ``cp`` (None: no cp).
    * ``placements``: for parameters that are plain tensors sharded by hand (Megatron-style), where
      each rank's piece sits: ``{"layers.*.fc1.weight": {"tp": Shard(0)}}`` (fnmatch patterns over
      parameter names, mesh dims as :mod:`harness.names` names them, torch's ``Shard``/``Replicate``;
      ``harness.layout.Shard`` is accepted too; the first pattern a name matches decides). A routed
      expert's weights split over the expert-tensor-parallel ranks name ``etp``: tp's ranks where the
      cell's ``etp`` switch is tp, whole where it is 1. Plain tensors not named are replicas, and the
      harness checks that every rank holds the same.
    * ``reduction``: the tolerance policy's ``n`` for this model, when the derived one (README,
      Tolerances: the largest Linear fan-in or the tokens the loss averages) does not fit.
    * ``mixed_precision``: how bf16/fp16 cells run: ``"autocast"`` (fp32 parameters and optimizer,
      forward under ``torch.autocast``), ``"bf16"`` (the model cast to the cell's dtype before
      ``parallelize``: parameters, gradients and optimizer state in it) or ``"params"`` (fp32
      parameters and optimizer, forward and backward on a copy of the parameters in the cell's
      dtype, gradients back in fp32: FSDP2's ``MixedPrecisionPolicy(param_dtype=<the cell's dtype>,
      reduce_dtype=torch.float32)``, which ``parallelize`` sets, reading :func:`harness.model.running`).
    * ``supports``: implementation name -> ``fn(spec) -> str | None`` (``spec`` a
      :class:`harness.meshes.MeshSpec`): why a mesh is not one that implementation can run (a
      TP-only plan on a dp mesh), or None; such cells are invalid for it, not skipped.
    * ``xfail``: implementation name -> ``fn(cfg) -> str | None``: why a cell is known to diverge
      upstream; it runs as a strict xfail.
    * ``switches``: the case's own switches, name -> values (the first the default and the
      simplest): kernel choices, tied or untied embeddings, anything ``build``, ``batch``,
      ``forward`` or ``parallelize`` read with :func:`harness.model.switches`. A cell names the
      values it takes in its id (``experts_batched``; ``model_cells(..., switches=...)``), and
      exploration (``python -m harness.explore <model>``) draws them. ``ep`` and ``etp`` may be
      listed too, with degrees as values: the expert meshes exploration draws.
    * ``fp32_ops``: aten ops the fp64 reference runs from their fp32 kernel (inputs cast to fp32,
      outputs back to fp64), for kernels with no fp64 implementation on the device, e.g.
      ``("_grouped_mm",)`` for transformers' grouped_mm experts. What such a reference certifies:
      :mod:`harness.compare.tolerance`.
    * ``mesh_names``: the names ``parallelize`` sees the meshes' dims and groups by, when it is
      written against another trainer's: ``"torchtitan"`` (``dp_replicate``, ``dp_shard``, ``cp``,
      ``tp``, ``pp``, ``ep``, flattened ``dp``, ``dp_shard_cp``, ``dp_cp``), or a mapping from the
      harness's names to yours (``{"dp": "shard"}``; :func:`harness.names.mesh_names`). The groups and
      ranks are the same; ids, ``placements`` and messages keep the harness's names.
    * ``acts_with``: switch name -> the mesh dims it acts with (``{"sp": ("tp",)}``: sequence
      parallelism changes nothing without tp): ``--quick`` runs each of its values on a mesh where
      one of those dims has a degree above 1.
    * ``judge_plain_activations``: whether a failing cell's diagnosis places a module's plain
      (not DTensor) outputs and their gradients by their shapes alone: this rank's rows of the batch
      on dim 0, a tp shard where a dim is short by tp. ``False`` for a model laid out otherwise
      (Megatron-Core's ``[s, b, h]`` activations, its packed ``[gate; up]`` outputs, its flattened
      tokens), whose shapes a guess would misread into a divergence that is not there: its
      divergence is then located by its DTensor activations and its parameters' gradients.
    """

    build: Callable[[], nn.Module]
    batch: Callable[[int], dict[str, torch.Tensor]]
    loss: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]
    parallelize: dict[str, Callable[..., Any]]
    forward: Callable[[nn.Module, dict[str, torch.Tensor]], Any] = default_forward
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = default_optimizer
    steps: int = 3
    seq_dim: int | None = None
    placements: dict[str, dict[str, Any]] = field(default_factory=dict)
    reduction: int | None = None
    loss_reduction: str = "mean"
    mixed_precision: str = "autocast"
    supports: dict[str, Callable[[Any], str | None]] = field(default_factory=dict)
    xfail: dict[str, Callable[[Any], str | None]] = field(default_factory=dict)
    switches: dict[str, tuple[str, ...]] = field(default_factory=dict)
    fp32_ops: tuple[str, ...] = ()
    mesh_names: str | dict[str, str] | None = None
    acts_with: dict[str, tuple[str, ...]] = field(default_factory=dict)
    judge_plain_activations: bool = True

    def __post_init__(self):
        if not self.parallelize:
            raise ValueError("ModelCase.parallelize is empty: give at least one {'name': fn(model, meshes)}")
        for name in self.parallelize:
            if not re.fullmatch(r"[a-z0-9]+", name):
                raise ValueError(f"ModelCase.parallelize name {name!r} must be lowercase letters and digits "
                                 "(it is part of the cell id)")
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"ModelCase.loss_reduction={self.loss_reduction!r}: choose one of {LOSS_REDUCTIONS} "
                             "('sum': each rank's loss is its share of the global loss)")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"ModelCase.mixed_precision={self.mixed_precision!r}: choose one of {MIXED_PRECISION}")
        if self.steps < 1:
            raise ValueError(f"ModelCase.steps={self.steps}: a model cell takes at least one optimizer step")
        for name, values in self.switches.items():
            if name == "reshard" or not re.fullmatch(r"[a-z]+", name):
                raise ValueError(f"ModelCase.switches name {name!r}: lowercase letters, not 'reshard' "
                                 f"(it is part of the cell id: {name}_<value>)")
            if name in MESH_SWITCHES and not all(str(v).isdigit() for v in values):
                raise ValueError(f"ModelCase.switches[{name!r}] = {values!r}: the expert mesh's degrees, e.g. ('1', '2')")
            if isinstance(values, str) or not values or not all(re.fullmatch(r"[a-zA-Z0-9]+", v) for v in values):
                raise ValueError(f"ModelCase.switches[{name!r}] = {values!r}: give a tuple of values of letters "
                                 "and digits, the default first, e.g. ('eager', 'batched')")
        mesh_names(self.mesh_names)  # raises on a bad value, naming the fix
        for name, dims in self.acts_with.items():
            if name not in self.switches or isinstance(dims, str) or not set(dims) <= set(DEGREES):
                raise ValueError(f"ModelCase.acts_with[{name!r}] = {dims!r}: give a switch of ModelCase.switches "
                                 f"and a tuple of the mesh dims it acts with ({', '.join(DEGREES)}), e.g. "
                                 "{'sp': ('tp',)}")
        if isinstance(self.fp32_ops, str):
            raise ValueError(f"ModelCase.fp32_ops={self.fp32_ops!r}: give a tuple of op names, e.g. ('_grouped_mm',)")
