"""A model cell's plan, decided before any rank runs: its mesh, its rules, and the round trip a
``reshard_<layout>`` cell takes.

A cell's mesh names the dense dims of :mod:`harness.names`, slowest first: ``pp``, ``rep``, ``dp``,
``cp``, ``tp``; the switches ``ep`` and ``etp`` cut the sparse (expert) mesh from the same ranks.
Its :class:`harness.meshes.MeshSpec` is what the ranks build (dense, sparse and flattened meshes)
and hand to ``parallelize``; the cell's own mesh is the dense one, so a rank's coordinates and the
pieces it returns are laid out the same way.

``reshard_<layout>`` (``reshard_dp4``, ``reshard_rep2dp2``, ``reshard_one``; ``...at<N>``): the cell
trains on its own mesh for ``steps - 1`` steps (or ``N``), saves model and optimizer state with
``torch.distributed.checkpoint``, and a fresh model parallelized by the same function on
``<layout>`` (the dims and degrees run together), or left whole on one process (``one``), loads it
and takes the remaining steps. The load layout runs on the first ranks of the cell's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import Config, ConfigError
from ..meshes.device_mesh import MeshSpec
from ..names import DENSE, dim_hint
from ..world import any_world
from .batches import global_batch
from .case import MESH_SWITCHES, ModelCase

ONE = "one"  # reshard_one: the unparallelized model on one process
_LOAD_DIM = re.compile(r"(pp|rep|dp|cp|tp)(\d+)")
_AT = re.compile(r"(.*?)at(\d+)")


def mesh_spec(cfg: Config) -> MeshSpec:
    """The :class:`MeshSpec` of a model cell (raises :class:`ConfigError` naming the broken rule)."""
    names = [name for name, _ in cfg.mesh]
    unknown = [n for n in names if n not in DENSE]
    if unknown:
        raise ConfigError(f"{cfg.id}: mesh dim {unknown[0]!r} is not a model mesh dim: name them "
                          f"{', '.join(DENSE)} (harness.names), e.g. dp=2,tp=2{dim_hint(unknown[0], DENSE)}")
    order = [n for n in DENSE if n in names]
    if names != order:
        raise ConfigError(f"{cfg.id}: mesh dims {','.join(names)} are out of order: write them as "
                          f"{','.join(order)} (slowest first, as harness.meshes lays them out)")
    sparse = {}
    for key, value in cfg.switches:
        if key not in ("ep", "etp"):  # the reshard round trip, or the case's own
            continue
        if not value.isdigit():
            raise ConfigError(f"{cfg.id}: switch {key}_{value} must be a degree, e.g. {key}_2")
        sparse[key] = int(value)
    return MeshSpec.of(cfg.world, **dict(cfg.mesh), **sparse)


@dataclass(frozen=True)
class Reshard:
    """A reshard cell's round trip: save after step ``save_step`` on the cell's mesh, then go on as
    ``load`` (the cell on the load layout, without the switch), or on one process (``load`` None)."""

    save_step: int
    load: Config | None


def reshard_of(cfg: Config) -> Reshard | None:
    """The round trip of a ``reshard_<layout>`` cell; None for other cells."""
    switches = dict(cfg.switches)
    text = switches.pop("reshard", None)
    if text is None:
        return None
    at = _AT.fullmatch(text)
    layout, save = (at.group(1), int(at.group(2))) if at else (text, cfg.size("steps") - 1)
    if layout == ONE:
        return Reshard(save, None)
    dims = _LOAD_DIM.findall(layout)
    if not dims or "".join(n + d for n, d in dims) != layout:
        raise ConfigError(f"{cfg.id}: switch reshard_{layout}: name the load mesh as model dims with their degrees "
                          "run together (reshard_dp4, reshard_rep2dp2, reshard_tp2) or reshard_one")
    return Reshard(save, cfg.replace(mesh=tuple((n, int(d)) for n, d in dims), switches=switches))


def check(case: ModelCase, cfg: Config) -> None:
    """Every rule of a model cell: mesh names and order, the mesh spec's own rules, steps, cp needs a
    sequence dim, the global batch divides over the data ranks; a reshard cell's rules, and the
    model rules again for its load layout."""
    s = mesh_spec(cfg)
    for key, value in cfg.switches:
        if key in MESH_SWITCHES:
            continue
        if key not in case.switches:
            own = ", ".join(case.switches) or "none"
            raise ConfigError(f"{cfg.id}: switch {key!r} is not a model switch; model switches are "
                              f"{', '.join(MESH_SWITCHES)} (the expert mesh, the reshard round trip) and the "
                              f"case's own (ModelCase.switches: {own})")
        if value not in case.switches[key]:
            raise ConfigError(f"{cfg.id}: switch {key}_{value}: the case declares {key} in "
                              f"{', '.join(case.switches[key])}")
    if [k for k, _ in cfg.sizes] != ["steps"]:
        raise ConfigError(f"{cfg.id}: a model cell has one size, steps<N> (optimizer steps), e.g. steps3")
    if s.cp > 1 and case.seq_dim is None:
        raise ConfigError(f"{cfg.id}: cp={s.cp} splits the sequence, but the case declares no seq_dim: "
                          "set ModelCase(seq_dim=...) or drop cp from the mesh")
    rows = s.rep * s.dp
    with any_world():  # the parent's call into the case's code: it may read the world
        first = global_batch(case, 0)
    for name, tensor in first.items():
        if tensor.dim() == 0 or tensor.shape[0] % rows:
            raise ConfigError(f"{cfg.id}: batch[{name!r}] of shape {tuple(tensor.shape)} does not split on dim 0 "
                              f"over the {rows} data-parallel ranks (rep·dp): make the global batch a multiple of {rows}")
        if s.cp > 1 and tensor.shape[case.seq_dim] % s.cp:
            raise ConfigError(f"{cfg.id}: batch[{name!r}] of shape {tuple(tensor.shape)} does not split on its "
                              f"sequence dim {case.seq_dim} over cp={s.cp}: choose a sequence length that cp divides")
    trip = reshard_of(cfg)
    if trip is not None:
        _check_reshard(case, cfg, trip)


def _check_reshard(case: ModelCase, cfg: Config, trip: Reshard) -> None:
    steps = cfg.size("steps")
    if steps < 2:
        raise ConfigError(f"{cfg.id}: a reshard cell saves after step steps-1 and resumes: give it steps2 or more")
    if not 1 <= trip.save_step < steps:
        raise ConfigError(f"{cfg.id}: reshard ...at{trip.save_step} saves after a step the cell does not end with: "
                          f"choose at<N> with 1 <= N < steps={steps}")
    again = trip.load
    if again is None:
        return
    if again.world > cfg.world:
        raise ConfigError(f"{cfg.id}: the load mesh ({again.world} ranks) is larger than the cell's ({cfg.world}): "
                          "make the larger layout the cell's mesh and reshard to the smaller one")
    if cfg.degree("pp") > 1 or again.degree("pp") > 1:
        raise ConfigError(f"{cfg.id}: reshard cells do not run pipelined layouts (pp)")
    check(case, again)
    check_impl(case, again)


def check_impl(case: ModelCase, cfg: Config) -> None:
    """The meshes ``cfg.impl`` declares it supports (``ModelCase.supports``)."""
    supports = case.supports.get(cfg.impl)
    reason = supports(mesh_spec(cfg)) if supports else None
    if reason:
        raise ConfigError(f"{cfg.id}: implementation {cfg.impl!r} does not support this mesh: {reason}")


def ranks_of(world: int) -> tuple[tuple[str, int], ...]:
    """A 1-D mesh over the first ``world`` ranks: the group a checkpoint is saved or loaded over (the
    pool may have more ranks)."""
    return (("w", world),)


def meshes(cfg: Config) -> list:
    """What the ranks build besides the cell's own mesh: its :class:`MeshSpec`; for a reshard cell
    also a mesh over the cell's ranks and, unless one process loads, the load layout's spec and a
    mesh over its ranks."""
    trip = reshard_of(cfg)
    own = [mesh_spec(cfg)]
    if trip is None:
        return own
    if trip.load is None:
        return own + [ranks_of(cfg.world)]
    return own + [ranks_of(cfg.world), mesh_spec(trip.load), ranks_of(trip.load.world)]
