"""What a model cell adds to its ``parity`` junit property, for ``python -m harness.report``.

``record["model"]``:

* ``losses``: ``{"reference": [...], "run": [...]}``, the loss of every step (steps from 1), read
  from the cell's comparison (a scalar's row holds both values);
* ``modules`` (failing cells run in the pool only): ``[[module, phase, step, err/tol], ...]``, every
  module event of a re-run with the hooks recording (:mod:`harness.model.hooks`), compared with the
  reference: ``fwd`` its output, ``bwd`` its input gradient; the worst err/tol of the event's
  tensors, ``null`` for an event that could not be compared. The report draws them as a module ×
  step heatmap, so the first diverging module is seen, not searched for.
"""
from __future__ import annotations

import math
import re

from ..config import Config

LOSS = re.compile(r"loss/step(\d+)")


def losses(report) -> dict[str, list[float]]:
    """Reference and run loss per step, from a comparison's rows."""
    found = {int(m.group(1)): row for row in report.rows
             if (m := LOSS.fullmatch(row.tensor)) and row.problem not in ("replicas", "missing", "shape")}
    steps = sorted(found)
    return {"reference": [found[s].expected for s in steps], "run": [found[s].actual for s in steps]}


def module_errors(cfg: Config, pool) -> list[list]:
    """Every module event of ``cfg`` compared with the reference: [module, phase, step, worst err/tol]."""
    from ..bisect.localise import localise

    out = []
    for finding in localise(cfg, pool, complete=True).findings:
        where = dict(re.findall(r"(\w+)=(\S+)", finding.key))
        rows = finding.outputs or finding.inputs
        ratio = max((r.ratio for r in rows), default=None) if not finding.note else None
        out.append([where.get("module", "?"), finding.key.split()[0], int(where.get("step", 0)),
                    None if ratio is None or not math.isfinite(ratio) else ratio])
    return out


def model_record(cfg: Config, report, pool=None) -> dict:
    """``{"model": {...}}`` for a model cell's junit property, ``{}`` for a component cell. ``pool``
    (the warm pool, for a failing cell) adds the per-module errors; never raises: the record is
    an extra, the verdict stands without it."""
    from ..pool.parent import Pool
    from .register import is_model

    if not is_model(cfg.component) or report is None:
        return {}
    data: dict = {"losses": losses(report)}
    if isinstance(pool, Pool) and not report.ok:
        try:
            data["modules"] = module_errors(cfg, pool)
        except Exception as error:  # noqa: BLE001  a report extra must not hide the failure
            data["modules_error"] = f"{type(error).__name__}: {error}"
    return {"model": data}
