"""Temporary shim until harness/project.py (branch issue-bisect) lands: what pytest collects here.

Collects the current directory as pytest would (rootdir, ini testpaths, conftest.py files), so
implementations registered in a user's conftest are registered in this process too, and notes
which test modules parametrize cells of which component.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Config, ConfigError


@dataclass
class Project:
    cells: list[Config] = field(default_factory=list)
    paths: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def modules(self, component: str) -> list[str]:
        return self.paths.get(component, [])


def load(directory: Path) -> Project:
    import os

    import pytest

    project = Project()

    class Collector:
        def pytest_collection_modifyitems(self, items):
            for item in items:
                cfg = getattr(getattr(item, "callspec", None), "params", {}).get("cfg")
                if isinstance(cfg, Config):
                    project.cells.append(cfg)
                    path = os.path.relpath(str(item.path), directory)
                    if path not in project.paths[cfg.component]:
                        project.paths[cfg.component].append(path)

    here = Path.cwd()
    os.chdir(directory)
    try:
        code = pytest.main(["--collect-only", "-p", "no:terminal"], plugins=[Collector()])
    finally:
        os.chdir(here)
    if code not in (0, 5):
        raise ConfigError(f"collecting the cases from {directory} failed (pytest exit {code})")
    return project
