"""``pytest cases/ --changed REF``: the cells a change since ``REF`` can move.

A cell's code is its component's modules (reference, implementation, model case: the import paths the
registry holds) and everything they import; the harness's machinery (the fixture, the pool's ranks,
torchrun's runner, the plugin, and what they import) is every cell's. So from the files changed since
``REF`` (committed, in the working tree, or new and not ignored):

* a changed module that the machinery reaches selects every cell;
* one that a cell's modules reach (they import it, at any depth) selects that cell;
* a changed test module selects its own cells, a changed golden file its cell;
* anything else (docs, data files, code no import reaches) selects nothing.

The import graph is read from the checkout's Python files with ``ast`` (every ``import``, at module
level or in a function); import paths in strings are not edges, which is why the component table
(``harness/components.py``) is not followed from the machinery: it names each component's code, and a
change to it selects every cell (conservatively: it is one module for all of them). docs/ci.md says what this can miss and how the nightly full run covers it.
"""
from __future__ import annotations

import ast
import functools
import os
import subprocess
from pathlib import Path

from .config import Config
from .paths import modules
from .registry import get

# every cell runs these and what they import
MACHINERY = ("harness.plugin", "harness.fixture", "harness.pool.rank", "harness.torchrun.runner")
# modules that name components' code by import path: not followed from the machinery
TABLES = ("harness.components",)


# what the harness writes into a project (exploration's results and example database, bisect's): not a change
OUTPUTS = ("explore-out/", ".hypothesis/", ".paritytest/")


def projects_own(root: Path, files: list[str]) -> list[str]:
    """``files`` (relative to ``root``) less what the harness writes (:data:`OUTPUTS`), Python's bytecode
    caches, and what lies in a virtual environment (a directory holding a ``pyvenv.cfg``, as the gate's
    Install step makes ``.venv`` in the checkout, often not ignored): none is the project's change."""
    @functools.lru_cache(maxsize=None)
    def environment(directory: str) -> bool:
        return bool(directory) and ((root / directory / "pyvenv.cfg").is_file()
                                    or environment(os.path.dirname(directory)))

    return [f for f in files if not f.startswith(OUTPUTS) and "__pycache__/" not in f and not f.endswith(".pyc")
            and not environment(os.path.dirname(f))]


class ChangedError(ValueError):
    """``--changed REF`` cannot be read (not a git checkout, an unknown ref)."""


def changed_files(root: Path, ref: str) -> list[str]:
    """Paths (relative to ``root``) changed since ``ref``: committed or not, and new files git does not
    ignore."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        if done.returncode:
            raise ChangedError(f"--changed {ref}: git {' '.join(args)} failed: {done.stderr.strip().splitlines()[-1:]}; "
                               "give a commit, branch or tag of this checkout, e.g. --changed origin/main")
        return done.stdout
    git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    untracked = projects_own(root, git("ls-files", "--others", "--exclude-standard").splitlines())
    return sorted(set(git("diff", "--name-only", "--relative", ref, "--").splitlines() + untracked))


def module_of(path: str) -> str | None:
    """``harness/model/tasks.py`` -> ``harness.model.tasks`` (a package's ``__init__.py``: the package)."""
    if not path.endswith(".py"):
        return None
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) if parts else None


def import_graph(root: Path) -> dict[str, set[str]]:
    """Every Python module under ``root`` (tracked or not ignored, outside a virtual environment) -> the
    modules of ``root`` it imports."""
    files = projects_own(root, subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
                                              cwd=root, capture_output=True, text=True).stdout.splitlines())
    known = {module_of(f): f for f in files if module_of(f)}
    graph: dict[str, set[str]] = {}
    for name, file in known.items():
        try:
            tree = ast.parse((root / file).read_text(), file)
        except (OSError, SyntaxError, UnicodeDecodeError):
            graph[name] = set()
            continue
        package = name if file.endswith("__init__.py") else name.rpartition(".")[0]
        graph[name] = {found for target in _targets(tree, package) for found in _known(target, known)}
    return graph


def _targets(tree: ast.AST, package: str) -> list[str]:
    """The dotted names ``tree``'s imports name (``from a import b``: ``a.b`` and ``a``)."""
    out = []
    for node in _statements(tree.body):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            out += [stem] + [f"{stem}.{alias.name}" for alias in node.names]
    return out


def _statements(body: list[ast.stmt]):
    """Every statement of ``body``, at any depth (an import is a statement, so the expressions, most of
    a tree's nodes, need no visit)."""
    todo = list(body)
    while todo:
        node = todo.pop()
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):  # handlers', cases' own bodies too
            todo += getattr(node, field, ())


def _known(dotted: str, known) -> list[str]:
    """The modules of the checkout that importing ``dotted`` runs: each prefix of it that is one (a
    package's ``__init__`` runs for any module under it)."""
    parts = dotted.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts) + 1) if ".".join(parts[:end]) in known]


def reached_from(graph: dict[str, set[str]], roots, skip=()) -> set[str]:
    """The modules ``roots`` import, at any depth, and the roots (not following into ``skip``)."""
    seen, todo = set(), [r for r in roots if r in graph]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [m for m in graph.get(name, ()) if m not in seen and m not in skip]
    return seen


def cell_modules(cfg: Config) -> list[str]:
    """The modules the registry names for ``cfg``'s component and implementation, and those its
    component preloads."""
    component = get(cfg.component)
    impl = component.implementations.get(cfg.impl)
    paths = [component.reference, component.calibration, component.validate, component.reduction,
             component.meshes, component.diagnose, component.case,
             component.space if isinstance(component.space, str) else None]
    if impl is not None:
        paths += [impl.run, impl.validate, impl.xfail, impl.skip]
    return [m for p in paths if isinstance(p, str) for m in modules(p)] + list(component.preload)


class Changes:
    """What changed since a ref, and which cells it can move (:meth:`moves`)."""

    def __init__(self, root: Path, ref: str, golden_dir: Path):
        self.files = changed_files(root, ref)
        self.graph = import_graph(root)
        changed = {module_of(f) for f in self.files} - {None}
        self.changed_modules = changed & set(self.graph)
        # the table names every component's code by path, which no import edge follows: a change to it
        # moves every cell
        self.core = reached_from(self.graph, MACHINERY, skip=TABLES) | set(TABLES)
        self.everything = bool(self.changed_modules & self.core)
        self.goldens = {str((root / f).resolve()) for f in self.files if f.endswith(".safetensors")}
        self.golden_dir = golden_dir
        self._moved: dict[str, bool] = {}

    def moves(self, cfg: Config, test_module: str) -> bool:
        """Whether the change can move ``cfg``'s cell, collected from ``test_module``."""
        if self.everything or test_module in self.changed_modules:
            return True
        from .golden.store import golden_path

        if str(golden_path(self.golden_dir, cfg).resolve()) in self.goldens:
            return True
        for module in cell_modules(cfg):
            if module not in self._moved:
                self._moved[module] = bool(reached_from(self.graph, [module]) & self.changed_modules)
            if self._moved[module]:
                return True
        return False

    def reaches(self, module: str | None) -> bool:
        """Whether the change can move a test of ``module`` that runs no cell: it imports a changed
        module, at any depth (or is one)."""
        if self.everything:
            return True
        return module is not None and bool(reached_from(self.graph, [module]) & self.changed_modules)

    def describe(self) -> str:
        """One line for the run's header."""
        if self.everything:
            return (f"--changed: {len(self.files)} files changed, the harness's machinery among them "
                    f"({', '.join(sorted(self.changed_modules & self.core)[:3])}): "
                    "every cell")
        return (f"--changed: {len(self.files)} files changed ({len(self.changed_modules)} modules, "
                f"{len(self.goldens)} golden files): the cells they can move")
