"""Docs that cannot drift: docs/models.md's "The API in full" held to the code, and docs/design/'s
notes held to the repository.

* Every function of the section is there with its signature as ``inspect.signature`` gives it
  (parameter names, kinds and defaults; annotations left out), and every dataclass field of
  ``Meshes`` and ``MeshSpec`` is named in backticks, so a parameter added, renamed or given a new
  default fails here until the page says so.
* The design notes are records as of their issue, but they hold no path of the machine they were
  written on, and every repository path or dotted module name they mention exists now: moved ones
  are given as they are now, gone ones are marked ``(gone now``; ``(then `old path`)`` names a path
  as it was. README links the notes' first page once and no note by itself.
"""
from __future__ import annotations

import ast
import dataclasses
import fnmatch
import importlib
import inspect
import re
import subprocess
from functools import lru_cache
from pathlib import Path

from harness.meshes import Meshes, MeshSpec
from harness.model import cell_dir, model_cells, register_model, running, switches

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "docs" / "models.md"
DESIGN = ROOT / "docs" / "design"
SECTION = "## The API in full"

FUNCTIONS = (register_model, model_cells, cell_dir, switches, running, Meshes.mesh, Meshes.group, Meshes.renamed)
DERIVED = {MeshSpec: ("efsdp",)}  # properties the section names with the fields


# ---- "The API in full" --------------------------------------------------------------------------
def section(text: str) -> str:
    """The text of the section, up to the next ``## `` heading."""
    assert SECTION + "\n" in text, f"docs/models.md has no section {SECTION!r}"
    return text.split(SECTION + "\n", 1)[1].split("\n## ", 1)[0]


def rendered(fn) -> str:
    """``name(params)``: ``fn``'s signature as ``inspect.signature`` gives it, without annotations
    (and without ``self``)."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values() if p.name != "self"]
    return fn.__name__ + str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def api_drift(text: str) -> list[str]:
    """What the section says that the code does not (empty: they agree)."""
    body = section(text)
    problems = [f"{rendered(fn)} is not in the section" for fn in FUNCTIONS if f"`{rendered(fn)}`" not in body]
    for cls in (Meshes, MeshSpec):
        for name in [f.name for f in dataclasses.fields(cls)] + list(DERIVED.get(cls, ())):
            if f"`{name}`" not in body:
                problems.append(f"{cls.__name__}.{name} is not named in backticks in the section")
    for dotted in re.findall(r"`(harness(?:\.\w+)+)`", body):
        module, _, attr = dotted.rpartition(".")
        try:
            importlib.import_module(dotted)
        except ImportError:
            try:
                getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError):
                problems.append(f"{dotted} does not import")
    return problems


def test_the_api_section_is_the_code():
    assert api_drift(MODELS.read_text()) == []


def test_the_api_section_sits_before_a_cell_is_a_world():
    text = MODELS.read_text()
    assert text.index(SECTION) < text.index("## Your training code, unchanged: a cell is a world")


def test_a_drifted_api_section_fails():
    text = MODELS.read_text()
    sig = rendered(model_cells)
    assert sig.endswith("seed=0)")
    assert api_drift(text.replace(sig, sig.replace("seed=0)", "seed=1)"))) == [f"{sig} is not in the section"]
    renamed = rendered(register_model).replace("deadline_factor", "deadline")
    assert api_drift(text.replace(rendered(register_model), renamed)) == [
        f"{rendered(register_model)} is not in the section"]
    assert api_drift(text.replace("| `flat` |", "| flat |")) == ["Meshes.flat is not named in backticks in the section"]
    assert api_drift(text.replace("`harness.meshes.MeshSpec`", "`harness.meshes.spec.MeshSpec`")) == [
        "harness.meshes.spec.MeshSpec does not import"]


# ---- docs/design/ ---------------------------------------------------------------------------------
MACHINE = re.compile(r"/work/|/tmp/|/home/|/root/|\.venv")
ROOTS = r"(?:harness|parallel|models|reference|cases|tests|golden|docs|\.github|\.ci)"
# a repository path: a root and what follows it, `<placeholder>`s and globs included
PATH = re.compile(rf"(?<![\w./<>-]){ROOTS}/(?:[\w.*/<>\[\]-]*[\w*>/])?")
# a dotted module name, with an optional ``:attribute``
DOTTED = re.compile(r"(?<![\w./-])(?:harness|parallel|models|reference|cases)(?!\.(?:md|py|toml|json|ya?ml)\b)"
                    r"(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")
GONE = re.compile(r"`?\s*\(gone now")
THEN = re.compile(r"\(then `?$")


@lru_cache(maxsize=1)
def tracked() -> tuple[frozenset[str], frozenset[str]]:
    """The files git tracks and the directories holding them."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    dirs = {"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}
    return frozenset(files), frozenset(dirs)


def path_exists(path: str) -> bool:
    files, dirs = tracked()
    path = re.sub(r"<[^>]*>", "*", path).rstrip("/")
    if any(c in path for c in "*["):
        return any(fnmatch.fnmatch(f, path) for f in files)
    return path in files or path in dirs


def _top_level_names(path: str) -> set[str]:
    names = set()
    for node in ast.parse((ROOT / path).read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets) and \
                    isinstance(node.value, (ast.List, ast.Tuple)):  # exported, some lazily (a module __getattr__)
                names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def dotted_exists(name: str) -> bool:
    """``harness.x.y`` (or ``harness.x:y``): the longest module prefix is a tracked file, and the name
    after it, if any, is defined at its top level (read from its source, not imported)."""
    files, _ = tracked()
    parts = name.replace(":", ".").split(".")
    for i in range(len(parts), 0, -1):
        stem = "/".join(parts[:i])
        module = next((f for f in (stem + ".py", stem + "/__init__.py") if f in files), None)
        if module:
            return i == len(parts) or parts[i] in _top_level_names(module)
    return False


def design_problems(name: str, text: str) -> list[str]:
    """Machine paths, and repository paths or module names that do not exist, in one note."""
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in MACHINE.finditer(line):
            problems.append(f"{name}:{n}: machine path {m.group(0)!r}: {line.strip()}")
        for pattern, exists in ((PATH, path_exists), (DOTTED, dotted_exists)):
            for m in pattern.finditer(line):
                if GONE.match(line, m.end()) or THEN.search(line, 0, m.start()):
                    continue
                if not exists(m.group(0)):
                    problems.append(f"{name}:{n}: {m.group(0)} is not in the repository (fix it or mark it "
                                    "'(gone now)')")
    return problems


def notes() -> list[Path]:
    found = sorted(DESIGN.glob("*.md"))
    assert len(found) > 1
    return found


def test_design_notes_hold_no_machine_path_and_no_dead_path():
    problems = [p for note in notes() for p in design_problems(note.name, note.read_text())]
    assert problems == []


def test_a_dead_or_machine_path_in_a_note_fails():
    assert design_problems("x.md", "see `harness/meshes/device_mesh.py` and harness.model.tasks:run") == []
    assert design_problems("x.md", "see `harness/meshes.py`") == [
        "x.md:1: harness/meshes.py is not in the repository (fix it or mark it '(gone now)')"]
    assert design_problems("x.md", "see `harness/meshes.py` (gone now)") == []
    assert design_problems("x.md", "`harness/pool/rank.py` (then `harness/rank.py`)") == []
    assert len(design_problems("x.md", "`harness.matrix.expect_divergence` and harness.cell.nosuch")) == 2
    assert len(design_problems("x.md", "ran /tmp/plant.py with .venv/bin/python from /work/wt/x")) == 3


def test_design_readme_links_every_note():
    index = (DESIGN / "README.md").read_text()
    assert "records" in index.split("\n\n")[1]
    linked = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    assert linked == {p.name for p in notes() if p.name != "README.md"}


def test_readme_links_the_design_readme_once_and_no_note():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("(docs/design/README.md)") == 1
    others = [link for link in re.findall(r"\((docs/design/[^)]*)\)", readme) if link != "docs/design/README.md"]
    assert others == []
