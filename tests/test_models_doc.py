"""docs/models.md's ``ModelCase`` table, held to the dataclass: every field, in order, with its
default (``required`` for none; a value default as its ``repr``; a function's in words), so a field
added, renamed or given a new default fails here until the page says so."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from harness.model import ModelCase

PAGE = Path(__file__).resolve().parent.parent / "docs" / "models.md"


def table(text: str) -> list[tuple[str, str]]:
    """The rows of the page's ``ModelCase`` table: (field name, default column)."""
    section = text.split("## `ModelCase`", 1)[1].split("\n\n", 3)
    rows = next(block for block in section if block.startswith("| field"))
    out = []
    for line in rows.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out.append((re.match(r"`(\w+)", cells[0]).group(1), cells[1]))
    return out


def drift(text: str) -> list[str]:
    """What the page's table says that the dataclass does not (empty: they agree)."""
    rows = table(text)
    fields = dataclasses.fields(ModelCase)
    problems = []
    if [name for name, _ in rows] != [f.name for f in fields]:
        problems.append(f"fields: the page lists {[n for n, _ in rows]}, ModelCase has {[f.name for f in fields]}")
    documented = dict(rows)
    for f in fields:
        if f.name not in documented:
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        said = documented[f.name]
        if default is dataclasses.MISSING:
            want_ok, want = said == "required", "required"
        elif callable(default):
            want_ok, want = bool(said) and said != "required", "the default function, in words"
        else:
            want_ok, want = said == f"`{default!r}`", f"`{default!r}`"
        if not want_ok:
            problems.append(f"{f.name}: the page says {said!r}, the dataclass {want}")
    return problems


def test_the_modelcase_table_is_the_dataclass():
    assert drift(PAGE.read_text()) == []


def test_a_drifted_table_fails():
    text = PAGE.read_text()
    assert drift(text.replace("| `steps` | `3` |", "| `steps` | `4` |")) == [
        "steps: the page says '`4`', the dataclass `3`"]
    assert any("fields:" in p for p in drift(text.replace("| `fp32_ops` |", "| `fp64_ops` |")))
    assert drift(text.replace("| `mixed_precision` | `'autocast'` |", "| `mixed_precision` | none |")) == [
        "mixed_precision: the page says 'none', the dataclass `'autocast'`"]
