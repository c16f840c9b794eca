"""A copy of this checkout's sources, for tests that install or commit it elsewhere."""
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# at the top only: golden/ is the cells' golden files, harness/golden/ is code
TOP_LEVEL = {".git", ".venv", "golden", "build", ".paritytest", ".hypothesis", "reports"}
ANYWHERE = shutil.ignore_patterns("*.egg-info", "__pycache__")


def _ignore(directory: str, names: list[str]) -> set[str]:
    skipped = set(ANYWHERE(directory, names))
    if Path(directory).resolve() == ROOT:
        skipped |= TOP_LEVEL & set(names)
    return skipped


def copy_checkout(dest: Path) -> Path:
    """The checkout's sources at ``dest``, without its git history, venv, goldens and caches."""
    shutil.copytree(ROOT, dest, ignore=_ignore)
    return dest


# what a user's shell passes on: no PYTHONPATH, no variables of this test run; pip's settings kept
# (an index or a wheel cache this machine is set up with)
USER_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS",
            "PIP_CONSTRAINT", "PIP_CONFIG_FILE")


def user_env() -> dict[str, str]:
    """The environment of a user's shell on this machine, without this test run's virtual
    environment on PATH: a command run with it uses what it installed, not what the tests have."""
    env = {k: v for k, v in os.environ.items() if k in USER_ENV}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(Path(sys.executable).parent)))
    return env


def venv_over_this_one(dest: Path) -> Path:
    """A virtual environment at ``dest`` that sees this run's installed packages and installs into its
    own: a package ``pip --python`` puts there shadows this run's, as it would have replaced it in a
    user's (seconds, where installing torch and the extras anew takes minutes). Its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    (own,) = Path(dest, "lib").glob("python*/site-packages")
    # addsitedir, not a bare path: this run's own .pth files (the editable install's finder) apply too
    (own / "_this_run.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()))
    return Path(dest, "bin", "python")


def venv_with_release(dest: Path, requirement: str) -> Path:
    """:func:`venv_over_this_one` at ``dest`` with ``requirement`` (``torchtitan==0.2.2``) installed into
    it without its dependencies, shadowing this run's: another release of a library the harness
    drives, as a user who installed it over README's would have. Its interpreter."""
    python = venv_over_this_one(dest)
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                           requirement], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return python
