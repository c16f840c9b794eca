"""What pytest loads from a directory, for the commands that run outside pytest.

A user registers implementations in a ``conftest.py`` (README, "Your own implementation"), which
pytest imports while it collects. ``python -m harness.bisect`` (and ``python -m harness.explore``)
resolve config ids outside pytest, so they must see the same registrations. :func:`load` runs
pytest's own configuration and collection (``--collect-only``, in this process) from a directory:
the rootdir, the ini file, its ``testpaths`` and ``addopts``, and the conftests on the way are
exactly those ``pytest`` uses from there, and what those conftests register stays registered in
the process afterwards::

    from harness.project import load

    project = load()                    # from the current directory, as `pytest` would
    cfg = project.resolve("tp-mine-tp2-fp32-op_colshard-b4.f32.h16.s8.v40-seed0")
    cells = project.cells_of("tp")      # the tp cells pytest collects here, in its order

An unknown component or implementation raises :class:`ProjectError` naming what is registered and
where pytest looked (:meth:`Project.where`).
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import pytest

from .config import Config, ConfigError
from .registry import COMPONENTS, Component, get

# pytest exit codes that mean the collection worked: tests found, or none (a conftest-only project)
_COLLECTED = (0, 5)


class ProjectError(ConfigError):
    """Loading the project failed, or it does not register a name: one line saying what, where
    pytest looked and what to do."""


@dataclass(frozen=True)
class Project:
    """What pytest loaded from ``directory``: where it looked and the cells it collected."""

    directory: Path  # where pytest ran from (its invocation directory)
    rootdir: Path
    inifile: Path | None
    paths: tuple[str, ...]  # what it collected: the arguments, else the ini's testpaths (from the rootdir)
    conftests: tuple[Path, ...]  # every conftest.py it imported, in order
    cells: tuple[Config, ...]  # the configs of the collected tests that take a ``cfg`` parameter

    def where(self) -> str:
        """Where pytest looked, in one clause for error messages."""
        conftests = ", ".join(map(str, self.conftests)) or "none"
        ini = f"ini file {self.inifile}" if self.inifile else "no ini file"
        return (f"pytest run from {self.directory} (rootdir {self.rootdir}, {ini}, collecting "
                f"{' '.join(self.paths) or '.'}) loaded conftests: {conftests}")

    def component(self, name: str) -> Component:
        """The registered component ``name``, or a :class:`ProjectError` naming the registered ones."""
        try:
            return get(name)
        except ConfigError:
            raise ProjectError(f"unknown component {name!r}; registered: {', '.join(sorted(COMPONENTS))}; "
                               f"{self.where()}") from None

    def resolve(self, cfg: str | Config) -> Config:
        """A config id (or config) whose component and implementation are registered here. The
        config's own rules are not checked: a cell they reject is a result, not a usage error."""
        cfg = Config.parse(cfg) if isinstance(cfg, str) else cfg
        component = self.component(cfg.component)
        if cfg.impl not in component.implementations:
            raise ProjectError(
                f"{cfg.id}: unknown implementation {cfg.impl!r} of {cfg.component}; registered: "
                f"{', '.join(sorted(component.implementations))}; {self.where()}; register it with "
                f"register_implementation({cfg.component!r}, {cfg.impl!r}, 'module:run') in a conftest.py "
                "pytest loads from here, or run from your project's directory")
        return cfg

    def cells_of(self, component: str) -> list[Config]:
        """The collected cells of ``component`` (which must be registered), in the order the test modules
        declare them (not the order pytest runs them in, the largest worlds first)."""
        self.component(component)
        return [cfg for cfg in self.cells if cfg.component == component]


class _Seen:
    """The pytest plugin that watches the collection: its items, failures and ``sys.path``."""

    def __init__(self):
        self.config = None
        self.cells: dict[Config, None] = {}  # in order, once each (a cell may be collected by two tests)
        self.failures: list[str] = []
        self.sys_path: list[str] = []
        self.new_cache: Path | None = None  # pytest's cache directory, when this run would create it
        self.declared: dict[str, int] = {}  # each item's place as the test modules declare it

    @pytest.hookimpl(tryfirst=True)  # before junitxml's: a look writes no report over the user's last one
    def pytest_configure(self, config):
        config.option.xmlpath = None
        # a failed collection is written to pytest's cache: a directory that a look must not leave behind
        with contextlib.suppress(ValueError):  # no cache_dir option: the cacheprovider plugin is off
            cache = Path(config.rootpath, config.getini("cache_dir"))
            self.new_cache = None if cache.exists() else cache

    def pytest_collectreport(self, report):
        if report.failed:
            lines = [line for line in report.longreprtext.splitlines() if line.strip()]
            self.failures.append(f"{report.nodeid or '.'}: {lines[-1].strip() if lines else 'failed'}")

    @pytest.hookimpl(tryfirst=True)  # before the plugin orders cells by world size for the workers
    def pytest_collection_modifyitems(self, items):
        self.declared = {item.nodeid: place for place, item in enumerate(items)}

    def pytest_collection_finish(self, session):
        self.config = session.config
        for item in sorted(session.items, key=lambda item: self.declared.get(item.nodeid, 0)):
            cfg = getattr(getattr(item, "callspec", None), "params", {}).get("cfg")
            if isinstance(cfg, Config):
                self.cells[cfg] = None
        # pytest takes its `pythonpath` ini entries off sys.path when it ends; the ranks need them
        self.sys_path = list(sys.path)


@contextlib.contextmanager
def _cwd(directory: Path) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(before)


def load(directory: str | os.PathLike = ".", args: Sequence[str] = ()) -> Project:
    """Run pytest's configuration and collection (``--collect-only``, nothing printed) from
    ``directory``, with ``args`` as on pytest's command line (paths, ``-k``, ...; none: the ini's
    ``testpaths`` from the rootdir, else the directory). Implementations registered by the
    conftests it imports stay registered; ``sys.path`` keeps what pytest added (conftest
    directories, the ini's ``pythonpath``) and ``directory`` itself, as ``python -m pytest`` run there
    has it, so that the ranks import what the conftests name. Raises :class:`ProjectError` when pytest cannot start
    or cannot collect (its usage errors are printed on stderr, its collection errors quoted)."""
    directory = Path(directory).resolve()
    seen = _Seen()
    # Silent by taking pytest's stdout, not by blocking its terminal plugin (-p no:terminal): the
    # options that plugin defines (-q, -v, -r, --tb, ...) are then unrecognised arguments (pytest 9),
    # wherever they come from, a user's addopts included.
    # --assert=plain: nothing collected here runs as a test, so rewriting each test module's asserts
    # (compiled anew in every process where bytecode is not written) buys nothing
    with _cwd(directory), contextlib.redirect_stdout(io.StringIO()):
        code = pytest.main(["--collect-only", "--assert=plain", *args], plugins=[seen])
    sys.path[:0] = [p for p in dict.fromkeys([*seen.sys_path, str(directory)]) if p not in sys.path]
    if seen.new_cache is not None:
        shutil.rmtree(seen.new_cache, ignore_errors=True)
    if seen.config is None or code not in _COLLECTED:
        said = f": {'; '.join(seen.failures[:3])}" if seen.failures else " (pytest's message is above)"
        raise ProjectError(f"pytest could not collect from {directory} (pytest exit {int(code)}){said}; "
                           f"run `python -m pytest --collect-only` there to see it in full")
    config = seen.config
    conftests = tuple(Path(plugin.__file__) for _, plugin in config.pluginmanager.list_name_plugin()
                      if Path(getattr(plugin, "__file__", None) or "x").name == "conftest.py")
    return Project(directory=directory, rootdir=Path(config.rootpath),
                   inifile=Path(config.inipath) if config.inipath else None,
                   paths=tuple(os.path.relpath(a, directory) if os.path.isabs(a) else a for a in config.args),
                   conftests=conftests, cells=tuple(seen.cells))
