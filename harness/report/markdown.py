"""Reports of a matrix run for a pull request, from pytest's junit XML alone.

    python -m harness.report --junit reports/cases.xml reports/tests.xml --out reports \\
        [--golden-diff reports/golden-diff.md] [--annotate] [--step-summary "$GITHUB_STEP_SUMMARY"]

writes to ``--out``:

* ``summary.md``: the headline, the library versions that ran (a warning first when one is not
  its pin), per component passed / failed / skipped, worst err/tol and time,
  golden drift, each divergence with its table and its reproduce command, skip reasons grouped;
  appended to ``--step-summary`` (in CI ``$GITHUB_STEP_SUMMARY``), else printed to stdout;
* ``heatmap-<component>.png``: worst err/tol over mesh x (dtype, switches), failures marked;
* ``losses-<model>.png`` and ``modules-<cell>.png`` for whole-model cells (``harness/report/models.py``);
* ``report.html``: all of them in one self-contained page (the PNGs embedded), for the artifact.

``--annotate`` prints a GitHub ``::error`` workflow command per failing cell (file and line of its
test function, the cell id in the title) to stdout, which the runner turns into PR annotations.
The exit status is 0 whatever the cells did: the pytest steps are the gate.
"""
from __future__ import annotations

import argparse
import base64
import html
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..versions import line, mismatch_warning
from .junit import Results, TestCase, read

MAX_DETAILED = 20  # divergences shown with their full table; the rest are in the table of failures
MAX_ANNOTATIONS = 10  # GitHub shows at most 10 error annotations per step


# ---- a small document model, rendered as Markdown and as HTML ---------------------------------
@dataclass
class Doc:
    blocks: list[tuple] = field(default_factory=list)

    def heading(self, level: int, text: str):
        self.blocks.append(("h", level, text))

    def para(self, text: str):
        self.blocks.append(("p", text))

    def table(self, headers: list[str], rows: list[list], align: str = ""):
        self.blocks.append(("table", headers, rows, align))

    def pre(self, text: str, lang: str = "text"):
        self.blocks.append(("pre", text, lang))

    def image(self, path: Path, alt: str):
        self.blocks.append(("img", Path(path), alt))

    def markdown_block(self, text: str):
        """Markdown made elsewhere (the golden diff): as it is in Markdown, preformatted in HTML."""
        self.blocks.append(("md", text))

    def markdown(self) -> str:
        out = []
        for block in self.blocks:
            kind = block[0]
            if kind == "h":
                out.append("#" * block[1] + " " + block[2])
            elif kind == "p":
                out.append(block[1])
            elif kind == "table":
                _, headers, rows, align = block
                out.append("| " + " | ".join(headers) + " |")
                out.append("|" + "|".join("---:" if a == "r" else "---" for a in align.ljust(len(headers), "l")) + "|")
                out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
            elif kind == "pre":
                out.append(f"```{block[2]}\n{block[1].rstrip()}\n```")
            elif kind == "img":
                out.append(f"![{block[2]}]({block[1].name})")
            elif kind == "md":
                out.append(block[1].rstrip())
            out.append("")
        return "\n".join(out)

    def html(self, title: str) -> str:
        out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
               "<style>body{font-family:sans-serif;max-width:1300px;margin:1em auto;padding:0 1em}"
               "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px}"
               "td.r{text-align:right}pre{background:#f6f8fa;padding:8px;overflow-x:auto}"
               "img{max-width:100%;border:1px solid #eee}</style></head><body>"]
        for block in self.blocks:
            kind = block[0]
            if kind == "h":
                out.append(f"<h{block[1]}>{_inline(block[2])}</h{block[1]}>")
            elif kind == "p":
                out.append(f"<p>{_inline(block[1])}</p>")
            elif kind == "table":
                _, headers, rows, align = block
                align = align.ljust(len(headers), "l")
                out.append("<table><tr>" + "".join(f"<th>{_inline(h)}</th>" for h in headers) + "</tr>")
                for row in rows:
                    out.append("<tr>" + "".join(f"<td class='{a}'>{_inline(str(c))}</td>" for a, c in zip(align, row))
                               + "</tr>")
                out.append("</table>")
            elif kind in ("pre", "md"):
                out.append(f"<pre>{html.escape(block[1].rstrip())}</pre>")
            elif kind == "img":
                data = base64.b64encode(block[1].read_bytes()).decode()
                out.append(f"<p><img alt='{html.escape(block[2])}' src='data:image/png;base64,{data}'></p>")
        out.append("</body></html>")
        return "\n".join(out)


def _inline(text: str) -> str:
    """Markdown's inline code and bold, in HTML."""
    text = html.escape(text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", text)


# ---- the summary -----------------------------------------------------------------------------
def _ratio(value) -> str:
    return f"{value:.3g}" if value is not None else ""


def component_rows(results: Results) -> list[list]:
    """Per component: passed, failed, skipped, worst err/tol (failed cells too), how they failed,
    goldens identical / written, seconds."""
    rows = []
    for name, cases in results.components().items():
        count = Counter(c.record["status"] for c in cases)
        ran = [c for c in cases if c.record["status"] != "skipped"]
        failed_as = Counter(c.record["kind"] or "error" for c in cases if c.record["status"] == "failed")
        golden = Counter(c.record.get("golden", "") for c in ran)
        rows.append([f"`{name}`", count["passed"], count["failed"], count["skipped"],
                     _ratio(max((c.record.get("ratio") or 0.0 for c in ran), default=0.0)),
                     ", ".join(f"{k} {n}" for k, n in failed_as.most_common()),
                     golden["identical"], golden["within tolerance"], golden["written"] + golden["updated"],
                     f"{sum(c.seconds for c in cases):.1f}"])
    return rows


COMPONENT_HEADERS = ["component", "passed", "failed", "skipped", "worst err/tol", "failed as",
                     "golden identical", "golden within tol", "golden written", "seconds"]


# harness.compare.diff's WHOLE_TABLE and COLUMNS: a shortened failure table's last line, the table's
# columns (not imported: the report reads junit alone, without torch; tests/test_report.py holds them equal)
WHOLE_TABLE = "in its junit record (python -m harness.report)"
TABLE_COLUMNS = ("tensor", "problem", "worst index", "actual", "expected", "abs err", "rel err", "tol", "err/tol",
                 "norm ratio", "bad", "bad ranks")


def table_rows(text: str) -> list[dict[str, str]]:
    """The rows of the divergence table(s) in a failure text (pandas right-aligns every column, so
    a column ends where its header ends; empty cells stay empty)."""
    rows, ends = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("tensor ") and "norm ratio" in line:
            ends, at = [], 0
            try:
                for name in TABLE_COLUMNS:
                    at = line.index(name, at) + len(name)
                    ends.append(at)
            except ValueError:  # a table of another shape: read nothing rather than misread it
                ends = None
            continue
        if ends is None or not line.strip() or line.startswith("reproduce:"):
            ends = None if line.startswith("reproduce:") else ends
            continue
        starts = [0] + ends[:-1]
        rows.append({name: line[a:b].strip() for name, a, b in zip(TABLE_COLUMNS, starts, ends[:-1] + [len(line)])})
    return rows


def _norm_ratio(case: TestCase) -> str:
    """The norm ratio of the worst wrong-valued tensor (a scaling bug's signature). The recorded
    worst row may be a ``replicas`` row, whose norm ratio says nothing."""
    wrong = [r for r in table_rows(_failure_text(case)) if r["problem"] in ("mismatch", "nan/inf")]
    try:
        worst = max(wrong, key=lambda r: float(r["err/tol"]))
        return f"{float(worst['norm ratio']):.4g} (`{worst['tensor']}`)"
    except ValueError:  # no such row, or a value that is not a number
        r = case.record or {}
        return _ratio(r.get("norm_ratio")) if r.get("tensor") else ""


def _failure_line(case: TestCase) -> list:
    r = case.record or {}
    return [f"`{case.cell}`", r.get("kind") or case.outcome, f"`{r['tensor']}`" if r.get("tensor") else "",
            _ratio(r.get("ratio")) if r.get("ratio") else "", _norm_ratio(case)]


def _failure_text(case: TestCase) -> str:
    """The failure as the run printed it, with the whole table where the run showed its first rows."""
    text = case.text.strip() or case.message.strip()
    whole = (case.record or {}).get("table")
    if not whole:
        return text
    lines = text.splitlines()
    head = next((i for i, line in enumerate(lines) if line.lstrip().startswith("tensor ")), None)
    tail = next((i for i, line in enumerate(lines) if line.startswith("... ") and line.endswith(WHOLE_TABLE)), None)
    if head is None or tail is None:
        return text
    return "\n".join(lines[:head] + whole.splitlines() + lines[tail + 1:])


def summary(results: Results, golden_diff: str = "", heatmaps: dict[str, Path] | None = None,
            for_html: bool = False, figures: dict[str, Path] | None = None) -> Doc:
    """The report as a document: headline first, so a red PR says so in its first screen."""
    doc = Doc()
    cells = results.cells
    failed = sorted((c for c in cells if c.record["status"] == "failed"),
                    key=lambda c: (-(c.record.get("ratio") or 0.0), c.cell))
    others_failed = [c for c in results.others if c.outcome in ("failed", "error")]
    skipped = sum(c.record["status"] == "skipped" for c in cells)
    if failed or others_failed:
        head = f"❌ Parity: {len(failed)} of {len(cells)} cells failed"
        head += f", {len(others_failed)} other tests failed" if others_failed else ""
    elif not cells:  # a --changed run whose change moves no cell: a pass, said as what it is
        head = "✅ Parity: no cell ran (the run selected none)"
    else:
        head = f"✅ Parity: all {len(cells) - skipped} cells that ran passed"
    doc.heading(2, head + (f" ({skipped} skipped)" if skipped else ""))
    if results.versions:
        warning = mismatch_warning(results.versions)
        if warning:
            doc.para("⚠️ **" + warning.removeprefix("WARNING: ") + "**")
        doc.para(f"**Versions:** {line(results.versions)}")
    if golden_diff.strip():
        doc.para("**Goldens:** " + golden_diff.strip().splitlines()[0].lstrip("# ").strip())
    if cells:
        doc.table(COMPONENT_HEADERS, component_rows(results), "lrrrrlrrrr")
        doc.para("worst err/tol counts failed cells too (≥ 1 fails); seconds: time spent in the component's cells.")
    if results.others:
        count = Counter(c.outcome for c in results.others)
        doc.para(f"Harness tests: {count['passed']} passed, {count['failed'] + count['error']} failed, "
                 f"{count['skipped']} skipped.")
    if failed:
        doc.heading(3, "Failing cells")
        doc.table(["cell", "how", "worst tensor", "err/tol", "norm ratio"], [_failure_line(c) for c in failed],
                  "lllrr")
        for case in failed[:MAX_DETAILED]:
            doc.heading(4, f"`{case.cell}`")
            doc.pre(_failure_text(case))
            if case.reproduce:
                doc.pre(case.reproduce, "sh")
        if len(failed) > MAX_DETAILED:
            doc.para(f"{len(failed) - MAX_DETAILED} more failing cells: their tables are in the junit XML "
                     "and report.html (artifact).")
    if others_failed:
        doc.heading(3, "Failing harness tests")
        for case in others_failed:
            doc.heading(4, f"`{case.nodeid}`")
            doc.pre(_failure_text(case)[-3000:])
    if heatmaps:
        doc.heading(3, "Heatmaps")
        if for_html:
            for name, path in heatmaps.items():
                doc.image(path, f"{name} heatmap")
        else:
            doc.para("worst err/tol over mesh × (dtype, switches), failures red: "
                     + ", ".join(f"`{p.name}`" for p in heatmaps.values()) + " in the `parity-report` artifact.")
    if figures:
        doc.heading(3, "Whole models")
        if for_html:
            for name, path in figures.items():
                doc.image(path, name)
        else:
            doc.para("loss per step of the reference and of every mesh, and for each failing model cell its "
                     "module × step err/tol: " + ", ".join(f"`{p.name}`" for p in figures.values())
                     + " in the `parity-report` artifact.")
    skips = Counter((c.record["component"], c.skip_reason) for c in cells if c.record["status"] == "skipped")
    if skips:
        doc.heading(3, "Skipped, by reason")
        doc.table(["component", "cells", "reason"],
                  [[f"`{comp}`", n, reason] for (comp, reason), n in sorted(skips.items(), key=lambda kv: (kv[0][0], -kv[1]))],
                  "lrl")
    if golden_diff.strip():
        doc.heading(3, "Golden drift")
        doc.markdown_block(golden_diff)
    return doc


# ---- annotations -----------------------------------------------------------------------------
def _escape(text: str, prop: bool = False) -> str:
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if prop else text


def _test_line(case: TestCase, root: Path) -> int | None:
    """The line of the test function that ran the cell (xunit2 records no line)."""
    if case.line:
        return case.line
    function = case.name.partition("[")[0]
    try:
        source = (root / case.path).read_text().splitlines()
    except OSError:
        return None
    for number, text in enumerate(source, 1):
        if re.match(rf"\s*(async\s+)?def {re.escape(function)}\(", text):
            return number
    return None


def annotations(results: Results, root: Path = Path(".")) -> list[str]:
    """``::error`` workflow commands for the failing cells (worst first) and failing other tests."""
    failed = sorted((c for c in results.cases if c.outcome in ("failed", "error")),
                    key=lambda c: (c.record is None, -((c.record or {}).get("ratio") or 0.0), c.cell))
    out = []
    for case in failed[:MAX_ANNOTATIONS]:
        line = _test_line(case, root)
        where = f"file={_escape(case.path, True)}" + (f",line={line}" if line else "")
        r = case.record
        if r:
            title = f"parity {r.get('kind') or 'failure'}: {case.cell}"
            first = (f"worst tensor {r['tensor']}: err/tol {r['ratio']:.3g}; norm ratio {_norm_ratio(case).replace('`', '')}"
                     if r.get("tensor") else _failure_text(case).splitlines()[0] if _failure_text(case) else "")
            message = first + (f"\nreproduce: {case.reproduce}" if case.reproduce else "")
        else:
            title, message = f"test failed: {case.nodeid}", _failure_text(case)[-1500:]
        out.append(f"::error {where},title={_escape(title, True)}::{_escape(message)}")
    if len(failed) > MAX_ANNOTATIONS:
        out.append(f"::error title=parity::{len(failed) - MAX_ANNOTATIONS} more failing tests: see the job summary")
    return out


# ---- the command -----------------------------------------------------------------------------
def write_reports(results: Results, out: Path, golden_diff: str = "") -> dict[str, Path]:
    """summary.md, heatmap-<component>.png, the model figures (``losses-<model>.png``,
    ``modules-<cell>.png``) and report.html under ``out``; returns their paths."""
    from .heatmap import grid, render
    from .models import write_figures

    out.mkdir(parents=True, exist_ok=True)
    heatmaps = {}
    for name, cases in results.components().items():
        heatmaps[name] = out / f"heatmap-{name}.png"
        render(grid(name, [c.record for c in cases]), heatmaps[name])
    figures = write_figures({name: [c.record for c in cases] for name, cases in results.components().items()}, out)
    paths = {"summary": out / "summary.md", "html": out / "report.html", **{f"heatmap-{k}": v for k, v in heatmaps.items()},
             **figures}
    paths["summary"].write_text(summary(results, golden_diff, heatmaps, figures=figures).markdown())
    paths["html"].write_text(summary(results, golden_diff, heatmaps, for_html=True, figures=figures).html("parity report"))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--junit", nargs="+", required=True, type=Path, help="pytest --junitxml files")
    parser.add_argument("--out", required=True, type=Path, help="directory for summary.md, heatmaps, report.html")
    parser.add_argument("--golden-diff", type=Path, help="Markdown from `python -m harness.golden diff`, included")
    parser.add_argument("--annotate", action="store_true",
                        help="print a GitHub ::error command per failing cell (to stdout)")
    parser.add_argument("--step-summary", type=Path,
                        help="append the Markdown summary to this file (CI: $GITHUB_STEP_SUMMARY) instead of stdout")
    parser.add_argument("--root", type=Path, default=Path("."), help="the pytest rootdir (for annotation lines)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.junit if not p.exists()]
    if missing:
        parser.error(f"no junit XML at {', '.join(missing)} (did the pytest step run with --junitxml?)")
    results = read(args.junit)
    golden_diff = args.golden_diff.read_text() if args.golden_diff and args.golden_diff.exists() else ""
    paths = write_reports(results, args.out, golden_diff)
    if args.step_summary:
        with open(args.step_summary, "a") as f:
            f.write(paths["summary"].read_text())
    else:
        sys.stdout.write(paths["summary"].read_text())
    if args.annotate:
        for line in annotations(results, args.root):
            print(line)
    return 0

