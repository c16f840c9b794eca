"""A rank's tensors as :class:`harness.layout.Piece` objects, placed on the cell's mesh.

* a DTensor: its placements on its mesh, on the cell's dims (a flattened dim such as ``fsdp`` =
  dp·cp is the one of its dims with a degree above 1; FSDP2's strided shard under TP, dp's cut of
  each tp shard, is ``Shard(within="tp")``). The local shard itself goes back, so a wrong shard is
  reported with the ranks that hold it. Placements a Piece cannot describe (``Partial``, a strided
  shard of an uneven split, a flattened dim over two non-trivial dims, the expert mesh) fall back to
  ``full_tensor()``, a replica on every rank: a collective for each such tensor;
* a plain parameter: the placements the case declares for its name (``ModelCase.placements``),
  else a replica (the parent checks that every rank holds the same values);
* a plain activation (events only): this rank's rows of the batch and, on a dim short of the
  logical shape by a factor tp, a tensor-parallel shard.

:func:`piece_of` decides from placements and shapes alone, never from a rank's own data, so every
rank of a mesh takes the same path and the fallback's collective is entered by all of them.
"""
from __future__ import annotations

import fnmatch
import math

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor.placement_types import _StridedShard

from ..layout import Piece, Shard
from ..names import DENSE, FLATTENED


def _cell_dims(name: str, degrees: dict[str, int]) -> list[str] | None:
    """The cell-mesh dims of degree above 1 that a mesh dim named ``name`` spans; None: unknown.
    ``etp`` (the ranks each expert's weights are split over) is 1 or tp, over tp's own ranks: it spans
    tp where ``degrees`` give it above 1, nothing where 1 or not given."""
    if name == "etp":
        return ["tp"] if degrees.get("etp", 1) > 1 else []
    dims = FLATTENED.get(name, (name,))
    if any(d not in DENSE for d in dims):
        return None
    return [d for d in dims if degrees.get(d, 1) > 1]


def _cut_within(names, placements, at: int, degrees: dict[str, int], shape) -> str | None:
    """The cell dim whose shard the strided shard ``placements[at]`` cuts further (FSDP2 over TP:
    dp's cuts tp's), or None where a Piece would not read it as DTensor does: the tensor dim must be
    sharded by this and by one plain ``Shard`` of a later mesh dim alone, of degree its split factor,
    and split evenly (where torch's strided chunks and nested ``torch.chunk`` cuts agree)."""
    strided = placements[at]
    others = [i for i, p in enumerate(placements) if i != at and isinstance(p, (DShard, _StridedShard))
              and p.dim == strided.dim]
    if shape is None or len(others) != 1 or others[0] < at or type(placements[others[0]]) is not DShard:
        return None
    own, cut = _cell_dims(names[at], degrees), _cell_dims(names[others[0]], degrees)
    if not own or not cut or len(own) > 1 or len(cut) > 1 or degrees[cut[0]] != strided.split_factor:
        return None
    return cut[0] if shape[strided.dim] % (degrees[own[0]] * strided.split_factor) == 0 else None


def placements_of(names, placements, degrees: dict[str, int], shape=None) -> dict[str, Shard] | None:
    """Mesh dim names and placements (torch's, or ``harness.layout.Shard``) -> Piece placements on
    the cell's dims, or None when a Piece cannot describe them. ``shape``: the tensor's (global), for
    FSDP2's strided shards under TP (:func:`_cut_within`)."""
    out: dict[str, Shard] = {}
    last = {}  # tensor dim -> position in the cell's order of the last dim that sharded it
    for at, (name, placement) in enumerate(zip(names, placements)):
        if isinstance(placement, Replicate):
            continue
        own = placement if isinstance(placement, Shard) else None  # a declared one: packs, zigzag, ... kept
        if isinstance(placement, _StridedShard):
            within = _cut_within(list(names), list(placements), at, degrees, shape)
            if within is None:
                return None
            own, placement = Shard(placement.dim, within=within), DShard(placement.dim)
        elif own is not None:
            placement = DShard(own.dim)
        if type(placement) is not DShard:  # Partial, ...
            return None
        dims = _cell_dims(name, degrees)
        if dims is None or len(dims) > 1:
            return None
        if not dims:
            continue
        dim = dims[0]
        if dim in out:
            return None
        position = DENSE.index(dim)
        if last.get(placement.dim, -1) > position:  # nested shards must apply in the cell's order
            return None
        last[placement.dim] = position
        out[dim] = own or Shard(placement.dim)
    return out


def declared_placements(name: str, patterns: dict[str, dict], degrees: dict[str, int]) -> dict[str, Shard]:
    """The placements ``ModelCase.placements`` declares for the plain tensor ``name`` (empty: a replica)."""
    for pattern, by_dim in patterns.items():
        if fnmatch.fnmatchcase(name, pattern):
            found = placements_of(list(by_dim), list(by_dim.values()), degrees)
            if found is None:
                raise ValueError(f"ModelCase.placements[{pattern!r}] = {by_dim}: give Shard(d) or Replicate() "
                                 f"per mesh dim ({', '.join(DENSE)}), e.g. {{'tp': Shard(0)}}")
            return found
    return {}


def dim_names(tensor: DTensor, ours: dict[str, str]) -> tuple[str, ...]:
    """The dims of a DTensor's mesh by the harness's names (``ours``: a case's own name -> ours,
    ``ModelCase.mesh_names``)."""
    return tuple(ours.get(n, n) for n in tensor.device_mesh.mesh_dim_names or ())


def piece_of(tensor: torch.Tensor, degrees: dict[str, int], plain: dict[str, Shard] | None = None,
             *, gather: bool = True, ours: dict[str, str] | None = None) -> Piece | None:
    """``tensor`` as this rank's Piece. ``plain``: the placements of a plain tensor. ``gather``:
    whether an undescribable DTensor may be gathered (a collective); else None is returned.
    ``ours``: the case's own mesh dim names -> the harness's, where they differ."""
    if isinstance(tensor, DTensor):
        placements = placements_of(dim_names(tensor, ours or {}), tensor.placements, degrees, tuple(tensor.shape))
        if placements is None:
            if not gather:
                return None
            return Piece.full(tensor.full_tensor().detach().clone())
        return Piece(tensor.to_local().detach().cpu().clone(), tuple(tensor.shape), placements)
    if not plain:
        return Piece.full(tensor.detach().clone())
    shape = list(tensor.shape)
    for dim, shard in plain.items():  # declared shards are even: the logical size is local x degree
        shape[shard.dim] *= degrees[dim]
    return Piece(tensor.detach().cpu().clone(), tuple(shape), dict(plain))


def in_order(placements: dict[str, Shard]) -> dict[str, Shard]:
    """Placements sorted in the cell mesh's order, the order nested shards of a tensor dim apply in."""
    return dict(sorted(placements.items(), key=lambda item: DENSE.index(item[0])))


def plain_activation(tensor: torch.Tensor, degrees: dict[str, int], batch: dict[str, Shard],
                     logical: tuple[int, ...] | None) -> Piece | None:
    """A plain activation's piece: this rank's rows of the batch, and, on a dim still short of the
    logical shape by a factor tp, a tensor-parallel shard (a colwise layer's local output, a
    sequence-parallel region); None when the shape says neither."""
    if logical is None or len(logical) != tensor.dim():
        return None
    placements = {d: s for d, s in batch.items() if s.dim < tensor.dim()}
    for d in range(tensor.dim()):
        held = tensor.shape[d] * math.prod(degrees[n] for n, s in placements.items() if s.dim == d)
        if held == logical[d]:
            continue
        if held * degrees.get("tp", 1) != logical[d] or "tp" in placements:
            return None
        placements["tp"] = Shard(d)
    return Piece(tensor.detach().cpu().clone(), tuple(logical), in_order(placements))


def activation(tensor: torch.Tensor, degrees: dict[str, int], batch: dict[str, Shard],
               logical: tuple[int, ...] | None = None, ours: dict[str, str] | None = None,
               plain: bool = True) -> Piece | None:
    """An activation's piece: its DTensor placements (if any) plus the batch dims its mesh does not
    name (a tensor-parallel activation is still this rank's rows of the batch); a plain tensor's by
    its shape (:func:`plain_activation`) unless ``plain`` is False (None: not judged)."""
    if not isinstance(tensor, DTensor):
        return plain_activation(tensor, degrees, batch, logical) if plain else None
    piece = piece_of(tensor, degrees, gather=False, ours=ours)
    if piece is None:
        return None
    named = set(dim_names(tensor, ours or {}))
    shape = list(piece.shape)
    for dim, shard in batch.items():
        if dim not in named and dim not in piece.placements:
            piece.placements[dim] = shard
            shape[shard.dim] *= degrees[dim]
    piece.shape = tuple(shape)
    piece.placements = in_order(piece.placements)
    return piece


def load_shards(module: torch.nn.Module, whole: torch.nn.Module, placements: dict[str, dict],
                global_name=None) -> None:
    """Copy ``whole``'s parameters and buffers into ``module``'s by name, as a trainer loads a
    checkpoint: the seeded start, loaded into a model its framework built already sharded
    (Megatron-Core's, under its ``parallel_state``) or parallelized before it was materialised
    (torchtitan's order: on meta, ``parallelize_fn``, ``to_empty``, ``init_weights``). A DTensor gets
    its shard of the whole tensor by its own placements; a plain tensor this rank's piece as
    ``placements`` declare it (the case's ``ModelCase.placements``; a replica where none is). Call it
    from ``parallelize`` with the model it was given. ``global_name``: as
    :class:`harness.model.Parallelized`'s. A piece whose shape is not the one ``module`` holds
    raises, naming the tensor and both shapes."""
    from torch.distributed.tensor import distribute_tensor

    from ..layout import MeshLayout, take
    from .cell import running

    cell = running()
    layout = MeshLayout.of(tuple(cell.mesh.items()))
    degrees = cell.mesh | {"etp": int(cell.switches.get("etp", 1))}  # the cell's dims, and what etp declares
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    sources = dict(whole.named_parameters(remove_duplicate=False)) | dict(whole.named_buffers())
    buffers = dict(module.named_buffers())
    with torch.no_grad():
        for local, tensor in [*module.named_parameters(remove_duplicate=False), *buffers.items()]:
            name = global_name(local) if global_name else local
            if name not in sources:
                if local in buffers:
                    continue  # a buffer of the sharded build alone (its own bookkeeping)
                raise KeyError(f"load_shards: {local!r}" + (f" ({name!r})" if name != local else "")
                               + " is no parameter of the whole model: the two must name their parameters alike")
            piece = sources[name].detach().to(tensor.device)
            if isinstance(tensor, DTensor):  # every rank holds the whole: each cuts its own shard
                piece = distribute_tensor(piece, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
                tensor = tensor.to_local()
            else:
                for dim, shard in in_order(declared_placements(name, placements, degrees)).items():
                    piece = take(piece, shard, degrees[dim], layout.coord(rank, dim))
            if piece.shape != tensor.shape:
                raise ValueError(f"load_shards: {name} is {tuple(sources[name].shape)} whole and this rank's piece "
                                 f"as ModelCase.placements declare it is {tuple(piece.shape)}, but the sharded "
                                 f"model holds {tuple(tensor.shape)}: declare where its pieces sit")
            tensor.copy_(piece)
