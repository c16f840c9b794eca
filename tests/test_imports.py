"""No import circle anywhere in the installed project: ``harness`` (its machinery, the parallel
implementations and the shipped models) and ``reference``.

Every ``import`` statement counts, at module level or inside a function (a lazy import that closes a
circle is a circle all the same: it only moves the failure to run time). ``import a.b`` and ``from
a.b import c`` are edges to ``a.b`` (to ``a.b.c`` when ``c`` is a submodule); the graph's strongly
connected components must all be single modules.

The same graph holds docs/architecture.md's Layout block, both ways: what each module imports is on
its line, and what its line names it imports (below).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("harness", "reference")


def project_modules() -> dict[str, Path]:
    """Module name -> file, for every module of the installed packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules that ``name`` (at ``path``) imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                       for alias in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    graph = {name: imports_of(name, path, set(project_modules())) for name, path in project_modules().items()}
    assert "harness.resolve" in graph["harness.cell"] and "harness.names" in graph["reference.common"]


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_in_the_project():
    modules = project_modules()
    graph = {name: imports_of(name, path, set(modules)) for name, path in modules.items()}
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(
        " <-> ".join(c) + "\n    " + "\n    ".join(f"{a} -> {', '.join(sorted(graph[a] & set(c)))}" for a in c)
        for c in found)


# --- docs/architecture.md's "## Layout" block, held to the graph both ways ---------------------------
#
# One line per module: its path by indentation (two spaces a level; folders end with ``/``), a
# description from column 30, and after ``·`` the project modules it may import. A line whose text
# starts at column 30 continues the line above: its list when it starts with ``·``, else its
# description. The names: ``x`` is ``harness.x`` and everything under it (``reference``: the
# ``reference`` package); ``.x`` is the module or subpackage ``x`` of the line's folder; ``.* but .a,
# .b`` every module of that folder but those; ``-`` none.
#
# A folder line's list (after ``·``, or its description's "may import a, b and the siblings named")
# applies to every module under it, its ``.x`` taken in that folder; those are permissions, not claims.
# A module's own names are claims as well: each must match at least one import the module makes
# (``.*``: at least one module of the folder). A package's ``__init__.py`` (but ``harness/__init__.py``)
# may be left out; left out, it may import its own package's modules (and what its folders' lists
# allow); written in, its line holds it like any module's.

DOC = ROOT / "docs" / "architecture.md"
DESCRIPTION_COLUMN = 30


def layout_block(doc: str) -> str:
    """The fenced code block of the section "## Layout"."""
    section = doc.split("\n## Layout\n", 1)[1]
    return section.split("```\n", 1)[1].split("\n```", 1)[0]


def _names(text: str) -> list[str]:
    return [] if text.strip() in ("", "-") else [n.strip() for n in text.split(",") if n.strip()]


def layout_entries(block: str) -> list[dict]:
    """The block's lines: path (folders end with "/"), the module's own names, its exclusions
    (``.* but ...``) and, for a folder, its shared list."""
    entries: list[dict] = []
    parents: list[tuple[int, str]] = []  # (indent, folder path) of the folders enclosing the line
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        text = line.strip()
        if indent >= DESCRIPTION_COLUMN:  # a continuation of the line above
            entry = entries[-1]
            if text.startswith("·"):
                entry["list"] += (", " if entry["list"] else "") + text[1:].strip()
            else:
                entry["description"] += " " + text
            continue
        name, _, rest = text.partition(" ")
        description, dot, listed = rest.rpartition("·")
        if not dot:
            description, listed = rest, ""
        while parents and parents[-1][0] >= indent:
            parents.pop()
        path = (parents[-1][1] if parents else "") + name
        if name.endswith("/"):
            parents.append((indent, path))
        entries.append({"path": path, "description": description.strip(), "list": listed.strip()})
    for entry in entries:
        listed = entry.pop("list")
        own, _, excluded = listed.partition(".* but ")
        entry["names"] = _names(own)
        entry["all_but"] = _names(excluded) if ".* but " in listed else None
        if ".*" in entry["names"]:
            entry["names"].remove(".*")
            entry["all_but"] = []
        shared = re.search(r"may import (.+?) and the siblings named", entry.pop("description"))
        entry["shared"] = (_names(shared.group(1)) if shared else []) + (
            entry["names"] if entry["path"].endswith("/") else [])
    return entries


def _package_of_path(folder: str) -> str:
    """'harness/pool/' -> 'harness.pool'."""
    return folder.rstrip("/").replace("/", ".")


def _matches(name: str, folder: str, target: str) -> bool:
    """Whether the doc's ``name``, written on a line in ``folder``, allows importing ``target``."""
    if name.startswith("."):
        module = f"{_package_of_path(folder)}.{name[1:]}"
    elif name == "reference" or name.startswith("reference."):
        module = name
    else:
        module = f"harness.{name}"
    return target == module or target.startswith(module + ".")


def _sibling(folder: str, target: str) -> bool:
    """Whether ``target`` is a module or subpackage of ``folder`` (not the package itself)."""
    return target.startswith(_package_of_path(folder) + ".")


def layout_discrepancies(block: str, modules: dict[str, Path], graph: dict[str, set[str]],
                         root: Path = ROOT) -> list[str]:
    """What differs between the Layout block and the code, one line each."""
    entries = layout_entries(block)
    out = []
    by_path: dict[str, dict] = {}
    for entry in entries:
        path = entry["path"]
        if path in by_path:
            out.append(f"{path}: on two lines of docs/architecture.md")
        by_path[path] = entry
        is_folder = path.endswith("/")
        if not ((root / path).is_dir() if is_folder else (root / path).is_file()):
            out.append(f"{path}: in docs/architecture.md, but no such {'folder' if is_folder else 'file'}")
    folders = [e for e in entries if e["path"].endswith("/")]
    for name, file in sorted(modules.items(), key=lambda kv: str(kv[1])):
        path = file.relative_to(root).as_posix()
        folder = path.rpartition("/")[0] + "/"
        imports = graph[name]
        shared = [(f["path"], n) for f in folders if path.startswith(f["path"]) for n in f["shared"]]
        entry = by_path.get(path)
        if entry is None:
            own_package = name if file.name == "__init__.py" and path != "harness/__init__.py" else None
            outside = {t for t in imports if not (own_package and t.startswith(own_package + "."))
                       and not any(_matches(n, f, t) for f, n in shared)}
            if own_package is None or outside:
                out.append(f"{path}: not in docs/architecture.md")
            continue
        all_but = entry["all_but"]
        in_all_but = (lambda t: all_but is not None and _sibling(folder, t)
                      and not any(_matches(x, folder, t) for x in all_but))
        for target in sorted(imports):
            if not (any(_matches(n, folder, target) for n in entry["names"]) or in_all_but(target)
                    or any(_matches(n, f, target) for f, n in shared)):
                out.append(f"{path}: imports {target}, not on its line")
        for n in entry["names"]:
            if not any(_matches(n, folder, t) for t in imports):
                out.append(f"{path}: line names {n}, which it does not import")
        if all_but is not None and not any(in_all_but(t) for t in imports):
            out.append(f"{path}: line names .*, which it does not import")
        for x in all_but or []:
            if not any(_matches(x, folder, m) for m in modules):
                out.append(f"{path}: line excludes {x}, which is not a module")
    return out


def _graph() -> tuple[dict[str, Path], dict[str, set[str]]]:
    modules = project_modules()
    return modules, {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def test_the_layout_lists_what_each_module_imports():
    modules, graph = _graph()
    found = layout_discrepancies(layout_block(DOC.read_text()), modules, graph)
    assert not found, "docs/architecture.md's Layout block against the code:\n" + "\n".join(found)


def test_the_layout_check_finds_what_drifted():
    modules, graph = _graph()
    block = layout_block(DOC.read_text())
    before = set(layout_discrepancies(block, modules, graph))  # the drift the test above reports
    lines = block.splitlines()
    world = next(i for i, line in enumerate(lines) if line.startswith("  world.py "))
    config = next(i for i, line in enumerate(lines) if line.startswith("  config.py "))
    kept = next(i for i, line in enumerate(lines) if line.startswith("    kept.py "))
    assert lines[world].endswith("· names") and lines[config].endswith("· names")
    lines[world] = lines[world].removesuffix("· names") + "· -"         # a name dropped
    lines[config] += ", screen"                                         # a bogus one added
    del lines[kept]                                                     # a module's line dropped
    found = [f for f in layout_discrepancies("\n".join(lines), modules, graph) if f not in before]
    assert found == ["harness/config.py: line names screen, which it does not import",
                     "harness/pool/kept.py: not in docs/architecture.md",
                     "harness/world.py: imports harness.names, not on its line"], found
    # the rest of the checker's reach: a line for a file that is not there, a stale .* exclusion, an
    # __init__ left out that imports beyond its package, an excluded sibling imported, a folder's
    # shared list that permits (parallel/) and that does not cover an import (reference/)
    lines = block.splitlines()
    lines.insert(world + 1, "  nosuch.py                   gone · -")
    tasks = next(i for i, line in enumerate(lines) if line.startswith("    tasks.py ") and "but" in line)
    lines[tasks] += ", .gone"
    graph = dict(graph)
    graph["harness.pool"] = graph["harness.pool"] | {"harness.screen"}
    graph["harness.model.tasks"] = graph["harness.model.tasks"] | {"harness.model.register"}
    graph["harness.parallel.step"] = graph["harness.parallel.step"] | {"harness.names", "reference.tp"}
    graph["reference.tp"] = graph["reference.tp"] | {"harness.screen"}
    found = [f for f in layout_discrepancies("\n".join(lines), modules, graph) if f not in before]
    assert sorted(found) == ["harness/model/tasks.py: imports harness.model.register, not on its line",
                             "harness/model/tasks.py: line excludes .gone, which is not a module",
                             "harness/nosuch.py: in docs/architecture.md, but no such file",
                             "harness/pool/__init__.py: not in docs/architecture.md",
                             "reference/tp.py: imports harness.screen, not on its line"], found


def test_the_report_reads_junit_xml_without_importing_pytest():
    """``python -m harness.report`` reads the cells' records from junit XML alone: their schema
    (``harness.record``) is not the fixture's, so the report runs where pytest is not installed."""
    import subprocess
    import sys

    code = ("import sys, harness.report, harness.report.junit, harness.report.markdown, harness.report.models; "
            "print(sorted(m for m in sys.modules if m == 'pytest' or m.startswith(('_pytest', 'pytest.'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
