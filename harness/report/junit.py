"""Read pytest's junit XML back into one record per test, with the cell's ``parity`` property.

The plugin records one JSON user property per cell (``harness.fixture.cell_record``): its
coordinates in the matrix (component, impl, mesh, dtype, switches) and its outcome (status, kind,
worst err/tol, tensor, norm ratio, golden status, seconds). pytest writes it into the XML as
``<property name="parity" value="{json}"/>``; everything the reports show comes from there and from
the failure and skip messages, so a report can be made from the CI artifact alone. The library
versions that ran are a testsuite-level property (``harness.versions``), once per run.
"""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from ..record import PROPERTY
from ..versions import PROPERTY as VERSIONS
from ..versions import Library, from_json


@dataclass
class TestCase:
    """One ``<testcase>``: a cell of the matrix when ``record`` is set, else another test."""

    __test__ = False  # not a pytest test class, whatever its name

    classname: str
    name: str
    outcome: str  # passed, failed, error, skipped
    seconds: float
    message: str = ""  # the failure/skip message (the skip reason)
    text: str = ""  # the failure's full text: the divergence table and the reproduce line
    file: str = ""  # from the xunit1 attributes when present, else derived from the classname
    line: int | None = None
    record: dict | None = None

    @property
    def nodeid(self) -> str:
        return f"{self.path}::{self.name}"

    @property
    def path(self) -> str:
        """The test file, relative to the rootdir (xunit2 only names the module: ``cases.test_tp``)."""
        return self.file or self.classname.replace(".", "/") + ".py"

    @property
    def cell(self) -> str:
        return self.record["cell"] if self.record else self.name

    @property
    def reproduce(self) -> str:
        """The ``reproduce:`` command of a failed cell, or ''."""
        found = re.search(r"^reproduce: (.+)$", self.text or self.message, re.M)
        return found.group(1).strip() if found else ""

    @property
    def skip_reason(self) -> str:
        return self.message.removeprefix("Skipped: ").strip() if self.outcome == "skipped" else ""


@dataclass
class Results:
    cases: list[TestCase] = field(default_factory=list)
    versions: list[Library] = field(default_factory=list)  # of the first file that records them

    @property
    def cells(self) -> list[TestCase]:
        return [c for c in self.cases if c.record is not None]

    @property
    def others(self) -> list[TestCase]:
        return [c for c in self.cases if c.record is None]

    def components(self) -> dict[str, list[TestCase]]:
        out: dict[str, list[TestCase]] = {}
        for case in self.cells:
            out.setdefault(case.record["component"], []).append(case)
        return dict(sorted(out.items()))


def _outcome(element: ET.Element) -> tuple[str, str, str]:
    for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        child = element.find(tag)
        if child is not None:
            return outcome, child.get("message", ""), child.text or ""
    return "passed", "", ""


def read(paths) -> Results:
    """Every testcase of every junit XML file in ``paths`` (pytest's xunit1 or xunit2 flavour)."""
    results = Results()
    for path in paths:
        root = ET.parse(Path(path)).getroot()
        for prop in (p for suite in root.iter("testsuite") for p in suite.findall("properties/property")):
            if prop.get("name") == VERSIONS and not results.versions:
                results.versions = from_json(prop.get("value", "[]"))
        for element in root.iter("testcase"):
            outcome, message, text = _outcome(element)
            record = None
            for prop in element.iter("property"):
                if prop.get("name") == PROPERTY:
                    record = json.loads(prop.get("value", "{}"))
            line = element.get("line")
            case = TestCase(classname=element.get("classname", ""), name=element.get("name", ""),
                            outcome=outcome, seconds=float(element.get("time", 0) or 0), message=message,
                            text=text, file=element.get("file", ""), line=int(line) + 1 if line else None,
                            record=record)
            if record is not None and outcome in ("failed", "error"):
                record["status"] = "failed"  # a setup/teardown error fails the cell too
            elif record is not None:
                record["status"] = outcome
            results.cases.append(case)
    return results
