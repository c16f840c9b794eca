"""docs/api.md, the public API in one place, held to what is installed: every name imports, every
command answers ``--help``, every pytest option and fixture is there; from a project of its own (a
temporary directory, subprocesses), as a user meets them. And what README and docs/ import is on
the page, so the page cannot fall behind them."""
from __future__ import annotations

import re

import pytest

from tests.project import ROOT, UserProject

PAGE = ROOT / "docs" / "api.md"


def names(text: str) -> dict[str, list[str]]:
    """module -> its names, from the page's Python table."""
    section = text.split("## Python", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`harness"):
            out[cells[0].strip("`")] = re.findall(r"`(\w+)`", cells[1])
    return out


def commands(text: str) -> list[str]:
    return re.findall(r"^\| `python -m ([\w.]+)`", text.split("## Commands", 1)[1], re.M)


@pytest.fixture
def project(tmp_path):
    """A directory of the user's own, without a pytest.ini."""
    return UserProject(tmp_path / "project", ini=False)


def test_every_name_on_the_page_imports(project):
    listed = names(PAGE.read_text())
    assert len(listed) >= 8 and "harness.model" in listed
    script = "\n".join(f"from {module} import {', '.join(found)}" for module, found in listed.items())
    done = project.run("python", "-W", "error::DeprecationWarning", "-c", script, timeout=300)
    assert done.returncode == 0, done.tail


def test_every_command_on_the_page_answers_help(project):
    found = commands(PAGE.read_text())
    assert len(found) >= 7
    for module in found:
        done = project.run("python", "-m", module, "--help", timeout=300)
        assert done.returncode == 0 and "usage" in done.stdout.lower(), (module, done.tail)


def test_every_pytest_option_and_fixture_on_the_page_is_there(user_project):
    text = PAGE.read_text().split("## pytest", 1)[1]
    options = re.findall(r"`(--[\w-]+)`", text)
    fixtures = re.findall(r"`(\w+)`", text.split("Fixtures:", 1)[1])
    shown = user_project.run("python", "-m", "pytest", "--help", "-p", "no:cacheprovider", timeout=300).stdout
    assert len(options) >= 10 and all(o in shown for o in options), [o for o in options if o not in shown]
    listed = user_project.run("python", "-m", "pytest", "--fixtures", "-p", "no:cacheprovider", timeout=300).stdout
    assert fixtures and all(re.search(rf"^{f}\b", listed, re.M) for f in fixtures), listed[-2000:]


def test_what_the_docs_import_is_on_the_page():
    listed = names(PAGE.read_text())
    shown = {p.name: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             if p.name != "api.md"}
    missing = []
    for page, text in shown.items():
        for module, imported in re.findall(r"from (harness[\w.]*) import ([\w, ()]+)", text):
            for name in re.findall(r"\w+", imported):
                if name not in listed.get(module, []):
                    missing.append(f"{page}: from {module} import {name}")
        for module in re.findall(r"python -m (harness(?:\.\w+)+)", text):
            if module not in commands(PAGE.read_text()):
                missing.append(f"{page}: python -m {module}")
    assert not missing, missing


def test_a_name_dropped_from_the_code_fails(project):
    """The import check can fail: a name the code does not have is an ImportError."""
    done = project.run("python", "-c", "from harness.model import ModelCaseOld", timeout=300)
    assert done.returncode != 0 and "ImportError" in done.stderr
