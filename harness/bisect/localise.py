"""Localisation: the first event where a parallel run leaves the reference.

The reference runs in this process and the implementation in the pool, both with event recording on
(:mod:`harness.events`). Events are matched by key, in the reference's order; each parallel event's
tensors are assembled from the ranks that recorded it and held against the reference's under the
tolerance policy. Two answers:

* the **first diverging event**: the first whose tensors, inputs or outputs, differ at all;
* **where it starts**: the first whose inputs all match but whose outputs do not. Error propagates
  forward (and backward) from there, so this is the operation to read.
"""
from __future__ import annotations

import re
import sys
from collections import Counter, defaultdict
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from .. import events
from ..cell import assemble_result, parity
from ..compare.diff import Row, compare
from ..config import Config
from ..layout import AssemblyError, MeshLayout, Piece, assemble, summed_over
from ..pool.parent import CaseFailure, Pool, PoolError
from ..names import parse
from ..paths import load
from ..registry import Diagnosis, reference_of
from ..resolve import Cell, as_cell
from ..screen import fitted
from .signature import factor_text
from ..compare.tolerance import Tolerances


def recorded_run(ctx, payload: tuple[str, Config]) -> dict:
    """Pool task: the cell's implementation (its import path: the rank processes do not see
    registrations made in the parent's conftest) with event recording on, on this rank."""
    from ..world import explained, user_line

    path, cfg = payload
    with events.recording() as log:
        try:
            result, error = load(path)(ctx, cfg), ""
        except Exception as raised:  # the events up to a crash still say where it went wrong
            first = (str(raised).strip().splitlines() or [""])[0]
            result = None
            error = explained(raised, ctx.layout.world) or f"{type(raised).__name__}: {first}{user_line(raised)}"
    return {"result": result, "events": log, "error": error}


def recorded_reference(ctx, payload: tuple[str, Config]) -> list[events.Event]:
    """Pool task: the reference of the cell ``cfg`` in a world of one
    (:func:`harness.registry.reference_of`), with event recording on: its events."""
    path, cfg = payload
    with events.recording() as log:
        reference_of(path, cfg)
    return log


def _numbered(log: list[events.Event]) -> list[events.Event]:
    """An operation recorded twice under one key (a layer applied twice) gets ``#2``, ``#3``."""
    seen: Counter = Counter()
    out = []
    for event in log:
        seen[event.key] += 1
        if seen[event.key] > 1:
            event = events.Event(f"{event.key} #{seen[event.key]}", event.inputs, event.outputs)
        out.append(event)
    return out


@dataclass
class Finding:
    """One event held against the reference: its failing rows, by role."""

    key: str
    inputs: list[Row] = field(default_factory=list)
    outputs: list[Row] = field(default_factory=list)
    note: str = ""  # why it could not be compared
    # output -> the mesh dim over which the ranks hold partial sums of it (summed, they match)
    partial: dict[str, str] = field(default_factory=dict)
    # diverging tensors, inputs or outputs, that are per rank by design (an EP router's masked
    # scores, the tokens dispatched to a rank's experts): not judged (per_rank_by_design); a
    # module's gradient event inherits its forward event's
    per_rank: list[str] = field(default_factory=list)

    @property
    def diverges(self) -> bool:
        return any(not r.ok for r in self.inputs + self.outputs)

    @property
    def starts_here(self) -> bool:
        """Its judged inputs match (those per rank by design are not judged) and an output does not."""
        return all(r.ok or r.tensor in self.per_rank for r in self.inputs) and any(not r.ok for r in self.outputs)

    @property
    def by_design(self) -> bool:
        """It diverges only in tensors that are per rank by design: nothing of it is judged wrong."""
        return self.diverges and all(r.ok or r.tensor in self.per_rank for r in self.inputs + self.outputs)

    def describe(self) -> str:
        bad = [("input", r) for r in self.inputs if not r.ok] + [("output", r) for r in self.outputs if not r.ok]
        parts = [f"{role} {r.tensor}: {r.problem}, err/tol {r.ratio:.3g}, norm ratio {r.norm_ratio:.4g}"
                 + (f", ranks {r.ranks}" if r.ranks else "") for role, r in bad]
        return f"{self.key} ({'; '.join(parts)})"


@dataclass
class Localisation:
    reference_events: int
    implementation_events: int
    compared: int = 0
    first_diverging: Finding | None = None
    last_matching: str = ""  # the event compared just before the first diverging one
    origin: Finding | None = None
    result_ok: bool | None = None  # whether this run's end result matched the reference
    unrecorded: list[str] = field(default_factory=list)  # reference events the implementation lacks
    errors: dict[int, str] = field(default_factory=dict)  # rank -> what it raised while recording
    uncompared: list[Finding] = field(default_factory=list)
    # with complete=True: every event, compared or not, in the reference's order (the report's heatmap)
    findings: list[Finding] = field(default_factory=list)
    # a result tensor (a gradient) -> the mesh dim over which the ranks hold partial sums of it
    partial_results: dict[str, str] = field(default_factory=dict)
    # a result tensor -> the mesh dim over which the ranks' copies differ and their mean matches (a
    # data-parallel reduction that never ran)
    mean_results: dict[str, str] = field(default_factory=dict)
    # results that are the reference times a group's size (name -> "x 1/2 = 1/tp")
    scaled_results: dict[str, str] = field(default_factory=dict)
    # the comparison of this run's end result (None where it crashed or could not be assembled)
    report: object = None
    # the most calls of one module in step 1 on a rank: a trainer's own pipeline schedule's microbatches
    microbatches: int = 1
    # the component's own diagnosis of the cell (Component.diagnose: what pytest prints under its
    # table), first in the summary; set by located()
    diagnosis: str = ""

    @property
    def start(self) -> str:
        """Where the divergence starts, as two configs failing from one bug share it: a whole model's
        first diverging module and what diverges there (``mlp.fc2 (output)``, ``... (parameter
        gradients)``), its step and microbatch left out; else the pass and the kind of event where it
        starts (``fwd expert``: which expert, layer or ring step varies with the config's sizes);
        '' where neither is known."""
        head = self.diagnosis.splitlines()[0] if self.diagnosis else ""
        if head.startswith("first diverging module: "):
            return re.sub(r", (step|microbatch) \d+|:.*$", "", head.removeprefix("first diverging module: ")).strip()
        finding = self.origin or self.first_diverging
        return " ".join(finding.key.split()[:2]) if finding is not None else ""

    def summary(self) -> str:
        """The lines a failing cell prints under its table (:func:`harness.screen.fitted` to the screen)."""
        return fitted("\n".join(line for line in (self.diagnosis, self._events_summary()) if line))

    def _events_summary(self) -> str:
        ranks = sorted(self.errors)  # the ranks that raised while recording, and the first one's error
        raised = self.errors[ranks[0]] if ranks else ""
        if self.implementation_events == 0 and ranks:
            return (f"no events: the run raised before it recorded any, on ranks {ranks}: {raised}; "
                    "so bisect cannot say where the divergence starts, only that it crashes there")
        if self.implementation_events == 0:
            return ("no events: this implementation records none (docs/bisect-and-explore.md, 'Events for "
                    "bisect'), so bisect cannot say where the divergence starts")
        unrecorded = (f"; {len(self.unrecorded)} reference events were not recorded by the implementation"
                      if self.unrecorded else "")
        # the events after a crash were never recorded: that is no divergence to count
        crash = f"it crashes: ranks {ranks} raised {raised}" if ranks else ""
        if self.first_diverging is None and crash:
            return f"{crash}\nthe {self.compared} events recorded before it match the reference"
        if self.first_diverging is None:
            if self.result_ok:
                return f"all {self.compared} compared events match, and so does the result{unrecorded}"
            if self.partial_results or self.mean_results or self.scaled_results:
                return f"all {self.compared} compared events match; {self._results_text()}{unrecorded}"
            return (f"all {self.compared} compared events match: the divergence starts after the last recorded "
                    f"event (in the gradient reduction or the optimizer step){unrecorded}")
        lines = [f"first diverging event: {self.first_diverging.describe()}"]
        if self.origin is not None:
            lines.append(f"where it starts: {self.origin.key}: its inputs match the reference, its outputs do not"
                         + ("" if self.origin is self.first_diverging else f" ({self.origin.describe()})"))
        else:
            after = f"after {self.last_matching}, the last event that matches, " if self.last_matching else ""
            lines.append(f"where it starts: {after}before {self.first_diverging.key}, whose inputs already differ: "
                         "in code between them that records no event")
        if crash:
            lines.append(f"then {crash}")
        return "\n".join(lines)

    def _results_text(self) -> str:
        """The results the ranks hold as partial sums, by the mesh dim they are summed over; those
        that are the reference scaled, by the factor."""

        def grouped(found: dict[str, str]) -> dict[str, tuple[str, str, str]]:
            by: dict[str, list[str]] = defaultdict(list)
            for name, key in found.items():
                by[key].append(name)
            return {key: (", ".join(sorted(names)),) + (("are", "their") if len(names) > 1 else ("is", "its"))
                    for key, names in by.items()}

        partial = [f"{names} {are} per-rank partial sums over {dim} (summed they match the reference): {their} "
                   f"all-reduce over {dim} is missing" for dim, (names, are, their) in grouped(self.partial_results).items()]
        partial += [f"{names} {'differ' if are == 'are' else 'differs'} over {dim} (averaged over {dim} they match the "
                    f"reference): {their} reduction over {dim} is missing"
                    for dim, (names, are, their) in grouped(self.mean_results).items()]
        scaled = [f"{names} {are} the reference {factor}: scaled by a group's size (a reduction over the wrong "
                  "group, or once too often)" for factor, (names, are, _) in grouped(self.scaled_results).items()]
        return "; ".join(partial + scaled)

    def as_json(self) -> dict:
        def one(f: Finding | None):
            if f is None:
                return None
            return {"event": f.key, "failing": [
                {"role": role, "tensor": r.tensor, "problem": r.problem, "ratio": r.ratio,
                 "norm_ratio": r.norm_ratio, "ranks": r.ranks}
                for role, rows in (("input", f.inputs), ("output", f.outputs)) for r in rows if not r.ok]}

        return {"reference_events": self.reference_events, "implementation_events": self.implementation_events,
                "compared": self.compared, "result_matches": self.result_ok,
                "first_diverging": one(self.first_diverging), "last_matching": self.last_matching or None,
                "origin": one(self.origin),
                "unrecorded": self.unrecorded[:20], "errors": self.errors, "partial_results": self.partial_results,
                "mean_results": self.mean_results, "scaled_results": self.scaled_results,
                "diagnosis": self.diagnosis}


def partial_over(name: str, pieces: dict[int, Piece], expected, layout: MeshLayout, tol, op: str = "sum") -> str | None:
    """The mesh dim over which ``pieces`` are partial sums of ``expected`` (a tensor): summed over
    that dim's groups (``op="mean"``: averaged), they match it under ``tol``; None when no dim the
    pieces are not placed over does so."""
    placed = next(iter(pieces.values())).placements
    for dim, degree in layout.dims:
        if degree < 2 or dim in placed:
            continue
        summed = summed_over(pieces, layout, dim, op)
        try:
            got = assemble(name, summed, layout, every_rank=False) if summed else None
        except AssemblyError:
            continue
        if got is not None and all(r.ok for r in compare({name: got}, {name: expected}, tol).rows):
            return dim
    return None


def partial_sums(rows: list[Row], pieces: dict[str, dict[int, Piece]], expected: dict, layout: MeshLayout,
                 tol, op: str = "sum") -> dict[str, str]:
    """Each tensor of ``rows`` whose copies disagree (a failing ``replicas`` row) and whose ranks'
    ``pieces`` are partial sums of ``expected`` (``op="mean"``: whose mean is ``expected``) -> the
    mesh dim they are partial over (:func:`partial_over`). Copies that agree are no partial sums, whatever their sum: every rank
    holding half the gradient is the gradient over dp, a scale. Optimizer states are left out: they
    follow from the gradients."""
    found = {}
    for name in dict.fromkeys(r.tensor for r in rows if r.problem == "replicas" and not r.ok
                              and parse(r.tensor).kind != "opt"):
        dim = partial_over(name, pieces[name], expected[name], layout, tol, op)
        if dim:
            found[name] = dim
    return found


def _same(a: Piece, b: Piece, tol) -> bool:
    """Whether two ranks' pieces hold the same values (to ``tol``)."""
    if a.tensor.shape != b.tensor.shape:
        return False
    if not a.tensor.is_floating_point():
        return bool(torch.equal(a.tensor, b.tensor))
    return bool(((a.tensor.double() - b.tensor.double()).abs() <= tol.allowed(a.tensor)).all())


def _parts(held: dict[int, Piece], layout: MeshLayout) -> list[list[int]]:
    """The ranks of ``held`` grouped by the part of a tensor they hold: equal placements and equal
    coordinates on the mesh dims it is placed over."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for rank, piece in held.items():
        coords = tuple(layout.coord(rank, d) for d in piece.placements if d in layout.names)
        groups[(tuple(sorted(piece.placements)), coords)].append(rank)
    return list(groups.values())


def per_rank_by_design(finding: Finding, ranks: dict[int, events.Event], layout: MeshLayout,
                       tol: dict[str, object]) -> list[str]:
    """The tensors of a forward event (``ranks``: rank -> its event; ``tol``: role -> tolerance)
    that fail in every form the ranks' pieces can take (``finding.partial``: the outputs that match
    as partial sums) and that are per rank by design, so that no reference holds them in that form:

    * an input that two ranks holding the same part of it hold differently, or that some ranks
      recording the event hold in a shape no layout of the reference's explains: what the caller
      hands each rank (the tokens an EP plan dispatches to a rank's experts);
    * an output that two ranks given the same input hold differently for the same part of it (an
      EP router's masked scores), and every failing output of a module whose input is per rank.

    A divergence that every such pair of ranks agrees on is judged, whatever hooks the module carries."""

    def one(role: str, name: str):
        held_to = tol[role]
        return held_to.get(name) if isinstance(held_to, Tolerances) else held_to

    def failing(rows: list[Row]) -> list[str]:
        return list(dict.fromkeys(r.tensor for r in rows if not r.ok and r.tensor not in finding.partial))

    inputs = []
    for name in failing(finding.inputs):
        held = {rank: e.inputs[name] for rank, e in ranks.items() if name in e.inputs}
        if len(held) < len(ranks) or any(not _same(held[group[0]], held[r], one("inputs", name))
                                         for group in _parts(held, layout) for r in group[1:]):
            inputs.append(name)
    if inputs:
        return inputs + failing(finding.outputs)
    outputs = []
    for name in failing(finding.outputs):
        held = {rank: e.outputs[name] for rank, e in ranks.items() if name in e.outputs}
        for group in _parts(held, layout):
            same_input = [[group[0]]]  # ranks of the group, by the input they received
            for rank in group[1:]:
                given = ranks[rank].inputs.get("input")
                for kept in same_input:
                    other = ranks[kept[0]].inputs.get("input")
                    if (given is None) == (other is None) and (
                            given is None or _same(given, other, one("inputs", "input"))):
                        kept.append(rank)
                        break
                else:
                    same_input.append([rank])
            if any(not _same(held[kept[0]], held[r], one("outputs", name)) for kept in same_input for r in kept[1:]):
                outputs.append(name)
                break
    return outputs


def scaled(rows: list[Row], mesh) -> dict[str, str]:
    """Each tensor of ``rows`` that is the reference times a whole factor -> the factor, named with
    the groups of ``mesh`` of that size (``x 1/2 = 1/tp``: :func:`~harness.bisect.signature.factor_text`)."""
    found = {}
    for row in rows:
        factor = factor_text(row.norm_ratio, row.fit_residual, mesh) if row.problem == "mismatch" and row.numel > 1 \
            else None
        if factor:
            found[row.tensor] = factor
    return found


def located(cfg: Config | Cell, pool: Pool) -> Localisation | None:
    """Where a failing config's divergence starts, as bisect and exploration report it: its
    localisation, led by the component's own diagnosis where it has one (a whole model's first
    diverging module: the line pytest prints under the cell's table, from the same function). A crash
    or hang while recording leaves none (said on stderr)."""
    cell = as_cell(cfg, pool.size)
    # a component's own diagnosis compares every event (a model's: its heatmap): one recording serves it
    # and this localisation, which reads the same first divergence from it
    complete = bool(cell.component.diagnose)
    try:
        found = localise(cell, pool, complete=complete)
    except (CaseFailure, PoolError) as error:
        print(f"events of {cell.id} could not be recorded: {str(error).splitlines()[0]}", file=sys.stderr)
        return None
    if complete and found.report is not None and not found.report.ok:
        with _recorded(cell.cfg, found):
            found.diagnosis = cell.diagnose(pool, found.report, rerun=True).text
    return found


# the complete localisation located() recorded, for the diagnosis it calls to read instead of recording
# the same run again
_RECORDED: ContextVar[tuple[Config, Localisation] | None] = ContextVar("recorded", default=None)


@contextmanager
def _recorded(cfg: Config, found: Localisation):
    token = _RECORDED.set((cfg, found))
    try:
        yield
    finally:
        _RECORDED.reset(token)


def diagnosis(cfg: Config, pool, report, rerun: bool) -> Diagnosis:
    """The diagnosis of a failing cell of a component that declares none (``Component.diagnose``):
    where its recorded events say the divergence starts, the lines bisect and exploration print for
    it (:func:`located`), under the cell's table."""
    if report.ok or not rerun or not getattr(pool, "can_rerun", False):
        return Diagnosis()
    found = located(cfg, pool)
    if found is None:
        return Diagnosis("where it starts: not known: its events could not be recorded (it crashed or hung "
                         "while recording)")
    return Diagnosis(found.summary())


def _recorded_reference(cell: Cell, pool: Pool, path: str, what: str) -> list[events.Event]:
    """The events of the reference function ``path`` on the cell's config, in a world of one."""
    cfg = cell.cfg
    return _numbered(pool.alone("harness.bisect.localise:recorded_reference", (path, cfg), cfg.problem.mesh,
                                seed=cfg.seed, label=f"{cfg.id} ({what}, recording events)",
                                deadline=cell.deadline(pool)))


def _calibrated_events(cell: Cell, pool: Pool) -> dict[str, events.Event]:
    """The events of the cell's problem on one process in the cell's dtype (its ``calibration``,
    recorded): how far right code lies from the fp64 reference's events by rounding alone. Empty
    where the component has no calibration or the cell is fp64."""
    if cell.component.calibration is None or cell.cfg.dtype == "fp64":
        return {}
    log = _recorded_reference(cell, pool, cell.component.calibration, f"one process in {cell.cfg.dtype}")
    return {event.key: event for event in log}


def _event_tolerance(tol, want: events.Event, calibrated: dict[str, events.Event], role: str):
    """The tolerance one event's tensors are held to: the policy's (``tol``), grown per tensor by
    what one process in the cell's dtype shows there (:class:`~harness.compare.tolerance.Tolerances`),
    as the cell's results are: an event is not held tighter than the verdict it explains."""
    one = calibrated.get(want.key)
    if one is None:
        return tol
    expected = {n: p.tensor for n, p in getattr(want, role).items()}
    measured = {n: p.tensor for n, p in getattr(one, role).items() if n in expected}
    return Tolerances(tol.dtype, tol.reduction, reference=expected, one_process=measured)


def localise(cfg: Config | Cell, pool: Pool, complete: bool = False) -> Localisation:
    """Record the reference's and the implementation's events for the cell and find the divergence.
    ``complete``: compare every event (kept in ``findings``) instead of stopping where it starts."""
    cell = as_cell(cfg, pool.size).valid()
    cfg = cell.cfg
    if complete and (held := _RECORDED.get()) is not None and held[0] == cfg:
        return held[1]
    reference = _recorded_reference(cell, pool, cell.component.reference, "its reference")
    calibrated = _calibrated_events(cell, pool)
    # the cell's own deadline (a model's deadline_factor): recording costs more than the cell, not less
    per_rank = pool.run("harness.bisect.localise:recorded_run", (cell.impl.run, cfg), cfg.mesh, seed=cfg.seed,
                        label=f"{cfg.id} (recording events)", extra_meshes=cell.meshes, deadline=cell.deadline(pool),
                        fresh=cell.component.fresh)
    layout = MeshLayout.of(cfg.mesh)
    partial_results: dict[str, str] = {}
    mean_results: dict[str, str] = {}
    scaled_results: dict[str, str] = {}
    report = None
    try:
        results = {r: got["result"] for r, got in per_rank.items()}
        result_ok = None not in results.values()
        if result_ok:
            tol_of, report = parity(cell, assemble_result(cfg.mesh, results))
            result_ok = report.ok
            expected = cell.reference()
            held = set(results[min(results)])  # every rank holds the same names (assemble_result)
            rows = [r for r in report.failing() if r.tensor in expected and r.tensor in held]
            pieces = {r.tensor: {k: got[r.tensor] for k, got in results.items()} for r in rows}
            partial_results = partial_sums(rows, pieces, expected, layout, tol_of)
            # per-rank gradients of a data-parallel step whose reduction never ran: their mean is the step's
            mean_results = partial_sums([r for r in rows if r.tensor not in partial_results], pieces, expected, layout,
                                        tol_of, op="mean")
            scaled_results = scaled(rows, cfg.mesh)
    except AssemblyError:
        result_ok = False
    parallel: dict[str, dict[int, events.Event]] = defaultdict(dict)
    for rank, got in per_rank.items():
        for event in _numbered(got["events"]):
            parallel[event.key][rank] = event
    # an event's tensors are not the results the policy's sizes name: held to the size of the rest
    tol = cell.policy().get("*")
    found = Localisation(len(reference), len(parallel), result_ok=result_ok,
                         errors={r: got["error"] for r, got in per_rank.items() if got["error"]},
                         partial_results=partial_results, mean_results=mean_results, scaled_results=scaled_results,
                         report=report, microbatches=1 + max((int(n) for key in parallel if " step=1 " in f" {key} "
                                                              for n in re.findall(r"microbatch=(\d+)", key)), default=0))
    designed: dict[str, list[str]] = {}  # forward event -> its tensors per rank by design
    for want in reference:
        ranks = parallel.get(want.key)
        if not ranks:
            found.unrecorded.append(want.key)
            continue
        finding = Finding(want.key)
        held_to: dict[str, object] = {}  # role -> the tolerance its tensors are held to
        if complete:
            found.findings.append(finding)
        try:
            for role in ("inputs", "outputs"):
                expected = {n: p.tensor for n, p in getattr(want, role).items()}
                # a tensor no rank recorded (one a rank cannot place on the mesh) is not compared:
                # its absence says nothing about the numbers
                pieces = {n: {r: getattr(e, role)[n] for r, e in ranks.items() if n in getattr(e, role)}
                          for n in expected}
                pieces = {n: held for n, held in pieces.items() if held}
                got = {n: assemble(f"{want.key} {n}", held, layout, every_rank=False) for n, held in pieces.items()}
                held_to[role] = _event_tolerance(tol, want, calibrated, role)
                rows = compare(got, {n: expected[n] for n in got}, held_to[role]).rows
                getattr(finding, role).extend(rows)
                if role == "outputs":
                    finding.partial = partial_sums(rows, pieces, expected, layout, held_to[role])
            if want.key.startswith("fwd"):
                finding.per_rank = designed[want.key] = per_rank_by_design(finding, ranks, layout, held_to)
            else:  # the gradients of what is per rank by design are per rank alike
                finding.per_rank = designed.get("fwd" + want.key.removeprefix("bwd"), [])
        except AssemblyError as error:
            finding.note = str(error)
            found.uncompared.append(finding)
            continue
        if not finding.inputs and not finding.outputs:
            finding.note = "no rank recorded a tensor of it that can be placed on the mesh"
            found.uncompared.append(finding)
            continue
        found.compared += 1
        wrong = finding.diverges and not finding.by_design
        if wrong and found.first_diverging is None:
            found.first_diverging = finding
        elif found.first_diverging is None:
            found.last_matching = finding.key
        if wrong and finding.starts_here and found.origin is None:
            found.origin = finding
        if found.origin is not None and not complete:
            break
    return found
