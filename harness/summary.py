"""The run's closing section: a summary per component, the most common skip reasons, the golden
files written or moved, the slowest cells and how busy each xdist worker was."""
from __future__ import annotations

from collections import Counter, defaultdict



class Summary:
    """Per component: outcomes, worst err/tol (failed cells included), goldens, time, skip reasons;
    and the slowest cells."""

    SLOWEST = 5  # cells listed by time at the end of a run, as --durations=5 would

    def __init__(self):
        # the golden columns are the Markdown report's (harness.report.markdown.COMPONENT_HEADERS)
        self.rows = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0, "worst err/tol": 0.0,
                                         "failed as": Counter(), "golden identical": 0, "golden within tol": 0,
                                         "golden written": 0, "seconds": 0.0})
        self.skips: dict[str, Counter] = defaultdict(Counter)
        self.moved: list[tuple[str, str]] = []
        self.written: list[str] = []
        self.times: list[tuple[float, str]] = []  # (seconds the plugin recorded, node id) of cells that ran

    def add(self, report, record: dict | None) -> None:
        """One test's report and the cell's record it carries (its call phase; None otherwise)."""
        if record is None:
            return
        row = self.rows[record["component"]]
        xfailed = report.skipped and hasattr(report, "wasxfail")  # a known divergence, as declared
        status = "failed" if report.failed else "xfailed" if xfailed else "skipped" if report.skipped \
            else record["status"]
        row[status] += 1
        row["seconds"] += report.duration
        if xfailed:
            return
        if status == "skipped":
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skips[record["component"]][reason.removeprefix("Skipped: ")] += 1
            return
        if status == "failed":
            row["failed as"][record["kind"] or "error"] += 1
        row["worst err/tol"] = max(row["worst err/tol"], record["ratio"])
        row["golden identical"] += record["golden"] == "identical"
        row["golden within tol"] += record["golden"] == "within tolerance"
        row["golden written"] += record["golden"] in ("written", "updated")
        self.times.append((record["seconds"], report.nodeid))
        if record["golden"] == "written":
            self.written.append(report.nodeid)
        if record["moved"]:
            self.moved.append((report.nodeid, record["moved"]))

    def table(self) -> str:
        """One row per component, columns right-aligned under their headers, the index's name on a
        line of its own (the layout pandas' ``to_string`` gives; pandas' import alone is 0.3 s of a
        one-cell run)."""

        def text(value) -> str:
            if isinstance(value, Counter):
                return ", ".join(f"{k} {n}" for k, n in value.most_common())
            return f"{value:.3g}" if isinstance(value, float) else str(value)

        names = sorted(self.rows)
        headers = list(self.rows[names[0]])
        cells = {name: [text(self.rows[name][h]) for h in headers] for name in names}
        widths = [max([len(h)] + [len(cells[name][i]) for name in names]) for i, h in enumerate(headers)]
        first = max(len("component"), *map(len, names))
        lines = [" " * first + "".join(f"  {h:>{w}}" for h, w in zip(headers, widths)), "component"]
        lines += [f"{name:<{first}}" + "".join(f"  {c:>{w}}" for c, w in zip(cells[name], widths)) for name in names]
        return "\n".join(line.rstrip() for line in lines)

    def slowest(self) -> list[str]:
        """The slowest cells that ran, one line each, slowest first."""
        return [f"{seconds:8.2f}s  {nodeid}" for seconds, nodeid in sorted(self.times, reverse=True)[:self.SLOWEST]]

    def write(self, tr, timeline=None) -> None:
        """The ``parity summary`` section on the terminal reporter ``tr``."""
        if not self.rows:
            return
        tr.section("parity summary")
        from .versions import line

        tr.write_line(f"versions: {line()}")
        tr.write_line(self.table())
        tr.write_line("(worst err/tol counts failed cells too; seconds: time spent in the component's cells)")
        for component, reasons in sorted(self.skips.items()):
            for reason, count in reasons.most_common(3):
                tr.write_line(f"skipped {component} x{count}: {reason}")
            if len(reasons) > 3:
                tr.write_line(f"skipped {component}: {len(reasons) - 3} other reasons")
        if self.written:
            tr.write_line(f"golden files written for {len(self.written)} cells that had none: "
                          "review and commit them (golden/)")
        for nodeid, table in self.moved:
            tr.write_line(f"golden updated, what moved: {nodeid}\n{table}")
        if self.times:
            tr.write_line("slowest cells (seconds in the cell: its ranks' run, the reference, comparison, golden):")
            for row in self.slowest():
                tr.write_line(row)
        if timeline is not None and len(timeline.workers) > 1:
            tr.write_line("workers (seconds from the session's start):")
            for row in timeline.lines():
                tr.write_line(f"  {row}")
