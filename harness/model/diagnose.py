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
  the report draws as a module × step heatmap.
"""
from __future__ import annotations

import math
import re

from ..bisect.localise import localise
from ..config import Config
from ..names import grad_name, parse
from ..registry import Diagnosis
from .batches import start_model
from .case import ModelCase


def diagnose(case: ModelCase, cfg: Config, pool, report, rerun: bool) -> Diagnosis:
    """The diagnosis of a model cell: losses always; for a failing cell, the first diverging
    parameter gradients and, when ``rerun`` and ``pool`` can run it again, the module events."""
    record: dict = {"losses": losses(report)}
    if report.ok:
        return Diagnosis(record={"model": record})
    lines = []
    if rerun and pool.can_rerun:
        try:
            found = localise(cfg, pool, complete=True)
        except Exception as error:  # noqa: BLE001  the diagnosis must not hide the failure
            record["modules_error"] = f"{type(error).__name__}: {error}"
        else:
            record["modules"] = module_rows(found)
            lines = first_module(found)
    gradients = first_gradients(case, cfg, report)
    return Diagnosis("\n".join(lines + ([gradients] if gradients else [])), {"model": record})


def losses(report) -> dict[str, list[float]]:
    """Reference and run loss per step, from a comparison's rows."""
    found = {name.step: row for row in report.rows
             if (name := parse(row.tensor)).kind == "loss" and row.problem not in ("replicas", "missing", "shape")}
    steps = sorted(found)
    return {"reference": [found[s].expected for s in steps], "run": [found[s].actual for s in steps]}


def module_rows(found) -> list[list]:
    """Every module event of a localisation: [module, phase, step, worst err/tol or None]."""
    out = []
    for finding in found.findings:
        where = dict(re.findall(r"(\w+)=(\S+)", finding.key))
        rows = finding.outputs or finding.inputs
        ratio = max((r.ratio for r in rows), default=None) if not finding.note else None
        out.append([where.get("module", "?"), finding.key.split()[0], int(where.get("step", 0)),
                    None if ratio is None or not math.isfinite(ratio) else ratio])
    return out


def module_of(key: str) -> str:
    """``"bwd module microbatch=0 module=layers.1.mlp step=1 #2"`` -> ``"layers.1.mlp (input gradient, step 1, microbatch 0)"``."""
    where = dict(re.findall(r"(\w+)=(\S+)", key))
    phase = "output" if key.startswith("fwd") else "input gradient"
    return f"{where.get('module', '?')} ({phase}, step {where.get('step', '?')}, microbatch {where.get('microbatch', '?')})"


def first_module(found) -> list[str]:
    """The first module whose output (forward) or input gradient (backward) diverges, and whether its
    inputs still matched; then the localisation's own summary."""
    first = found.first_diverging
    if first is not None and first.starts_here:
        line = (f"first diverging module: {module_of(first.key)}: its inputs still match the reference, "
                "its outputs do not")
    elif first is not None:
        before = f" after {module_of(found.last_matching)}" if found.last_matching else ""
        line = (f"first diverging module: {module_of(first.key)}; what it received already differs: the "
                f"divergence starts{before} in code no module hook sees (between modules, the loss, a hook)")
    elif found.compared == 0:
        line = ("first diverging module: not known: no module's tensors could be placed on the mesh to compare "
                "(a pipeline's microbatches are not slices of the global batch)")
    else:
        line = ("first diverging module: none: every module's outputs and input gradients match the reference, "
                "so the divergence is in the gradient reduction, the optimizer step or the loss reduction")
    return [line, found.summary()]


def first_gradients(case: ModelCase, cfg: Config, report, most: int = 3) -> str:
    """The parameters whose step-1 gradient diverges, in the order backward computes them (the last
    module's first), each with its module and what is wrong; "" when every gradient matches."""
    failing = {row.tensor: row for row in report.failing()}
    names = [n for n, _ in start_model(case, cfg).named_parameters()]
    bad = [(n, failing[grad_name(n)]) for n in reversed(names) if grad_name(n) in failing]
    if not bad:
        return ""
    shown = [f"{n} (module {n.rpartition('.')[0] or n}: {row.problem}, norm ratio {row.norm_ratio:.4g}"
             + (f", ranks {row.ranks}" if row.ranks else "") + ")" for n, row in bad[:most]]
    more = f", and {len(bad) - most} more" if len(bad) > most else ""
    return f"first diverging parameter gradients (step 1, in backward order): {'; '.join(shown)}{more}"
