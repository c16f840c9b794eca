"""What a failing cell prints: one screen.

Its table shows at most :data:`TABLE_ROWS` rows, every line at most :data:`WIDTH` columns (the whole
table is in the cell's junit record), and cells that fail alike are printed once (:class:`Alike`).
"""
from __future__ import annotations

import re
import textwrap

TABLE_ROWS = 12
WIDTH = 120

# what differs between cells failing alike on different meshes: the factor and the groups that make
# it (x 1/2 = 1/dp at dp=2, x 1/4 = 1/rep·dp (the world) at rep=2,dp=2) and the ranks that hold it
_VARIES = re.compile(r"x (1/)?\d+( = (1/)?[\w·]+( or (1/)?[\w·]+)*)?( \(the world\))?|ranks? \[?\d+(, ?\d+)*\]?")


def fitted(text: str, width: int = WIDTH) -> str:
    """``text`` with every line longer than ``width`` that starts a sentence wrapped at spaces, its
    continuation two spaces in; lines that start with a space (tables, tracebacks) and commands
    (``reproduce:``) are left whole, so that a pasted command stays one line."""

    def fit(line: str) -> str:
        if len(line) <= width or line[:1].isspace() or line.startswith("reproduce:"):
            return line
        return textwrap.fill(line, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)

    return "\n".join(fit(line) for line in text.splitlines())


def first_line(text: str) -> str:
    """The first line of ``text`` whole, as it was before :func:`fitted` wrapped it."""
    lines = text.splitlines() or [""]
    whole = [lines[0]]
    for line in lines[1:]:
        if not (line.startswith("  ") and line[2:3].strip()):
            break
        whole.append(line[2:])
    return " ".join(whole)


def live_line(record: dict, report, width: int = WIDTH) -> str:
    """The line a failing cell prints the moment it fails, before the run's failures section: its id
    and where its diagnosis says it starts (else the failure's own first line), cut to ``width``."""
    detail = record.get("where") or first_line(report.longreprtext)
    line = f"FAILED {record['cell']}: {detail}"
    return line if len(line) <= width else line[:width - 3] + "..."


class Alike:
    """The failures of a run, each way of failing printed once: the first cell in full, with the ids
    of the others; each other in a line that names it. A way of failing: the component, the
    implementation and where the cell's diagnosis says it starts (its record's ``where``), whatever
    the factor and the ranks."""

    def __init__(self):
        self.first: dict[tuple, tuple] = {}  # way -> (its first report, that cell's id)
        self.others: dict[tuple, list[str]] = {}

    def add(self, report, record: dict | None) -> None:
        """One test's report, and its cell's record when it has one: a later failure of a way
        already seen is shortened to its line."""
        where = (record or {}).get("where")
        if not (report.failed and report.when == "call" and where):
            return
        way = (record["component"], record["impl"], _VARIES.sub("#", where))
        if way not in self.first:
            self.first[way] = (report, record["cell"])
            return
        self.others.setdefault(way, []).append(record["cell"])
        rerun = [line for line in report.longreprtext.splitlines() if line.startswith("reproduce:")][:1]
        report.longrepr = "\n".join([fitted(f"{record['cell']} fails as {self.first[way][1]} does (printed in "
                                            f"full): {where}")] + rerun)

    def close(self) -> None:
        """Name the others under each first failure."""
        for way, others in self.others.items():
            report = self.first[way][0]
            report.longrepr = report.longreprtext + "\n" + fitted(
                f"{len(others)} more cells fail alike (printed once, here): {', '.join(others)}")
