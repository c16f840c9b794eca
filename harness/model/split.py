"""Whether a model cell ran what its id says: something split over every dim of its mesh, and a
bf16 or fp16 cell computed in that dtype. A green is earned only there.

A ``parallelize`` that ignores a dim leaves each of its ranks running the whole of what one process
runs, and the cell would match for nothing. So each rank notes what split each dim, the ranks share
their notes, and a dim of degree above 1 that no rank split ends the cell as a failure
(:class:`harness.world.SplitNothing`, one line naming the dim and ``ModelCase.supports``), never a
pass; exploration takes such a draw as invalid. What splits a dim:

=========  ==============================================================================
``pp``     ``parallelize`` returned a :class:`harness.model.Pipelined`
``rep``    the harness: each rep·dp rank trains its own rows of the global batch
``dp``     the same (with parameters whole, it is data parallelism; the numbers say if it is right)
``cp``     the harness: the batch's ``seq_dim`` split over cp (a cp mesh without one is invalid)
``tp``     a parameter, buffer or step-1 activation sharded over ranks that differ in tp: a DTensor
           ``Shard`` on any mesh (the cell's, a flattened one, the user's own), or
           ``ModelCase.placements``
``ep``     (the switch) the function reached for the expert mesh (``meshes.sparse``,
           ``meshes.mesh``/``group`` of ``ep``, ``etp``, ``efsdp``) or sharded a DTensor over a
           mesh dim named ``ep``, or named a parameter locally (``Parallelized.global_name``:
           Megatron's local experts)
=========  ==============================================================================

A bf16 or fp16 cell in which no module's step-1 output on any rank was in that dtype ran in fp32
(``ModelCase(mixed_precision="params")`` leaves the precision to ``parallelize``, which may set no
policy on a mesh without FSDP): it ends as a failure (:class:`harness.world.RanFp32`), one line
saying so and how to set the precision, never a pass at fp32's numbers.
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DShard

from ..compare.tolerance import TORCH_DTYPE
from ..layout import MeshLayout
from ..meshes.device_mesh import Meshes
from ..names import DENSE
from ..world import RanFp32, SplitNothing
from .hooks import _tensors
from .placement import declared_placements

BY_THE_HARNESS = ("rep", "dp", "cp")  # the batch's rows, and its seq_dim over cp


class Watched(Meshes):
    """The cell's meshes as ``parallelize`` gets them, noting whether it reached for the expert mesh."""

    def __init__(self, meshes: Meshes):
        self.__dict__.update(vars(meshes))
        self.reached = False

    def __getattribute__(self, name):
        if name == "sparse":
            object.__setattr__(self, "reached", True)
        return object.__getattribute__(self, name)


class Notes:
    """The dims something was split over on this rank (``split``)."""

    def __init__(self, cfg, case, degrees: dict[str, int], ours: dict[str, str] | None = None):
        self.layout = MeshLayout.of(cfg.mesh)
        self.case, self.degrees = case, degrees
        self.ours = ours or {}  # the case's own mesh dim names -> ours (ModelCase.mesh_names)
        self.split: set[str] = {d for d in BY_THE_HARNESS if degrees.get(d, 1) > 1}
        self.dtype = cfg.dtype
        self.low = TORCH_DTYPE[cfg.dtype] if cfg.dtype in ("bf16", "fp16") else None  # the dtype to compute in
        self.computed_low = False  # whether a module's output was in it
        self._spans: dict[tuple[int, int], set[str]] = {}
        self._hook = None

    def dims_of(self, mesh, i: int) -> set[str]:
        """The cell's dims whose coordinates differ within this rank's group of ``mesh``'s dim ``i``."""
        key = (id(mesh), i)
        if key not in self._spans:
            ranks = dist.get_process_group_ranks(mesh.get_group(i))
            names = self.layout.names
            self._spans[key] = {n for n in names if len({self.layout.coord(r, n) for r in ranks}) > 1}
        return self._spans[key]

    def tensor(self, tensor) -> None:
        """Note the dims ``tensor`` (a DTensor) is sharded over."""
        if not isinstance(tensor, DTensor):
            return
        mesh = tensor.device_mesh
        names = mesh.mesh_dim_names or ()
        for i, placement in enumerate(tensor.placements):
            # FSDP2 shards a tensor TP already cut with _StridedShard, which is not a Shard
            if not isinstance(placement, DShard) and type(placement).__name__ != "_StridedShard":
                continue
            if i < len(names) and self.ours.get(names[i], names[i]) == "ep":
                self.split.add("ep")
            self.split |= self.dims_of(mesh, i)

    def modules(self, modules: list[nn.Module]) -> None:
        """Note every parameter and buffer of ``modules``: DTensor placements and declared ones."""
        for root in modules:
            for name, p in root.named_parameters():
                self.tensor(p)
                if not isinstance(p, DTensor):
                    self.split |= set(declared_placements(name, self.case.placements, self.degrees))
            for b in root.buffers():
                self.tensor(b)

    @contextlib.contextmanager
    def watching(self):
        """While a dim is unsplit, note the DTensor outputs of every module call in the block, until
        :meth:`close` (an activation sharded over tp while the weights stay whole: sequence
        parallelism, a prepared input); in a bf16 or fp16 cell, whether any output was in its dtype."""
        def hook(module, args, output):
            for t in _tensors(output, "output").values():
                self.tensor(t)
                if self.low is not None and t.dtype == self.low:
                    self.computed_low = True

        if self.missing() or self.low is not None:
            self._hook = nn.modules.module.register_module_forward_hook(hook)
        try:
            yield
        finally:
            self.close()

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def missing(self) -> list[str]:
        """The dims of degree above 1 (and the expert mesh) this rank found nothing split over."""
        dims = [d for d in DENSE if self.degrees.get(d, 1) > 1] + (["ep"] if self.degrees.get("ep", 1) > 1 else [])
        return [d for d in dims if d not in self.split]


def line(missing: list[str], degrees: dict[str, int], impl: str) -> str:
    """The one line of a cell that split nothing over ``missing``: the dims, what the function did,
    and how to declare the meshes it supports."""
    what = {"pp": "returned a module, not a Pipelined: every pp rank ran the whole model",
            "tp": "left every parameter, buffer and activation whole over tp",
            "ep": "never used the expert mesh (meshes.sparse, mesh('ep')) nor sharded over ep"}
    head = ", ".join(f"{d}={degrees[d]}" for d in missing)
    said = "; it ".join(what[d] for d in missing)
    return (f"{head} split nothing: parallelize {impl!r} {said}; declare its meshes: "
            f"ModelCase(supports={{{impl!r}: fn(spec) -> reason or None}})")


def ran_fp32_line(dtype: str, impl: str) -> str:
    """The one line of a bf16 or fp16 cell that computed nothing in its dtype."""
    return (f"{dtype} ran in fp32: no module of parallelize {impl!r} computed in {dtype} on any rank; with "
            "ModelCase(mixed_precision='params') parallelize sets the precision (FSDP2's "
            "MixedPrecisionPolicy(param_dtype=running().dtype), on every mesh it runs) and here it set none; or "
            "declare mixed_precision='autocast' or 'bf16', which the harness applies")


def agree(notes: Notes, impl: str) -> None:
    """Share every rank's notes over the cell's world (a collective: every rank calls it) and raise
    on every rank :class:`SplitNothing` when a dim was split by none of them, :class:`RanFp32` when
    none computed in a bf16 or fp16 cell's dtype."""
    notes.close()
    # the same on every rank: the batch dims are split by the harness itself
    if not any(notes.degrees.get(d, 1) > 1 for d in ("pp", "tp", "ep")) and notes.low is None:
        return
    mine = (notes.missing(), notes.computed_low)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    missing = [d for d in mine[0] if all(d in theirs for theirs, _ in every)]
    if missing:
        raise SplitNothing(line(missing, notes.degrees, impl))
    if notes.low is not None and not any(computed for _, computed in every):
        raise RanFp32(ran_fp32_line(notes.dtype, impl))


def degrees_of(spec) -> dict[str, int]:
    """The dense dims' degrees and the expert mesh's ``ep`` and ``etp`` of a cell's :class:`MeshSpec`."""
    return {d: getattr(spec, d) for d in DENSE} | {"ep": spec.ep, "etp": spec.etp}

