"""A copy of this checkout's sources, for tests that install or commit it elsewhere."""
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# at the top only: golden/ is the cells' golden files, harness/golden/ is code
TOP_LEVEL = {".git", ".venv", "golden", "build", "bisect-out", ".hypothesis"}
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
