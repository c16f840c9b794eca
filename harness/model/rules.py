"""The rules of a model cell, checked before any rank runs, and the meshes its ranks build.

A cell's mesh names the dense dims of :mod:`harness.meshes` by short names, slowest first:
``pp``, ``rep`` (rep), ``dp`` (dp), ``cp``, ``tp``; the switches ``ep`` and ``etp``
cut the sparse (expert) mesh from the same ranks. The ranks build the full
:class:`harness.meshes.Meshes` of that spec (dense, sparse, flattened batch/loss/fsdp) and hand it
to ``parallelize``; the cell's own mesh is the dense one, so a rank's coordinates and the pieces it
returns are laid out the same way.
"""
from __future__ import annotations

import math

from ..config import Config, ConfigError
from ..meshes.device_mesh import DENSE, MeshSpec

# cell-mesh short name -> harness.meshes dense dim
LONG = {"pp": "pp", "rep": "rep", "dp": "dp", "cp": "cp", "tp": "tp"}
SHORT = {long: short for short, long in LONG.items()}
ORDER = tuple(LONG)  # the cell mesh's dims, slowest first: nested shards of one tensor dim apply in it
SWITCHES = ("ep", "etp", "reshard")  # reshard_<layout>: harness.model.reshard
# the first dims item of the extra mesh that stands for a whole harness.meshes layout
MARKER = "harness.meshes"


def spec(cfg: Config) -> MeshSpec:
    """The :class:`MeshSpec` of a model cell (raises :class:`ConfigError` naming the broken rule)."""
    names = [name for name, _ in cfg.mesh]
    unknown = [n for n in names if n not in LONG]
    if unknown:
        raise ConfigError(f"{cfg.id}: mesh dim {unknown[0]!r} is not a model mesh dim: name them "
                          f"{', '.join(LONG)} (pp, rep, dp, cp, tp), e.g. dp=2,tp=2")
    order = [n for n in LONG if n in names]
    if names != order:
        raise ConfigError(f"{cfg.id}: mesh dims {','.join(names)} are out of order: write them as "
                          f"{','.join(order)} (slowest first, as harness.meshes lays them out)")
    extra = sorted(k for k, _ in cfg.switches if k not in SWITCHES)
    if extra:
        raise ConfigError(f"{cfg.id}: switch {extra[0]!r} is not a model switch; model switches are "
                          f"{', '.join(SWITCHES)} (the expert mesh)")
    sparse = {}
    for key, value in cfg.switches:
        if key == "reshard":
            continue
        if not value.isdigit():
            raise ConfigError(f"{cfg.id}: switch {key}_{value} must be a degree, e.g. {key}_2")
        sparse[key] = int(value)
    return MeshSpec.of(cfg.world, **{LONG[n]: d for n, d in cfg.mesh}, **sparse)


def meshes(cfg: Config) -> list[tuple[tuple[str, int], ...]]:
    """The extra mesh the ranks build: the marker, then the dense degrees (whose product is the
    world, so the pool sizes itself as for any mesh); ``harness.pool.rank.build_meshes`` turns it
    into a :class:`harness.meshes.Meshes`."""
    s = spec(cfg)
    own = [((f"{MARKER} ep={s.ep} etp={s.etp}", 1),) + tuple((n, getattr(s, n)) for n in DENSE)]
    if "reshard" in dict(cfg.switches):
        from .reshard import meshes as reshard_meshes

        return own + reshard_meshes(cfg)
    return own


def from_marker(dims) -> MeshSpec | None:
    """The spec an extra mesh's dims stand for, or None when they are an ordinary mesh."""
    first = dims[0][0] if dims else ""
    if not first.startswith(MARKER + " "):
        return None
    sparse = dict(item.split("=") for item in first[len(MARKER) + 1:].split())
    degrees = dict(dims[1:])
    return MeshSpec.of(math.prod(degrees.values()), **degrees, **{k: int(v) for k, v in sparse.items()})


def check(case, cfg: Config) -> None:
    """Every rule of a model cell: mesh names and order, the mesh spec's own rules, steps, cp needs a
    sequence dim, and the global batch divides over the data ranks."""
    s = spec(cfg)
    if [k for k, _ in cfg.sizes] != ["steps"]:
        raise ConfigError(f"{cfg.id}: a model cell has one size, steps<N> (optimizer steps), e.g. steps3")
    if s.cp > 1 and case.seq_dim is None:
        raise ConfigError(f"{cfg.id}: cp={s.cp} splits the sequence, but the case declares no seq_dim: "
                          "set ModelCase(seq_dim=...) or drop cp from the mesh")
    from .batches import global_batch

    batch = global_batch(case, 0)
    rows = s.rep * s.dp
    for name, tensor in batch.items():
        if tensor.dim() == 0 or tensor.shape[0] % rows:
            raise ConfigError(f"{cfg.id}: batch[{name!r}] of shape {tuple(tensor.shape)} does not split on dim 0 "
                              f"over the {rows} data-parallel ranks (rep·dp): make the global batch a multiple of {rows}")
        if s.cp > 1 and tensor.shape[case.seq_dim] % s.cp:
            raise ConfigError(f"{cfg.id}: batch[{name!r}] of shape {tuple(tensor.shape)} does not split on its "
                              f"sequence dim {case.seq_dim} over cp={s.cp}: choose a sequence length that cp divides")


def check_impl(case, cfg: Config) -> None:
    """The meshes ``cfg.impl`` declares it supports (``ModelCase.supports``)."""
    supports = case.supports.get(cfg.impl)
    reason = supports(spec(cfg)) if supports else None
    if reason:
        raise ConfigError(f"{cfg.id}: implementation {cfg.impl!r} does not support this mesh: {reason}")
