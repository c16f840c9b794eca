"""No import circle anywhere in the installed project: ``harness`` (its machinery, the parallel
implementations and the shipped models) and ``reference``.

Every ``import`` statement counts, at module level or inside a function (a lazy import that closes a
circle is a circle all the same: it only moves the failure to run time). ``import a.b`` and ``from
a.b import c`` are edges to ``a.b`` (to ``a.b.c`` when ``c`` is a submodule); the graph's strongly
connected components must all be single modules.
"""
from __future__ import annotations

import ast
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
    assert "harness.registry" in graph["harness.cell"] and "harness.names" in graph["reference.common"]


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_in_the_project():
    modules = project_modules()
    graph = {name: imports_of(name, path, set(modules)) for name, path in modules.items()}
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(
        " <-> ".join(c) + "\n    " + "\n    ".join(f"{a} -> {', '.join(sorted(graph[a] & set(c)))}" for a in c)
        for c in found)
