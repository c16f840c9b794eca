"""Dense and sparse device meshes from one world, and the named groups a trainer uses.

A trainer runs attention and dense layers on a *dense* mesh and experts on a *sparse* one, both over
the same ranks; data loading, loss reduction and FSDP sharding use groups flattened from several dims.
Hand-written rank maps for these are a classic source of silent bugs, so here they come from one
world mesh cut by ``DeviceMesh._unflatten`` and merged by ``DeviceMesh._flatten`` (the torchtitan
way), and :class:`MeshSpec` is the pure-Python model of the same layouts that the checks hold the
real groups to (``cases/test_meshes.py`` with real ranks, ``tests/test_meshes_fake.py`` at scale).

Dims, slowest-varying first (row-major over ranks, as ``DeviceMesh`` lays them out):

* dense:  ``pp, rep, dp, cp, tp``
* sparse: ``pp, rep, efsdp, ep, etp``; the expert block ``efsdp·ep·etp`` is the dense
  ``dp·cp·tp`` block cut differently. ``etp`` is ``tp`` (experts reuse the dense tp ranks; ep
  borrows from ``dp·cp``) or 1 (ep borrows from ``dp·cp·tp``); ``efsdp`` is what is left.
* flattened (dense): ``batch = rep·dp`` (ranks that read different data),
  ``loss = batch·cp`` (ranks a token-mean loss is reduced over), ``fsdp = dp·cp`` (ranks that
  shard parameters).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields

from ..config import ConfigError
from ..layout import MeshLayout
from ..names import DEGREES, DENSE, FLATTENED, GROUPS, SPARSE, unknown_dim
from ..world import harness_mesh


@dataclass(frozen=True)
class MeshSpec:
    """One world's degrees; the pure-Python model of every named group built from them.

    Build one with :meth:`of` (or :meth:`parse`), which checks the rules; the direct constructor
    does not.
    """

    world: int
    pp: int = 1
    rep: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    etp: int = 1

    @classmethod
    def of(cls, world: int, **degrees: int) -> "MeshSpec":
        """The spec for ``world`` ranks and ``degrees`` (by name; absent ones are 1), validated."""
        unknown = sorted(set(degrees) - set(DEGREES))
        if unknown:
            raise ConfigError(f"{unknown_dim(unknown[0], DEGREES)}; efsdp is derived: dp·cp·tp / (ep·etp)")
        spec = cls(int(world), **{k: int(v) for k, v in degrees.items()})
        spec.validate()
        return spec

    @classmethod
    def parse(cls, text: str) -> "MeshSpec":
        """``"world=8,dp=2,tp=2,ep=2"``: the form test ids and notes use."""
        items = dict(part.split("=", 1) for part in text.split(",") if part)
        if "world" not in items:
            raise ConfigError(f"mesh spec {text!r} has no world=N: start it with the world size, e.g. world=8,tp=2")
        world = items.pop("world")
        return cls.of(int(world), **{k: int(v) for k, v in items.items()})

    @classmethod
    def from_mesh(cls, mesh, **sparse: int) -> "MeshSpec":
        """The spec of a config's mesh (``(("dp", 2), ("tp", 4))``: dims named as here, world their
        product) and the sparse degrees ``ep``/``etp`` given apart."""
        dims = dict(mesh)
        unknown = sorted(set(dims) - set(DENSE))
        if unknown:
            raise ConfigError(f"{unknown_dim(unknown[0], DENSE)}, in the layout {tuple(mesh)}")
        return cls.of(math.prod(dims.values()), **dims, **sparse)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the broken rule and the fix."""
        for name in ("world", *DEGREES):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1: a degree of 1 turns the dim off")
        dense = math.prod(getattr(self, n) for n in DENSE)
        if dense != self.world:
            shown = "·".join(str(getattr(self, n)) for n in DENSE)
            raise ConfigError(
                f"degrees pp·rep·dp·cp·tp = {shown} = {dense} do not multiply to the world "
                f"of {self.world} ranks: change a degree (dp usually) so that the product is {self.world}"
            )
        if self.etp not in (1, self.tp):
            raise ConfigError(
                f"etp={self.etp} must be 1 or tp={self.tp}: experts either reuse the dense tp ranks (etp=tp) "
                "or are not tensor-parallel (etp=1)"
            )
        lender, size = self.lender()
        if size % self.ep:
            raise ConfigError(
                f"ep={self.ep} does not divide {'·'.join(lender)} = {size}, the dims it borrows from "
                f"when etp={self.etp}: choose an ep that divides {size}"
                + (", or etp=1 to borrow tp as well" if self.etp > 1 else "")
            )

    def lender(self) -> tuple[tuple[str, ...], int]:
        """The dense dims ep borrows its ranks from, and their product."""
        dims = ("dp", "cp") if self.etp == self.tp else ("dp", "cp", "tp")
        return dims, math.prod(getattr(self, d) for d in dims)

    @property
    def efsdp(self) -> int:
        return self.dp * self.cp * self.tp // (self.ep * self.etp)

    @property
    def id(self) -> str:
        """``world=8,dp=2,tp=2,ep=2``: the degrees that differ from 1."""
        parts = [f"world={self.world}"] + [f"{n}={getattr(self, n)}" for n in DEGREES if getattr(self, n) != 1]
        return ",".join(parts)

    def degrees(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "world"}

    def build(self, device_type: str, world: int) -> "Meshes":
        """Its :class:`Meshes` on this rank of a world of ``world`` ranks, laid as side-by-side copies
        over the whole world (a rank beyond the cell's holds a copy and stays idle); collective over
        that world. The :class:`harness.layout.MeshDeclaration` a task's ranks build."""
        if world % self.world:
            raise ConfigError(f"a model cell's mesh of {self.world} ranks does not tile the {world} ranks there are: "
                              f"run model cells with a number of ranks that {self.world} divides (--pool-size)")
        return build(self, device_type, copies=world // self.world)

    # ---- the model ----------------------------------------------------------------------------
    def dense(self) -> MeshLayout:
        return MeshLayout(DENSE, tuple(getattr(self, n) for n in DENSE))

    def sparse(self) -> MeshLayout:
        return MeshLayout(SPARSE, (self.pp, self.rep, self.efsdp, self.ep, self.etp))

    def groups(self, name: str) -> list[list[int]]:
        """Every group of the named group ``name``, as lists of global ranks."""
        return [list(g) for g in _model_groups(self, name)[0]]

    def group_of(self, rank: int, name: str) -> list[int]:
        """The ranks of ``rank``'s group ``name``."""
        groups, index = _model_groups(self, name)
        return list(groups[index[rank]])

    def coords(self, rank: int) -> dict[str, tuple[int, ...]]:
        """``rank``'s coordinates on the dense and the sparse mesh."""
        return {"dense": self.dense().coords(rank), "sparse": self.sparse().coords(rank)}


@functools.lru_cache(maxsize=64)
def _model_groups(spec: MeshSpec, name: str) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """The model's groups of ``name`` and, per rank, which of them holds it (cached: the checks ask
    for every rank of 1024-rank layouts)."""
    if name in DENSE:
        groups = spec.dense().groups(name)
    elif name in FLATTENED:
        groups = spec.dense().flat_groups(FLATTENED[name])
    elif name in SPARSE:
        groups = spec.sparse().groups(name)
    else:
        raise ConfigError(unknown_dim(name, GROUPS))
    index = [0] * spec.world
    for i, group in enumerate(groups):
        for rank in group:
            index[rank] = i
    return tuple(map(tuple, groups)), tuple(index)


# ---- the real meshes ------------------------------------------------------------------------------
@dataclass
class Meshes:
    """The real meshes of one :class:`MeshSpec` on this rank. ``names``: the dims and groups whose
    names differ from the harness's (ours -> shown), for a case that asks for its trainer's
    (``ModelCase.mesh_names``): ``dense``, ``sparse`` and :meth:`mesh` then use those."""

    spec: MeshSpec
    world: "object"  # the 1-D root mesh both are cut from
    dense: "object"
    sparse: "object"
    flat: dict
    names: dict = field(default_factory=dict)

    def mesh(self, name: str):
        """The 1-D mesh of the named group ``name`` (pp and rep from the dense mesh)."""
        ours = self.ours(name)
        shown = self.names.get(ours, ours)
        if ours in FLATTENED:
            return self.flat[ours]
        if ours in DENSE:
            return self.dense[shown]
        if ours in SPARSE:
            return self.sparse[shown]
        raise ConfigError(unknown_dim(name, [self.names.get(n, n) for n in GROUPS]))

    def ours(self, name: str) -> str:
        """The harness's name of the group shown as ``name``."""
        for ours, shown in self.names.items():
            if shown == name:
                return ours
        if name in self.names:  # ours, renamed away: the name may mean another group here
            raise ConfigError(f"mesh dim {name!r} is {self.names[name]!r} on this case's meshes "
                              "(ModelCase.mesh_names)")
        return name

    def renamed(self, names: dict[str, str]) -> "Meshes":
        """The same groups over the same ranks, their dims named ``names`` (ours -> shown;
        :func:`harness.names.mesh_names`). ``dense`` is then a root mesh, as a trainer's own
        ``init_device_mesh`` makes it, so its flattened groups slice from it by name
        (``dense["dp_shard_cp"]``; on one copy of the layout: with copies, use :meth:`mesh`).
        Collective over the world, as :func:`build` is."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        if not names:
            return self
        copies = self.world.size() // self.spec.world
        lead, size = (("copy",), (copies,)) if copies > 1 else ((), ())
        shape = size + tuple(getattr(self.spec, n) for n in DENSE)
        root = harness_mesh(DeviceMesh(self.world.device_type, torch.arange(self.world.size()).view(shape),
                                       mesh_dim_names=lead + tuple(names.get(d, d) for d in DENSE)))
        return _cut(self.spec, root._flatten("world"), names, root)

    def group(self, name: str):
        """This rank's process group for the named group ``name``."""
        return self.mesh(name).get_group()

    def describe(self) -> dict | None:
        """This rank's coordinates and the ranks of each of its named groups, as torch sees them
        (None on a rank outside the world)."""
        import torch.distributed as dist

        if self.dense.get_coordinate() is None:
            return None
        groups = {name: dist.get_process_group_ranks(self.group(self.names.get(name, name))) for name in GROUPS}
        # the sparse mesh's own pp/rep groups, to check they are the dense ones
        groups.update({f"sparse.{n}": dist.get_process_group_ranks(self.sparse.get_group(self.names.get(n, n)))
                       for n in ("pp", "rep")})
        return {"dense": tuple(self.dense.get_coordinate()), "sparse": tuple(self.sparse.get_coordinate()),
                "groups": groups}

    def all_groups(self) -> dict[str, list[list[int]]]:
        """Every group of every named group, as the real meshes enumerate them (the same lists on every
        rank: ``DeviceMesh`` creates them all and keeps the one holding this rank)."""
        from torch.distributed._mesh_layout import _MeshLayout

        out = {}
        for name in GROUPS:
            mesh = self.mesh(self.names.get(name, name))
            # what DeviceMesh._get_all_submeshes and the group creation enumerate, without building a
            # DeviceMesh per group (which costs a second per 1024-rank layout)
            out[name] = _MeshLayout([mesh._layout[0]]).remap_to_tensor(mesh._get_root_mesh()._rank_map).tolist()
        return out

    def full_coords(self) -> dict[str, "object"]:
        """The dense and sparse meshes' full rank tensors (rank -> coordinates for every rank)."""
        return {"dense": self.dense.mesh, "sparse": self.sparse.mesh}


def build(spec: MeshSpec, device_type: str = "cpu", copies: int = 1) -> Meshes:
    """Build both meshes and the flattened groups of ``spec`` over ranks ``0..spec.world-1``.

    Every rank of the default group must call it (each group is a ``new_group`` on every rank), and
    every rank must lie in the meshes (torch cannot slice a mesh on a rank outside it). ``copies``:
    lay ``copies`` side-by-side copies of the layout over ``copies * spec.world`` ranks (a leading
    ``copy`` dim, left out of coordinates), so a smaller layout can be built on a larger world: copy
    ``k`` holds ranks ``k*world ..``, its groups the model's shifted by ``k*world``.
    """
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    spec.validate()
    world = harness_mesh(DeviceMesh(device_type, torch.arange(copies * spec.world), mesh_dim_names=("world",)))
    return _cut(spec, world, {})


def _cut(spec: MeshSpec, world, names: dict[str, str], dense=None) -> Meshes:
    """The dense, sparse and flattened meshes of ``spec`` cut from the 1-D ``world`` (``spec.world``
    ranks, or side-by-side copies of them), each dim and group named ``names.get(ours, ours)``;
    ``dense``: the dense mesh, where it is made already (the root ``world`` is flattened from)."""

    def shown(dims):
        return tuple(names.get(d, d) for d in dims)

    copies = world.size() // spec.world
    lead = ("copy",) if copies > 1 else ()
    size = (copies,) if copies > 1 else ()
    if dense is None:
        dense = world._unflatten(0, size + tuple(getattr(spec, n) for n in DENSE), lead + shown(DENSE))
    flat = {name: dense[shown(dims)]._flatten(names.get(name, name)) for name, dims in FLATTENED.items()}
    sparse = world._unflatten(0, size + (spec.pp, spec.rep, spec.efsdp, spec.ep, spec.etp), lead + shown(SPARSE))
    if copies > 1:  # the meshes of this rank's copy
        dense, sparse = dense[shown(DENSE)], sparse[shown(SPARSE)]
    return Meshes(spec, world, dense, sparse, flat, dict(names))


# ---- pool task ----------------------------------------------------------------------------------
def describe_layouts(ctx, payload: list[str]) -> dict:
    """Pool task: build each layout of ``payload`` (spec ids, worlds dividing the pool's) and report
    this rank's coordinates, named groups and, per group, the sum of ranks an all-reduce over it gives.

    Run it on a mesh covering the whole pool: every pool rank takes part in creating every group; a
    layout of a smaller world is built in ``pool/world`` copies side by side, every rank in one. The
    groups are destroyed after each layout; in a pool rank that keeps the groups shared by rank set
    (harness.pool.groups), whose cache is what stops a long matrix piling up gloo contexts.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    out = {}
    for text in payload:
        spec = MeshSpec.parse(text)
        before = set(_world.pg_map)
        meshes = build(spec, ctx.device.type, copies=ctx.layout.world // spec.world)
        seen = meshes.describe()
        if seen is not None:
            sums = {}
            for name in GROUPS:
                x = torch.tensor([float(ctx.rank)], device=ctx.device)
                dist.all_reduce(x, group=meshes.group(name))
                sums[name] = float(x)
            seen["sums"] = sums
        out[spec.id] = seen
        del meshes
        for pg in [pg for pg in _world.pg_map if pg not in before]:
            dist.destroy_process_group(pg)
    return out


def renamed_groups(ctx, payload: list[str]) -> dict:
    """Pool task: for each layout of ``payload`` (spec ids whose world is the pool's), this rank's
    group of every named group, as :func:`build` makes it and as :meth:`Meshes.renamed` to
    torchtitan's names makes it (by our names): the two must be the same ranks."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    from ..names import TORCHTITAN

    out = {}
    for text in payload:
        spec = MeshSpec.parse(text)
        before = set(_world.pg_map)
        ours = build(spec, ctx.device.type)
        theirs = ours.renamed(TORCHTITAN)
        out[spec.id] = {kind: {name: dist.get_process_group_ranks(meshes.group(meshes.names.get(name, name)))
                               for name in GROUPS} for kind, meshes in (("ours", ours), ("torchtitan", theirs))}
        out[spec.id]["dense"] = list(theirs.dense.mesh_dim_names)
        del ours, theirs
        for pg in [pg for pg in _world.pg_map if pg not in before]:
            dist.destroy_process_group(pg)
    return out
