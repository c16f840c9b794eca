"""The install claims only the project's own import names: ``harness`` and ``reference``.

A training repository often has packages named ``models`` or ``parallel``. paritytest installed into
its environment must never shadow them, wherever the user's code runs from. Here a user's project
with its own ``models`` and ``parallel`` packages is run as its owner would run it: by pytest from
its root, and by a script outside it that puts the project on ``sys.path`` after the environment's
packages (as a ``.pth`` file or an editable install in compat mode does), with paritytest installed
from a copy of this checkout by pip (a regular install: its packages sit where ``site-packages`` is).
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.checkout import copy_checkout
from tests.project import UserProject

OWN_NAMES = {"harness", "reference"}

USER_FILES = {
    "models/__init__.py": "",
    "models/tinylm.py": "def build():\n    return 'the user tinylm'\n",
    "parallel/__init__.py": "WHO = 'the user parallel'\n",
    "tests_user/test_own.py": textwrap.dedent("""\
        from models import tinylm
        from parallel import WHO


        def test_own_packages():
            assert tinylm.build() == "the user tinylm" and WHO == "the user parallel"
        """),
    "pytest.ini": "[pytest]\n",
}

SCRIPT = textwrap.dedent("""\
    import sys
    sys.path.append({project!r})  # after the environment's packages
    from models import tinylm
    from parallel import WHO
    import harness.plugin, reference.tp  # the project's own names still import
    print(tinylm.build(), "|", WHO)
    """)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """paritytest installed by pip from a copy of this checkout into a directory of its own."""
    root = tmp_path_factory.mktemp("install")
    source = copy_checkout(root / "paritytest")
    site = root / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                           str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return site


def test_the_distribution_installs_only_the_projects_own_top_level_names(installed):
    names = {p.name for p in installed.iterdir() if (p / "__init__.py").exists() or p.suffix == ".py"}
    assert names == OWN_NAMES, f"the install claims {sorted(names - OWN_NAMES)} beside {sorted(OWN_NAMES)}"


def test_a_users_own_models_and_parallel_packages_are_never_shadowed(installed, tmp_path):
    project = UserProject(tmp_path / "userproj", USER_FILES)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(installed)}

    under_pytest = project.pytest("tests_user", env=env, timeout=300)
    assert under_pytest.returncode == 0, under_pytest.tail
    assert "1 passed" in under_pytest.stdout

    elsewhere = UserProject(tmp_path / "scripts", {"train.py": SCRIPT.format(project=str(project.path))}, ini=False)
    script = elsewhere.run("python", "train.py", env=env, timeout=300)
    assert script.returncode == 0, script.tail
    assert script.stdout.strip() == "the user tinylm | the user parallel"
