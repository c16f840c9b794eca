"""``pytest cases/ --explore N``: explore what the selection's cells cover instead of running them.

The selected cells (after ``-k``, ``--quick`` and the rest) name the (component, implementation)
pairs; each becomes one test that explores it with up to N drawn configs in this process's warm
pool, writing a progress line per trial, and fails with the exploration's summary when it finds a
divergence. The example database is ``<rootdir>/.hypothesis/explore``, as for the command line.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from ..config import Config
from ..options import keep_seconds
from ..pool.parent import shared_pool
from .runner import DATABASE, Budget, explore


class ExploreItem(pytest.Item):
    """One (component, implementation) explored as a test."""

    def __init__(self, *, component: str, impl: str, modules: list[str], **kwargs):
        super().__init__(**kwargs)
        self.component, self.impl, self.modules = component, impl, modules

    def runtest(self) -> None:
        config = self.config
        opt = config.getoption
        pool = shared_pool(size=opt("--pool-size"), backend=opt("--backend"), deadline=opt("--case-deadline"),
                           keep=keep_seconds(config), root=str(config.rootpath))
        writer = config.get_terminal_writer()
        database = Path(config.rootpath) / DATABASE
        database.mkdir(parents=True, exist_ok=True)

        capture = config.pluginmanager.getplugin("capturemanager")

        def progress(line: str) -> None:  # past pytest's capture, as the terminal's own lines are
            with capture.global_and_fixture_disabled():
                writer.line(line)

        budget = Budget(max_examples=opt("--explore"), shrink_seconds=opt("--explore-shrink-seconds"))
        found = explore(self.component, self.impl, pool, budget, db_path=database, progress=progress,
                        ignore=tuple(opt("--explore-ignore")), seed=opt("--explore-seed"))
        summary = found.summary(str(database), self.modules)
        if found.minimal is not None:
            pytest.fail(summary, pytrace=False)
        progress(summary)

    def reportinfo(self):
        return self.path, None, f"explore {self.component}:{self.impl}"


class ExplorePlugin:
    """Registered by the parity plugin when ``--explore N`` is given."""

    @pytest.hookimpl(trylast=True)  # after -k and --quick have chosen the cells
    def pytest_collection_modifyitems(self, session, config, items):
        targets: dict[tuple[str, str], list[str]] = {}
        for item in items:
            cfg = getattr(getattr(item, "callspec", None), "params", {}).get("cfg")
            if isinstance(cfg, Config):
                modules = targets.setdefault((cfg.component, cfg.impl), [])
                path = item.nodeid.split("::")[0]
                if path not in modules:
                    modules.append(path)
        config.hook.pytest_deselected(items=list(items))
        items[:] = [ExploreItem.from_parent(session, name=f"explore[{c}:{i}]", component=c, impl=i, modules=m)
                    for (c, i), m in targets.items()]

    def pytest_unconfigure(self, config):
        shared_pool().close()
