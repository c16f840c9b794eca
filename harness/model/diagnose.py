"""What a model cell adds to its verdict: one localisation of a failing cell, read twice.

A failing cell runs once more with every submodule's events recorded (:mod:`harness.model.hooks`),
in the pool and in the reference, compared event by event (:func:`harness.bisect.localise.localise`).
That one run gives both:

* the text under the cell's table: the first diverging module, and the first parameter gradients
  that diverge in the order backward computes them;
* the cell's junit record, ``record["model"]``, for ``python -m harness.report``: ``losses``
  (``{"reference": [...], "run": [...]}``, every step's loss from the comparison) and, for a failing
  cell, ``modules``: ``[[module, phase, step, err/tol], ...]``, every module event compared (``fwd``
  its output, ``bwd`` its input gradient; ``null`` for an event that could not be compared), which
  the report draws as a module × step heatmap, and ``first``: ``[module, phase]``, the module the
  diagnosis names, which the heatmap outlines (absent where it names none).
"""
from __future__ import annotations

import math
import re
from typing import NamedTuple

from ..bisect.localise import localise
from ..bisect.signature import factor_text
from ..config import Config
from ..names import grad_name, parse, step_grad_name
from ..registry import Diagnosis
from ..screen import first_line
from ..world import any_world
from .batches import start_model
from .case import ModelCase
from .cell import configured


def diagnose(case: ModelCase, cfg: Config, pool, report, rerun: bool) -> Diagnosis:
    """The diagnosis of a model cell: losses always; for a failing cell, where it starts (when
    ``rerun`` and ``pool`` can run it again: the module events), the first diverging parameter
    gradients, and the order its table lists tensors in."""
    record: dict = {"losses": losses(report)}
    if report.ok:
        return Diagnosis(record={"model": record})
    with configured(case, cfg), any_world():
        params = [n for n, _ in start_model(case, cfg).named_parameters()]
    lines, notes, first, found, factors = [], [], None, None, cfg.mesh
    if rerun and pool.can_rerun:
        try:
            found = localise(cfg, pool, complete=True)
        except Exception as error:  # noqa: BLE001  the diagnosis must not hide the failure
            record["modules_error"] = f"{type(error).__name__}: {error}"
            notes.append(f"(where it starts is not known: the rerun that records each module's tensors failed: "
                         f"{first_line(record['modules_error'])})")
        else:
            record["modules"] = module_rows(found)
            # a trainer's own pipeline schedule calls each module once per microbatch: a factor their count
            factors = cfg.mesh + ((("microbatches", found.microbatches),) if found.microbatches > 1 else ())
            start = where_it_starts(found, report, factors)
            first = start.module
            lines.append(start.line)
            if first is not None:
                record["first"] = [first, start.phase]
            if found.errors:  # what follows is read from the events before it raised, and less than it would be
                ranks = sorted(found.errors)
                record["rerun_errors"] = {str(r): found.errors[r] for r in ranks}
                notes.append(f"(the rerun that records each module's tensors raised on ranks {ranks}: "
                             f"{found.errors[ranks[0]]}; where it starts is read from the events before that, and its "
                             "gradients were not checked for partial sums)")
    backward = backward_order(params, found)
    gradients = first_gradients(backward, report, factors, found.partial_results if found else None,
                                found.mean_results if found else None)
    return Diagnosis("\n".join(lines + ([gradients] if gradients else []) + notes), {"model": record},
                     order=table_order(backward, first))


def losses(report) -> dict[str, list[float]]:
    """Reference and run loss per step, from a comparison's rows."""
    found = {name.step: row for row in report.rows
             if (name := parse(row.tensor)).kind == "loss" and row.problem not in ("replicas", "missing", "shape")}
    steps = sorted(found)
    return {"reference": [found[s].expected for s in steps], "run": [found[s].actual for s in steps]}


def _where(key: str) -> dict[str, str]:
    """An event key's fields: ``"fwd module module=layers.1 step=1"`` -> ``{"module": "layers.1", "step": "1"}``."""
    return dict(re.findall(r"(\w+)=(\S+)", key))


def module_rows(found) -> list[list]:
    """Every module event of a localisation: [module, phase, step, worst err/tol or None]."""
    out = []
    for finding in found.findings:
        where = _where(finding.key)
        rows = finding.outputs or finding.inputs
        ratio = max((r.ratio for r in rows), default=None) if not finding.note else None
        out.append([where.get("module", "?"), finding.key.split()[0], int(where.get("step", 0)),
                    None if ratio is None or not math.isfinite(ratio) else ratio])
    return out


def module_of(key: str) -> str:
    """``"bwd module microbatch=0 module=layers.1.mlp step=1 #2"`` -> ``"layers.1.mlp (input gradient, step 1, microbatch 0)"``."""
    where = _where(key)
    phase = "output" if key.startswith("fwd") else "input gradient"
    return f"{where.get('module', '?')} ({phase}, step {where.get('step', '?')}, microbatch {where.get('microbatch', '?')})"


def _owned(module: str, report) -> list[str]:
    """The parameters of ``module`` itself (not its children's) whose step-1 gradient diverges."""
    out = []
    for row in report.failing():
        name = parse(row.tensor)
        if name.kind == "grad" and name.step is None and name.param.rpartition(".")[0] == module:
            out.append(name.param.rpartition(".")[2])
    return list(dict.fromkeys(out))


class Start(NamedTuple):
    """Where a model cell's divergence starts: the module (None: no module), the pass it is named in
    (``fwd`` or ``bwd``, as the record's ``modules`` rows say) and the line that says so."""

    module: str | None
    phase: str
    line: str


def where_it_starts(found, report, mesh=()) -> Start:
    """The first diverging module and the line that names it: in the forward pass of step 1, the
    first module whose judged output diverges; where every judged forward output matches, the loss
    when the gradient it hands back to the model already differs (with the group whose size scales
    it, of ``mesh``), else in the backward pass, the first module (in the order backward reaches
    them) whose input gradient or own parameters' gradients (the cell's comparison) diverge. Events
    with nothing placed, and tensors per rank by design (``Finding.by_design``), are not judged; a module
    is judged by its numbers whatever hooks ``parallelize`` put on it."""
    step1 = [f for f in found.findings if _where(f.key).get("step") == "1"]
    judged = [f for f in step1 if f.inputs or f.outputs]
    forwards = [f for f in judged if f.key.startswith("fwd") and f.diverges]
    designed = [f for f in forwards if f.by_design]
    reduced = [f for f in forwards if not f.by_design and _reduced_by_caller(f, judged)]
    diverging = [f for f in forwards if not f.by_design and f not in reduced]
    forward = diverging[0] if diverging else None
    if forward is not None:
        module = _where(forward.key)["module"]
        named = f"first diverging module: {module_of(forward.key)}"
        if forward.starts_here and forward.partial:
            parent = module.rpartition(".")[0] or "the model"
            return Start(module, "fwd", f"{named}: its inputs still match the reference, it returns per-rank partial "
                                        f"sums over {_dims(forward.partial)}: summed they match the reference; "
                                        f"{parent} uses them unreduced")
        if forward.starts_here:
            return Start(module, "fwd", f"{named}: its inputs still match the reference, its outputs do not")
        return Start(module, "fwd", f"{named}; what it received already differs: the divergence starts before it, "
                                    "in code no module hook sees (between modules, a hook)")
    backward = [f for f in step1 if f.key.startswith("bwd")]
    if backward and _wrong(backward[0].inputs, backward[0]):
        last = _where(backward[0].key)["module"]
        bad = _wrong(backward[0].inputs, backward[0])[0]
        factor = factor_text(bad.norm_ratio, bad.fit_residual, mesh)
        return Start(None, "", "first diverging module: none, it starts in the loss (step 1): every judged forward "
                               f"output matches{_designed(designed, reduced)}, the gradient the loss hands back to {last} "
                               "does not"
                               + (f" (the reference {factor})" if factor else f" (norm ratio {bad.norm_ratio:.4g})")
                               + ": the loss function, what it is divided by, or code between the model and it")
    for event in backward:
        module = _where(event.key)["module"]
        own = _owned(module, report)
        passes_on = bool(_wrong(event.outputs, event))
        if not (own or passes_on):
            continue
        judged_in = [r for r in event.inputs if r.tensor not in event.per_rank]
        received = ("is not compared" if not event.inputs else "is per rank by design" if not judged_in else
                    "already differs" if _wrong(judged_in, event) else "still matches")
        for unreduced, held in ((found.partial_results, "are per-rank partial sums over {dim} (summed they match "
                                                        "the reference): their all-reduce over {dim} is missing"),
                                (found.mean_results, "differ over {dim} (averaged over {dim} they match the "
                                                     "reference): their reduction over {dim} is missing")):
            dims = {unreduced.get(grad_name(f"{module}.{n}")) for n in own}
            if own and not passes_on and len(dims) == 1 and None not in dims:
                return Start(module, "bwd", f"first diverging module: {module} (parameter gradients, step 1), in the "
                                            f"backward pass: the gradient it received {received}, its parameters' "
                                            f"gradients ({', '.join(own)}) {held.format(dim=dims.pop())}")
        wrong = " and ".join((["its input gradient"] if passes_on else [])
                             + ([f"its parameters' gradients ({', '.join(own)})"] if own else []))
        head = module_of(event.key) if passes_on else f"{module} (parameter gradients, step 1)"
        forward_text = "every judged forward output matches" + _designed(designed, reduced)
        return Start(module, "bwd", f"first diverging module: {head}, in the backward pass: {forward_text}, the "
                                    f"gradient it received {received}, {wrong} "
                                    f"{'do' if own or ' and ' in wrong else 'does'} not")
    if not judged:
        return Start(None, "", "first diverging module: not known: no module's tensors could be placed on the mesh "
                               "to compare (outputs its styles make per rank, or tensors of no batch layout)")
    later = first_gradient_step(report)
    if later is not None and later > 1:  # the module events are step 1's: what starts later is not in them
        return Start(None, "", f"first diverging module: none in step 1: every judged module's outputs and gradients "
                               f"match the reference there, and the gradients first diverge in step {later} (below): "
                               "what one step leaves the next (a buffer, a hook's state), or a difference step 1 "
                               "keeps within its tolerance")
    return Start(None, "", "first diverging module: none: every judged module's outputs and gradients match the "
                           "reference, so the divergence is in the gradient reduction, the optimizer step or the loss")


def _reduced_by_caller(finding, judged: list) -> bool:
    """Whether ``finding``'s module starts nothing although it returns per-rank partial sums: the
    module that calls it (its parent, same step and microbatch) returns judged outputs that all
    match, so it reduces them, as a block that all-reduces what its row-parallel child or its
    experts return does by design. A partial output is where a divergence starts only when what
    uses it diverges too."""
    if not (finding.starts_here and finding.partial):
        return False
    where = _where(finding.key)
    parent = where["module"].rpartition(".")[0]
    calls = [f for f in judged if f.key.startswith("fwd") and _where(f.key).get("module") == parent
             and _where(f.key).get("microbatch") == where.get("microbatch")]
    judged_outputs = [r for f in calls for r in f.outputs if r.tensor not in f.per_rank]
    return bool(judged_outputs) and all(r.ok for r in judged_outputs)


def _designed(designed: list, reduced: tuple = (), most: int = 2) -> str:
    """`` (what X returns is per rank by design ...)`` for the forward events left unjudged
    (``Finding.by_design``): ``receives`` where what the module is handed is per rank (and so what it
    returns), ``returns`` where only its output is; and those whose per-rank partial sums their
    caller reduces (:func:`_reduced_by_caller`); "" for none."""
    parts = [f"{_where(f.key)['module']} returns per-rank partial sums over {_dims(f.partial)}, which "
             f"{_where(f.key)['module'].rpartition('.')[0]} reduces" for f in reduced[:most]]
    if len(reduced) > most:
        parts[-1] += f" (and {len(reduced) - most} more alike)"
    for verb, given in (("receives", "holding the same part"), ("returns", "given the same input")):
        modules = list(dict.fromkeys(_where(f.key).get("module", "?") for f in designed
                                     if any(r.tensor in f.per_rank for r in f.inputs) == (verb == "receives")))
        if modules:
            named = ", ".join(modules[:most]) + (f" and {len(modules) - most} more" if len(modules) > most else "")
            parts.append(f"what {named} {verb if len(modules) == 1 else verb.removesuffix('s')} is per rank by "
                         f"design: ranks {given} hold it differently")
    return f" ({'; '.join(parts)}; not judged)" if parts else ""


def _wrong(rows: list, finding) -> list:
    """The rows of ``finding`` that fail and are judged (not per rank by design)."""
    return [r for r in rows if not r.ok and r.tensor not in finding.per_rank]


def _dims(partial: dict[str, str]) -> str:
    """The mesh dims a finding's outputs are partial sums over: ``tp``, or ``tp (output.0), dp (output.1)``."""
    dims = set(partial.values())
    return dims.pop() if len(dims) == 1 else ", ".join(f"{d} ({n})" for n, d in partial.items())


def backward_order(params: list[str], found=None) -> list[str]:
    """``params`` (in registration order) in the order backward computes their gradients: by when
    their module's backward hook fired in the reference's step 1 (``found``: a localisation), and
    else, or for a module that recorded none, in reverse registration order (which puts a
    transformers decoder layer's norms before its mlp, registered first though it runs last)."""
    reverse = list(reversed(params))
    if found is None:
        return reverse
    fired: dict[str, int] = {}
    for finding in found.findings:
        where = _where(finding.key)
        if finding.key.startswith("bwd") and where.get("step") == "1":
            fired.setdefault(where.get("module", ""), len(fired))
    return sorted(reverse, key=lambda p: fired.get(p.rpartition(".")[0], len(fired)))


def table_order(backward: list[str], first: str | None) -> list[str]:
    """The parameters whose tensors a failing model cell's table lists first: the first diverging
    module's own, or its subtree's where it owns none (an attention block, an activation's parent),
    then every parameter in the order backward computes them (``backward``); the rest (losses)
    follow."""
    if first is None:
        return backward
    named = ([p for p in backward if p.rpartition(".")[0] == first]
             or [p for p in backward if p.startswith(f"{first}.")])
    return named + [p for p in backward if p not in named]


def first_gradient_step(report) -> int | None:
    """The first training step at which a parameter's gradient fails the comparison; None where none does."""
    return min((name.step or 1 for name in map(parse, (row.tensor for row in report.failing())) if name.kind == "grad"),
               default=None)


def first_gradients(backward: list[str], report, mesh=(), partial: dict[str, str] | None = None,
                    means: dict[str, str] | None = None, most: int = 3) -> str:
    """The parameters whose gradient diverges at the first step where one does, in the order
    backward computes them (``backward``: :func:`backward_order`), each with its module and what is
    wrong: a gradient the ranks hold as partial sums over a mesh dim (``partial``: gradient name ->
    dim, from the localisation) says its all-reduce is missing, one whose copies' mean over a dim
    matches (``means``) that its reduction over the dim is; one that is the reference times a
    group's size or one over it says which group, of ``mesh``; "" when every gradient matches."""
    failing: dict = {}
    for row in report.failing():  # a tensor's own row first, not the row saying its copies differ
        failing.setdefault(row.tensor, row)
    step = first_gradient_step(report) or 1
    bad = [(n, failing[step_grad_name(step, n)]) for n in backward if step_grad_name(step, n) in failing]
    if not bad:
        return ""

    def factor(row) -> str:
        text = factor_text(row.norm_ratio, row.fit_residual, mesh) if row.problem == "mismatch" else None
        return f": the reference {text}" if text else ""

    def problem(n: str, row) -> str:
        dim = (partial or {}).get(step_grad_name(step, n))
        if dim:
            return f"partial sums over {dim} (summed they match the reference): its all-reduce over {dim} is missing"
        dim = (means or {}).get(step_grad_name(step, n))
        if dim:
            return f"differs over {dim} (averaged over {dim} it matches the reference): its reduction over {dim} is missing"
        return f"{row.problem}, norm ratio {row.norm_ratio:.4g}{factor(row)}"

    shown = [f"{n} (module {n.rpartition('.')[0] or n}: {problem(n, row)}" + (f", ranks {row.ranks}" if row.ranks else "")
             + ")" for n, row in bad[:most]]
    more = f", and {len(bad) - most} more" if len(bad) > most else ""
    return f"first diverging parameter gradients (step {step}, in backward order): {'; '.join(shown)}{more}"
