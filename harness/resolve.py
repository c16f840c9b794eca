"""A cell resolved once: what is decided about a config before any rank runs, made in one place.

:func:`resolve` reads a config's component and implementation from the registry, checks their rules,
computes the further meshes its ranks build and how many ranks it needs, and decides what becomes of
it here (:class:`Disposition`). The :class:`Cell` it returns is what the ``parity`` fixture,
``harness.golden``, bisect, bench and exploration take, and what :mod:`harness.cell` runs: none of
them asks the registry again.

Naming: a :class:`~harness.registry.Component`'s fields are import paths; a Cell's member of the same
name is what that path gives for the cell (``reference``, ``calibration``, ``reduction``, ``meshes``,
``diagnose``; ``validate``, ``skip`` and ``xfail`` decide its ``disposition``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

import torch

from .compare.tolerance import Tolerances
from .config import Config, ConfigError
from .known import Known
from .names import NOT_JUDGED, parse
from .paths import load
from .registry import (Component, Diagnosis, Implementation, check_rules, diagnosed, get, meshes_of, ranks_needed,
                       reference_of)


class NotJudged(Exception):
    """A cell its reference cannot judge (a model that draws random numbers in training mode): not a
    divergence and not a match. The message says why and what to change; pytest skips the cell with
    it, bisect and exploration count it as a skip."""


@dataclass(frozen=True)
class Disposition:
    """What becomes of a cell here.

    ``run``; ``invalid``: it breaks a rule (``reason`` names it; the cell fails before any rank runs);
    ``skip``: its implementation cannot run it here (a library or capability missing, too few ranks
    in a torchrun job); ``xfail``: a divergence its implementation declares, run in full (``strict``:
    a match fails, saying the upstream behaviour changed; not where it shows on some machines only;
    ``known``: the declaration, whose ``holds`` says whether a failure is the declared one)."""

    kind: Literal["run", "invalid", "skip", "xfail"]
    reason: str = ""
    strict: bool = True
    known: Known | None = None


RUN = Disposition("run")

# references per process, by problem (Config.problem_key) and what was computed (reference, calibration, a
# whole model's reduction): the same for every mesh and implementation
_references: dict[tuple, dict[str, torch.Tensor] | int | dict[str, int]] = {}


@dataclass(frozen=True, eq=False)
class Cell:
    """One config resolved: its component and implementation, the meshes and ranks it needs, and its
    disposition. Made by :func:`resolve`; what it computes later (references, tolerances) is kept."""

    cfg: Config
    disposition: Disposition
    component: Component | None = None  # None: an unknown component (invalid)
    meshes: tuple = ()  # what the ranks build besides cfg.mesh (the component's ``meshes``)
    world: int = 0  # the ranks it needs: its mesh's, or the largest of ``meshes``

    @property
    def id(self) -> str:
        return self.cfg.id

    @property
    def impl(self) -> Implementation:
        return self.component.implementations[self.cfg.impl]

    @cached_property
    def reduction(self) -> int | dict[str, int]:
        """Terms a result's reduction adds (the component's ``reduction``), for the tolerance policy."""
        return load(self.component.reduction)(self.cfg)

    def in_golden(self, name: str) -> bool:
        """Whether result ``name`` goes in the cell's golden file: all but a whole model's gradients
        after step 1, which are judged against the reference; over time, the final parameters and
        optimizer state the file holds carry what they did (and files written before they were
        judged stay valid)."""
        result = parse(name)
        return self.component.case is None or not (result.kind == "grad" and result.step)

    def valid(self) -> Cell:
        """This cell, or :class:`ConfigError` naming the rule it breaks when it is ``invalid``."""
        if self.disposition.kind == "invalid":
            raise ConfigError(self.disposition.reason)
        return self

    def deadline(self, pool) -> float | None:
        """Its deadline in ``pool``: the pool's times the component's ``deadline_factor`` (None: the
        pool's own)."""
        deadline = getattr(pool, "deadline", None)
        factor = self.component.deadline_factor
        return deadline * factor if deadline and factor != 1.0 else None

    def reference(self, pool=None) -> dict[str, torch.Tensor]:
        """The reference result of its problem (:attr:`Config.problem`), computed in a world of one
        by ``pool`` (on a rank beside its own; under torchrun on rank 0) or here without one. Kept per
        process for every mesh and implementation of the problem: the reference is handed the problem
        alone and sees one process. Raises :class:`NotJudged` when the reference cannot judge it."""
        return self._computed(self.component.reference, "reference", pool)

    def calibration(self, pool=None) -> dict[str, torch.Tensor] | None:
        """The same on one process in the cell's dtype (the component's ``calibration``); None where
        the component has none or the cell is fp64 (where it is the reference itself)."""
        if self.component.calibration is None or self.cfg.dtype == "fp64":
            return None
        return self._computed(self.component.calibration, "calibration", pool)

    def reduction_in(self, pool=None) -> int | dict[str, int]:
        """Its ``reduction``; a whole model's computed beside ``pool`` when given, once per problem:
        it builds the model, whose library (transformers: seconds) is the pools' to import, not this
        process's. A component's is arithmetic on its sizes, computed here."""
        if pool is None or self.component.case is None:
            return self.reduction
        return self._computed(self.component.reduction, "reduction", pool, shown="reduction")

    def _computed(self, path: str, what: str, pool, shown: str = "reference"):
        """``path`` on its problem in a world of one, kept per process by problem and ``what``; a
        failure there is labelled ``(its <shown>)`` (the calibration is its reference in the cell's
        dtype: the zoo reads the label)."""
        key = (*self.cfg.problem_key, what)
        if key not in _references:
            problem = self.cfg.problem
            _references[key] = (reference_of(path, problem) if pool is None else
                                pool.alone("harness.pool.tasks:reference", (path, problem), problem.mesh,
                                           seed=self.cfg.seed, label=f"{self.id} (its {shown})",
                                           deadline=self.deadline(pool)))
        result = _references[key]
        if isinstance(result, dict) and NOT_JUDGED in result:
            raise NotJudged(result[NOT_JUDGED])
        return result

    def tolerances(self, pool=None) -> Tolerances:
        """Its tolerance policy (:mod:`harness.compare.tolerance`): its dtype, its ``reduction``, its
        reference's families and its one-process rounding (all three computed in ``pool`` if given)."""
        return self.policy(self.reference(pool), self.calibration(pool), pool)

    def policy(self, reference: dict | None = None, one_process: dict | None = None, pool=None) -> Tolerances:
        """The tolerance policy in its dtype and ``reduction`` (:meth:`reduction_in` ``pool``) for the
        tensors ``reference`` (their families' scales) and ``one_process`` (their rounding on one
        process); none: the policy alone."""
        return Tolerances(self.cfg.dtype, self.reduction_in(pool), reference, one_process)

    def diagnose(self, pool, report, rerun: bool) -> Diagnosis:
        """What the component adds to its verdict (its ``diagnose``; by default where its events say
        the divergence starts), never raising: the comparison itself is the verdict."""
        return diagnosed(self.component, self.cfg, pool, report, rerun)


def resolve(cfg: Config, pool_size: int | None = None, job_size: int | None = None) -> Cell:
    """``cfg`` resolved: its component's and implementation's rules checked, its meshes and ranks
    counted, its disposition decided. ``pool_size``: a cell needing more ranks than the pool has is
    invalid (the fix is ``--pool-size``); ``job_size``: under torchrun, one needing more than the job
    has is skipped (the fix is a larger launch)."""
    try:
        component = get(cfg.component)
        check_rules(component, cfg)
        meshes = meshes_of(component, cfg)
    except ConfigError as error:
        return Cell(cfg, Disposition("invalid", str(error)), world=cfg.world)
    world = ranks_needed(cfg, meshes)
    cell = Cell(cfg, RUN, component, meshes, world)
    if pool_size is not None and world > pool_size:
        return replace(cell, disposition=Disposition(
            "invalid", f"{cfg.id}: needs {world} ranks but the pool has {pool_size}; pass --pool-size {world}"))
    impl = cell.impl
    reason = load(impl.skip)(cfg) if impl.skip else None
    if not reason and job_size is not None and world > job_size:
        reason = (f"needs {world} ranks and this torchrun job has {job_size}: launch at least {world} "
                  "(--nnodes x --nproc-per-node)")
    if reason:
        return replace(cell, disposition=Disposition("skip", reason))
    known = load(impl.xfail)(cfg) if impl.xfail else None
    if known:
        if not isinstance(known, Known):  # a plain reason: any failure is the declared one
            known = Known(str(known), strict=getattr(known, "strict", True))
        return replace(cell, disposition=Disposition("xfail", str(known), known.strict, known))
    return cell


def as_cell(cell: Cell | Config, pool_size: int | None = None) -> Cell:
    """``cell`` if resolved already, else the config resolved (for callers handed either)."""
    return cell if isinstance(cell, Cell) else resolve(cell, pool_size)


def check_config(cfg: Config, pool_size: int | None = None) -> None:
    """Raise :class:`ConfigError` naming the rule ``cfg`` breaks (given ``pool_size``, also when the
    pool lacks the ranks it needs): :func:`resolve`'s ``invalid``, as an exception."""
    resolve(cfg, pool_size).valid()
