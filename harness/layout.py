"""Where each rank's local piece sits in the logical (full) tensor.

Two pure-Python/plain-torch models live here, used on both sides of the pool:

* :class:`MeshLayout`: named mesh dims laid out row-major over ranks ``0..world-1`` (the same
  convention as ``DeviceMesh(torch.arange(world).view(shape))``): rank <-> coordinates and each
  dim's groups. ``tests/test_mesh.py`` checks real ``DeviceMesh`` groups against it.
* placements (:class:`Shard`, replicate when a mesh dim is not named) and :class:`Piece`, the local
  tensor a rank returns, which :func:`assemble` turns back into the logical tensor.

Sharding follows ``torch.chunk`` semantics (ceil-sized chunks, trailing ranks may get fewer or none),
which is also what DTensor does for uneven shards.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

# torch is imported by the functions that handle tensors, not with the module: the registry reads
# mesh declarations here in every pytest run, most of which (``--help``, a usage error, a project's
# other tests) never touch a tensor


@dataclass(frozen=True)
class MeshLayout:
    """Row-major layout of named mesh dims over ranks ``0..world-1``."""

    names: tuple[str, ...]
    shape: tuple[int, ...]

    @classmethod
    def of(cls, mesh: tuple[tuple[str, int], ...]) -> "MeshLayout":
        return cls(tuple(n for n, _ in mesh), tuple(d for _, d in mesh))

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    @property
    def dims(self) -> tuple[tuple[str, int], ...]:
        """The mesh as ``(("dp", 2), ("tp", 4))``, the form configs use."""
        return tuple(zip(self.names, self.shape))

    @property
    def id(self) -> str:
        """The mesh as a cell id writes it: ``"dp=2,tp=4"``."""
        return ",".join(f"{n}={d}" for n, d in self.dims)

    def build(self, device_type: str, world: int) -> "torch.distributed.device_mesh.DeviceMesh":
        """Its ``DeviceMesh`` over the first ranks of a world of ``world`` (collective: every rank of
        the default group calls it, those outside the mesh included)."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh(device_type, torch.arange(self.world).view(self.shape), mesh_dim_names=self.names)

    def coords(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world} ranks")
        out = []
        for degree in reversed(self.shape):
            out.append(rank % degree)
            rank //= degree
        return tuple(reversed(out))

    def rank_of(self, coords: tuple[int, ...]) -> int:
        rank = 0
        for c, degree in zip(coords, self.shape):
            rank = rank * degree + c
        return rank

    def coord(self, rank: int, name: str) -> int:
        return self.coords(rank)[self.names.index(name)]

    def groups(self, name: str) -> list[list[int]]:
        """Ranks that vary only along ``name``, one list per fixed setting of the other dims."""
        axis = self.names.index(name)
        others = [range(d) for i, d in enumerate(self.shape) if i != axis]
        groups = []
        for fixed in itertools.product(*others):
            group = []
            for c in range(self.shape[axis]):
                coords = list(fixed)
                coords.insert(axis, c)
                group.append(self.rank_of(tuple(coords)))
            groups.append(group)
        return groups

    def flat_groups(self, names: tuple[str, ...]) -> list[list[int]]:
        """Ranks that vary only along the dims ``names`` together (one group per fixed setting of the
        others), listed row-major over ``names`` in mesh order: what ``DeviceMesh[names]._flatten()`` gives."""
        for name in names:
            if name not in self.names:
                raise ValueError(f"{name!r} is not a dim of the mesh {self.dims}")
        axes = sorted(self.names.index(n) for n in names)
        others = [i for i in range(len(self.shape)) if i not in axes]
        groups = []
        for fixed in itertools.product(*(range(self.shape[i]) for i in others)):
            group = []
            for inner in itertools.product(*(range(self.shape[i]) for i in axes)):
                coords = [0] * len(self.shape)
                for i, c in zip(others, fixed):
                    coords[i] = c
                for i, c in zip(axes, inner):
                    coords[i] = c
                group.append(self.rank_of(tuple(coords)))
            groups.append(group)
        return groups

    @classmethod
    def from_order(cls, order: str, degrees: dict[str, int]) -> "MeshLayout":
        """The layout a fastest-first order string describes (Megatron-Core's ``"tp-cp-ep-dp-pp"``:
        ``tp`` varies fastest over consecutive ranks), as a row-major layout, slowest dim first."""
        names = tuple(reversed(order.split("-")))
        return cls(names, tuple(int(degrees.get(n, 1)) for n in names))


class MeshDeclaration(Protocol):
    """A mesh a task's ranks build: a :class:`MeshLayout` (one ``DeviceMesh``) or a
    :class:`harness.meshes.MeshSpec` (a model's dense, sparse and flattened meshes). The pool, torchrun
    and the ranks take every mesh as one, and never ask which."""

    @property
    def world(self) -> int:
        """How many ranks it spans."""

    @property
    def id(self) -> str:
        """How a message names it."""

    def build(self, device_type: str, world: int) -> Any:
        """What a rank holds of it, in a world of ``world`` ranks (collective over that world)."""


def declared(mesh) -> MeshDeclaration:
    """``mesh`` as a :class:`MeshDeclaration`: a dims tuple (``(("w", 4),)``) as its
    :class:`MeshLayout`; a layout or a ``MeshSpec`` as it is. Anything else raises a ``TypeError``
    saying what a mesh may be."""
    if isinstance(getattr(mesh, "world", None), int) and callable(getattr(mesh, "build", None)):
        return mesh
    try:
        dims = tuple((str(name), int(degree)) for name, degree in mesh)
    except (TypeError, ValueError):
        dims = None
    if not dims or any(degree < 1 for _, degree in dims):
        raise TypeError(f"{mesh!r} is not a mesh: declare a mesh as its dims, ((name, degree), ...) such as "
                        "(('w', 4),), or as a harness.meshes.MeshSpec")
    return MeshLayout.of(dims)


@dataclass(frozen=True)
class Shard:
    """Tensor dim ``dim`` is split across a mesh dim.

    ``packs``: the dim is ``packs`` equal blocks (packed gate/up weights); each block is chunked and
    a rank holds its chunk of every block, concatenated. ``zigzag``: the dim is cut in ``2n`` chunks
    and coordinate ``c`` holds chunks ``c`` and ``2n-1-c`` (load-balanced causal attention).
    ``inner``: the mesh dim is read as (outer x inner), row-major, and only its inner factor splits
    the tensor: coordinate ``c`` holds chunk ``c % inner`` of ``inner``, replicated over ``c // inner``
    (a sparse dim borrowed from a dense one, e.g. experts over ep=2 inside dp=4 in dp2ep).
    ``on``: the coordinates (negative counts from the end) that each hold the whole dim, as replicas;
    the others hold none of it (a pipeline's embedding on the first stage, its head on the last).
    ``within``: the mesh dim whose shard of the same tensor dim this one cuts further, applied after
    it whatever the mesh's order (FSDP2 over TP: dp's shard cuts each tp shard, torch's
    ``_StridedShard``); nested shards otherwise apply in mesh order.
    """

    dim: int
    packs: int = 1
    zigzag: bool = False
    inner: int = 0
    on: tuple[int, ...] = ()
    within: str = ""


def chunk_bounds(size: int, n: int, i: int) -> tuple[int, int]:
    """Start and end of chunk ``i`` of ``n`` over ``size`` items, as ``torch.chunk`` cuts it."""
    step = -(-size // n)
    return min(i * step, size), min((i + 1) * step, size)


def shard_indices(index: torch.Tensor, shard: Shard, n: int, c: int) -> torch.Tensor:
    """The entries of a 1-D index vector that coordinate ``c`` of ``n`` holds under ``shard``."""
    import torch

    if shard.on:
        return index if c in {k % n for k in shard.on} else index[:0]
    if shard.inner:
        if n % shard.inner:
            raise ValueError(f"inner factor {shard.inner} does not divide a mesh dim of {n}")
        n, c = shard.inner, c % shard.inner
    if shard.zigzag:
        parts = [index[slice(*chunk_bounds(len(index), 2 * n, k))] for k in (c, 2 * n - 1 - c)]
        return torch.cat(parts)
    if len(index) % shard.packs:
        raise ValueError(f"dim of {len(index)} does not split into {shard.packs} packed blocks")
    blocks = index.view(shard.packs, -1)
    lo, hi = chunk_bounds(blocks.shape[1], n, c)
    return blocks[:, lo:hi].reshape(-1)


@dataclass
class Piece:
    """A rank's local part of a logical tensor of ``shape``, placed by mesh-dim name.

    Mesh dims absent from ``placements`` are replicated: every coordinate along them holds the same
    values, and :func:`assemble` checks that they do.
    """

    tensor: torch.Tensor
    shape: tuple[int, ...]
    placements: dict[str, Shard] = field(default_factory=dict)

    @classmethod
    def full(cls, tensor: torch.Tensor) -> "Piece":
        return cls(tensor.detach().cpu(), tuple(tensor.shape))

    @classmethod
    def sharded(cls, tensor: torch.Tensor, shape, **placements: Shard) -> "Piece":
        return cls(tensor.detach().cpu(), tuple(shape), dict(placements))


def grid(index: list[torch.Tensor]) -> tuple:
    """Indexing key for the cross product of per-dim indices (``()`` for a 0-dim tensor): slices
    when every dim's indices are a run of consecutive ones (a replica, a ``torch.chunk`` shard: a
    view, no index tensors), else the advanced-indexing grid."""
    import torch

    runs = [_run(i) for i in index]
    if None not in runs:
        return tuple(runs)
    return torch.meshgrid(*index, indexing="ij") if index else ()


def _run(index: torch.Tensor) -> slice | None:
    """``index`` as a slice when it counts up by one from its first entry (empty included), else None."""
    n = len(index)
    if n == 0:
        return slice(0, 0)
    first = int(index[0])
    if int(index[-1]) - first != n - 1 or (n > 2 and not bool((index[1:] - index[:-1] == 1).all())):
        return None
    return slice(first, first + n)


def piece_index(piece: Piece, layout: MeshLayout, rank: int) -> list[torch.Tensor]:
    """Per tensor dim, the logical indices that ``rank``'s piece covers (nested shards apply in mesh
    order, but for one cut ``within`` another's)."""
    return list(_placed(piece.shape, tuple(piece.placements.items()), layout, rank)[0])


@functools.lru_cache(maxsize=4096)
def _placed(shape: tuple[int, ...], placements: tuple, layout: MeshLayout, rank: int) -> tuple[tuple, tuple]:
    """:func:`piece_index` and its :func:`grid` key, kept: a cell's gradients of every step, parameters
    and optimizer states share a few shapes and placements. Read only, never written to."""
    import torch

    index = [torch.arange(s) for s in shape]
    given = dict(placements)
    order = list(zip(layout.names, layout.shape, layout.coords(rank)))
    for name, shard in given.items():  # a shard cut within another dim's applies right after that one
        if shard.within:
            if shard.within not in layout.names or name not in layout.names:
                raise ValueError(f"Shard(within={shard.within!r}) on {name}: both must be dims of {layout.id}")
            entry = next(e for e in order if e[0] == name)
            order.remove(entry)
            order.insert(next(i for i, e in enumerate(order) if e[0] == shard.within) + 1, entry)
    for name, n, c in order:
        shard = given.get(name)
        if shard is not None:
            index[shard.dim] = shard_indices(index[shard.dim], shard, n, c)
    return tuple(index), grid(index)


class AssemblyError(ValueError):
    """Pieces that cannot form a logical tensor: wrong shape, missing, or disagreeing replicas."""


@dataclass
class Assembled:
    tensor: torch.Tensor
    # rank -> logical indices it holds, for per-shard comparison
    index: dict[int, list[torch.Tensor]]
    # worst |difference| between replicas of the same element (0.0 when replicas are bitwise equal)
    replica_gap: float
    replica_gap_ranks: tuple[int, int] | None


def assemble(name: str, pieces: dict[int, Piece], layout: MeshLayout, *, every_rank: bool = True) -> Assembled:
    """Rebuild the logical tensor ``name`` from every rank's piece and check replicas agree.

    ``every_rank=False``: only some ranks hold pieces (a pipeline stage's activations, an expert's
    tokens); together they must still cover the whole tensor."""
    import torch

    missing = [r for r in range(layout.world) if r not in pieces]
    if missing and every_rank:
        raise AssemblyError(f"{name}: ranks {missing} returned no piece")
    lead = min(pieces)
    first = pieces[lead]
    out = torch.zeros(first.shape, dtype=first.tensor.dtype)
    owner = torch.full(first.shape, -1, dtype=torch.int32)
    gap, gap_ranks, index_of = 0.0, None, {}
    for rank in sorted(pieces):
        piece = pieces[rank]
        if piece.shape != first.shape or piece.placements != first.placements:
            raise AssemblyError(
                f"{name}: rank {rank} reports shape {piece.shape} {piece.placements}, "
                f"rank {lead} reports {first.shape} {first.placements}"
            )
        index, key = _placed(piece.shape, tuple(piece.placements.items()), layout, rank)
        index = list(index)
        expected = tuple(len(i) for i in index)
        if tuple(piece.tensor.shape) != expected:
            raise AssemblyError(
                f"{name}: rank {rank} holds a piece of shape {tuple(piece.tensor.shape)}, "
                f"its placements {piece.placements} of {piece.shape} call for {expected}"
            )
        index_of[rank] = index
        held = owner[key]
        seen = held >= 0
        # replicas that agree bitwise, the common case, leave the gap as it is without measuring it
        if seen.any() and not (seen.all() and torch.equal(out[key], piece.tensor)):
            d = (out[key][seen].double() - piece.tensor[seen].double()).abs()
            d = d.nan_to_num(nan=math.inf)
            worst = float(d.max()) if d.numel() else 0.0
            if worst > gap:
                gap, gap_ranks = worst, (int(held[seen].flatten()[int(d.argmax())]), rank)
        out[key] = piece.tensor
        owner[key] = rank
    if (owner < 0).any():
        raise AssemblyError(f"{name}: {int((owner < 0).sum())} elements are held by no rank")
    return Assembled(out, index_of, gap, gap_ranks)


def summed_over(pieces: dict[int, Piece], layout: MeshLayout, name: str, op: str = "sum") -> dict[int, Piece]:
    """What ``pieces`` hold if each is a partial sum over mesh dim ``name`` (a ``Partial()`` that was
    never reduced): every group of ``name`` summed (in fp64, then the pieces' dtype), held by its first
    rank; ``op="mean"``: averaged, what a data-parallel gradient reduction makes of per-rank gradients.
    A group that lacks a rank's piece, or whose pieces differ in shape or placements, gives none."""
    import torch

    out = {}
    for group in layout.groups(name):
        held = [pieces.get(r) for r in group]
        if None in held or len({(tuple(h.tensor.shape), h.shape, tuple(sorted(h.placements.items()))) for h in held}) != 1:
            continue
        stacked = torch.stack([h.tensor.double() for h in held])
        total = (stacked.mean(0) if op == "mean" else stacked.sum(0)).to(held[0].tensor.dtype)
        out[group[0]] = Piece(total, held[0].shape, dict(held[0].placements))
    return out


def take(tensor: torch.Tensor, shard: Shard | None, n: int, c: int) -> torch.Tensor:
    """Coordinate ``c`` of ``n``'s part of a full tensor (a copy of it when ``shard`` is None)."""
    import torch

    if shard is None or n == 1:
        return tensor.clone()
    index = shard_indices(torch.arange(tensor.shape[shard.dim]), shard, n, c)
    return tensor.index_select(shard.dim, index)


def empty_chunk_rule(size: int, n: int) -> bool:
    """True when ``torch.chunk`` gives every one of ``n`` coordinates a non-empty chunk of ``size``."""
    return n <= size and chunk_bounds(size, n, n - 1)[1] > chunk_bounds(size, n, n - 1)[0]
