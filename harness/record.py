"""A cell's record: the one JSON property (``parity``) each cell leaves in the junit XML, what
``harness.report`` and the run's summary read. No pytest here: the report reads it from XML alone."""
from __future__ import annotations

import json

from .config import Config

PROPERTY = "parity"


def cell_record(cfg: Config) -> dict:
    """What the plugin records of a cell (the ``parity`` user property, JSON): its coordinates in
    the matrix, then its outcome, filled in as the cell runs."""
    return {"cell": cfg.id, "component": cfg.component, "impl": cfg.impl,
            "mesh": ".".join(f"{k}{v}" for k, v in cfg.mesh), "dtype": cfg.dtype, "switches": dict(cfg.switches),
            "status": "failed", "kind": "", "ratio": 0.0, "tensor": "", "norm_ratio": 1.0, "golden": "",
            "moved": "", "seconds": 0.0, "where": ""}


def record_of(report) -> dict | None:
    """The cell's record a test's report carries (its call phase), or None."""
    prop = dict(report.user_properties).get(PROPERTY)
    return json.loads(prop) if prop is not None and report.when == "call" else None


def worst(report) -> dict:
    """The worst tensor of a comparison: its err/tol ratio, name and norm ratio."""
    rows = report.rows if report else []
    if not rows:
        return {}
    row = max(rows, key=lambda r: r.ratio)
    return {"ratio": row.ratio, "tensor": row.tensor, "norm_ratio": row.norm_ratio}
