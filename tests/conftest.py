import os
import sys

import pytest
from hypothesis import settings

from harness.pool import kept
from harness.pool.parent import Pool, single_threaded

# no example database written; no per-example deadline on a loaded 2-core machine. (Hypothesis still
# caches code constants in .hypothesis/, gitignored like __pycache__.)
settings.register_profile("harness", database=None, deadline=None)
settings.load_profile("harness")

# the suite's two workers share CI's two cores with the pools they start, as a pool's parent does
single_threaded()

pytest_plugins = ["pytester"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- one kept pool for the users' projects of the run ---------------------------------------------------
# The tests run a user's project as a user does: a pytest process of its own, whose pool would import
# torch (and transformers) anew each time, seconds of the CPU that the suite's time is made of. Each
# run's projects share a kept pool instead (one keeper per xdist worker, in a runtime directory of the
# run's own, stopped when the run ends); a test about the pool itself runs without it (``own_pool_env``).
# Each worker's projects get a scope of their own: a project run with ``-n 2`` names its workers gw0
# and gw1, and under one scope for the run would take the keepers of the suite's gw0 and gw1, replacing
# them under the tests running there (isolation, not speed: a run starts as many keepers either way).
KEPT_POOL_ENV = (kept.ENV, kept.SCOPE_ENV)
_SCOPE_KEY = "paritytest_kept_scope"  # the run's scope, handed to its xdist workers
_KEPT_SCOPE = pytest.StashKey[str]()


def _share_a_kept_pool(config) -> None:
    import shutil
    import tempfile

    if hasattr(config, "workerinput"):
        scope = config.workerinput.get(_SCOPE_KEY)
        if scope:
            os.environ[kept.SCOPE_ENV] = f"{scope}-{config.workerinput['workerid']}"
        return
    if os.environ.get(kept.SCOPE_ENV):
        return  # a user's own setting is kept
    # XDG_RUNTIME_DIR, not the temp directory: the tests give each project a TMPDIR of its own
    runtime = tempfile.mkdtemp(prefix="ptk-", dir="/tmp")  # short: a socket's path holds 108 bytes
    config.stash[_KEPT_SCOPE] = scope = f"tests-{os.getpid()}"
    os.environ.update({kept.ENV: "300", kept.SCOPE_ENV: scope, "XDG_RUNTIME_DIR": runtime})

    def stop() -> None:
        kept.stop(None)  # every keeper in the run's own runtime directory
        shutil.rmtree(runtime, ignore_errors=True)

    config.add_cleanup(stop)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: the run's scope to each of its workers
def pytest_configure_node(node) -> None:
    scope = node.config.stash.get(_KEPT_SCOPE, None)
    if scope:
        node.workerinput[_SCOPE_KEY] = scope


def own_pool_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the run's kept pool: for a test about the pool a project starts itself."""
    return {k: v for k, v in env.items() if k not in KEPT_POOL_ENV}


# ---- how the suite is spread over xdist's workers ----------------------------------------------------
def pytest_configure(config):
    """Under ``-n``, a module's tests on one worker, the modules in collection order (see
    ``pytest_collection_modifyitems``), unless the command line chose a ``--dist`` of its own: a
    module-scoped fixture (a user's project run once, a virtual environment, a pool) is set up once,
    not once on each worker. (Not ``loadgroup``: xdist 3.8 renames the grouped items' node ids, which
    pytest 9.2 ignores, so its groups are silently not kept.) And the run's kept pool."""
    _share_a_kept_pool(config)
    if any(a == "--dist" or a.startswith("--dist=") for a in config.invocation_params.args):
        return
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadscope"
        config.option.loadscopereorder = False  # xdist would put the modules with the most tests first


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker more than the cores. A quarter of the suite's wall is waiting, not
    computing (pip installing into fresh environments from the package index, hangs left to reach
    their deadline, idle timeouts, subprocesses starting). With one more worker the machine is busy
    98% of the run, and the run took 0.83x the time of a worker a core (docs/performance.md)."""
    return (os.cpu_count() or 1) + 1


def pytest_collection_modifyitems(config, items):
    """The modules that hold slow tests first, so that the last minutes are not one long module on
    one worker while the other idles (stable: the order within a module is kept)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(scope="module")
def small_pool():
    """A private pool of 4 ranks with a short deadline, so fault tests need not wait long."""
    pool = Pool(size=4, deadline=20.0)
    yield pool
    pool.close()


def failure_of(cell, pool) -> str:
    """Run ``cell``, which must fail (diverge, or a rank raise): the failure as a user reads it,
    printed too (pytest -s shows it)."""
    from harness.cell import Divergence, run_cell
    from harness.pool.parent import CaseFailure

    with pytest.raises((Divergence, CaseFailure)) as caught:
        run_cell(cell, pool)
    message = str(caught.value)
    print(message)
    return message


def flat(text: str) -> str:
    """``text`` with every run of white space one space: prose that a failure wrapped to its width
    (``harness.screen.fitted``) reads as one line again."""
    return " ".join(text.split())


def line_of(text: str, start: str) -> str:
    """The line of ``text`` that starts with ``start``, whole: with the lines a failure wrapped it
    into (``harness.screen.fitted``) joined again."""
    from harness.screen import first_line

    return first_line(text[text.index(start):])


def run_python(code: str, **kwargs):
    """Start ``python -c code`` with the repository importable."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True, **kwargs)


@pytest.fixture
def user_project(tmp_path):
    """A project of the user's own, empty but for its ``pytest.ini`` (tests/project.py): ``.write({...})``
    its files, then ``.pytest(...)`` or ``.harness("bisect", ...)`` as the user types them."""
    from tests.project import UserProject

    return UserProject(tmp_path / "project")
