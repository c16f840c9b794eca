"""``python -m harness.zoo transformers``: every shipped plan of the installed transformers, checked
against one process; a table of architecture × plan × mesh.

It runs the zoo's cells (:func:`harness.zoo.transformers.zoo_cells`) with pytest in a project of its
own in a temporary directory, with the pool and the junit record every cell run gets, and writes
``zoo.md`` (one row per cell: pass, red with its first line, crash with its cause, skip with its
reason) and ``zoo.json`` (the same, for comparing two transformers releases) under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TEST = '''\
import pytest

from harness.zoo.transformers import zoo_cells

CELLS = zoo_cells(only={only!r} or None, plans={plans!r})


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_zoo(cfg, parity):
    parity(cfg)
'''


def rows(junit: Path) -> list[dict]:
    """One row per cell of a zoo run's junit file: its id, verdict and the line that says why."""
    from harness.report.junit import read

    out = []
    for case in read([junit]).cells:
        record = case.record or {}
        status = record.get("status") or case.outcome
        kind = record.get("kind", "")
        verdict = {"passed": "pass", "skipped": "skip", "xfailed": "known"}.get(status) or \
            ("red" if kind in ("mismatch", "nan") else "crash")
        text = case.text or case.message or ""
        raised = re.search(r"^\s*rank \d+: (?:raised|died): (.+)$", text, re.M)
        why = {"skip": case.skip_reason, "red": record.get("where") or "",
               "crash": raised.group(1) if raised else (text.splitlines() or [""])[0]}.get(verdict, "")
        out.append({"cell": case.cell, "verdict": verdict, "why": why or ""})
    return sorted(out, key=lambda r: r["cell"])


def markdown(found: list[dict], versions: str) -> str:
    counts = {v: sum(r["verdict"] == v for r in found) for v in ("pass", "red", "crash", "skip", "known")}
    lines = [f"# transformers zoo ({versions})", "",
             ", ".join(f"{n} {v}" for v, n in counts.items()), "",
             "| cell | verdict | why |", "|---|---|---|"]
    lines += [f"| `{r['cell']}` | {r['verdict']} | {r['why'].replace('|', '/')} |" for r in found]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.zoo", description=__doc__.splitlines()[0])
    parser.add_argument("library", choices=["transformers"], help="whose zoo")
    parser.add_argument("--only", default="", help="model types, comma separated (default: every one with a plan)")
    parser.add_argument("--plans", default="tp,tpauto,ep", help="of tp, tpauto, ep (default: all three)")
    parser.add_argument("--out", type=Path, default=Path("zoo-out"), help="where zoo.md and zoo.json go")
    parser.add_argument("-n", default="auto", help="pytest-xdist workers (default: auto)")
    args = parser.parse_args(argv)
    plans = tuple(p for p in args.plans.split(",") if p)
    if bad := [p for p in plans if p not in ("tp", "tpauto", "ep")]:
        parser.error(f"--plans: unknown {', '.join(bad)}; give some of tp, tpauto, ep")
    only = [m for m in args.only.split(",") if m]
    args.out.mkdir(parents=True, exist_ok=True)
    junit = (args.out / "junit.xml").resolve()
    with tempfile.TemporaryDirectory(prefix="harness-zoo-") as project:
        (Path(project) / "test_zoo.py").write_text(TEST.format(only=only, plans=plans))
        (Path(project) / "pytest.ini").write_text("[pytest]\n")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", args.n,
                   f"--junitxml={junit}", "--case-deadline", "300", "test_zoo.py"]
        done = subprocess.run(command, cwd=project, env=os.environ.copy())
    found = rows(junit) if junit.exists() else []
    if done.returncode not in (0, 1) or not found:
        print(f"the zoo's pytest run ended with {done.returncode} and judged no cell (its output is above)",
              file=sys.stderr)
        return 2
    import transformers

    (args.out / "zoo.json").write_text(json.dumps({"transformers": transformers.__version__, "cells": found},
                                                  indent=1))
    (args.out / "zoo.md").write_text(markdown(found, f"transformers {transformers.__version__}"))
    print(f"zoo: {args.out / 'zoo.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
