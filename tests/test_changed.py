"""``pytest cases/ --changed REF`` on real changes to this repository, made in a clone of it (the
command a pull request's gate runs, in a subprocess): a change to ``harness/parallel/moe.py`` selects
the MoE and composed cells and nothing else; one to the harness's machinery (``harness/cell.py``, or
a package's ``__init__`` that runs for it) every cell; a changed golden file its own cell; a docs-only change no cell; a ref git does not know
is a usage error naming the fix."""
import re
import subprocess
from collections import Counter

import pytest

from tests.project import ROOT, UserProject


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> UserProject:
    where = tmp_path_factory.mktemp("changed") / "repo"
    subprocess.run(["git", "clone", "-q", "--local", str(ROOT), str(where)], check=True)
    # the working tree's own state, committed in the clone: what a pull request's head holds
    tracked = subprocess.run(["git", "ls-files", "-m", "-o", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    for name in tracked:
        if (ROOT / name).is_file():
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            (where / name).write_bytes((ROOT / name).read_bytes())
    for cmd in (["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "head"]):
        subprocess.run(["git", *cmd], cwd=where, check=True)
    return UserProject(where, ini=False)


@pytest.fixture(scope="module")
def every(clone) -> Counter:
    """Cells by component that the unchanged clone collects (each test undoes its change)."""
    return selected(clone)[0]


def selected(clone: UserProject, *args: str) -> tuple[Counter, str]:
    """Cells by component that ``pytest cases/ --collect-only`` selects with ``args``, and its output."""
    done = clone.pytest("cases/", "--collect-only", *args, timeout=300)
    ids = re.findall(r"^cases/\S+::\w+\[([a-z0-9]+)-", done.stdout, re.M)
    return Counter(ids), done.stdout + done.stderr


def changing(clone: UserProject, path: str, text: str = "\n# a change\n"):
    """Append ``text`` to ``path`` in the clone's working tree; undone by the returned function."""
    file = clone.path / path
    before = file.read_bytes()
    file.write_bytes(before + text.encode())
    return lambda: file.write_bytes(before)


def selected_after(clone: UserProject, path: str) -> tuple[Counter, str]:
    """:func:`selected` with ``--changed HEAD`` after a change to ``path``, undone after."""
    undo = changing(clone, path)
    try:
        return selected(clone, "--changed", "HEAD")
    finally:
        undo()


def test_a_change_to_the_moe_component_selects_its_cells_and_the_composed_models(clone, every):
    cells, out = selected_after(clone, "harness/parallel/moe.py")
    assert set(cells) == {"moe", "composed"}, (cells, out[-2000:])
    assert cells["moe"] == every["moe"] and cells["composed"] == every["composed"]
    assert "--changed: 1 files changed (1 modules, 0 golden files)" in out


def test_a_change_to_the_machinery_selects_every_cell(clone, every):
    cells, out = selected_after(clone, "harness/cell.py")
    assert cells == every and len(every) >= 8, (cells, every)
    assert "the harness's machinery among them (harness.cell): every cell" in out


def test_a_change_to_the_component_table_selects_every_cell(clone, every):
    """``harness/components.py`` names every component's code by path (no import edge): all cells."""
    cells, out = selected_after(clone, "harness/components.py")
    assert cells == every and "(harness.components): every cell" in out, out[-2000:]


def test_a_package_init_runs_for_every_module_under_it(clone, every):
    """``harness/meshes/__init__.py`` runs whenever a module under it is imported: a change to it moves
    the cells a change to ``harness/meshes/device_mesh.py`` moves (every model cell's plan imports it;
    the pool's ranks do not, so a tp cell of ours is not among them). ``harness/pool/__init__.py``
    runs above the pool's rank loop: a change to it is a change to the machinery, every cell."""
    under, _ = selected_after(clone, "harness/meshes/device_mesh.py")
    init, _ = selected_after(clone, "harness/meshes/__init__.py")
    assert init == under and under["titan"] == every["titan"] and 0 < under["tp"] < every["tp"], (init, under)
    cells, _ = selected_after(clone, "harness/pool/__init__.py")
    assert cells == every


def test_a_changed_golden_selects_its_cell_and_docs_select_none(clone):
    golden = sorted((clone.path / "golden" / "tp").glob("*.safetensors"))[0]
    undo = [changing(clone, str(golden.relative_to(clone.path)), ""), changing(clone, "docs/ci.md")]
    golden.write_bytes(golden.read_bytes() + b"\0")
    try:
        cells, out = selected(clone, "--changed", "HEAD")
    finally:
        for u in undo:
            u()
    assert cells == Counter({"tp": 1}) and f"[{golden.stem}]" in out, (cells, out[-2000:])


def test_a_ref_git_does_not_know_is_a_usage_error(clone):
    _, out = selected(clone, "--changed", "no-such-ref")
    assert "--changed no-such-ref: git rev-parse" in out and "e.g. --changed origin/main" in out, out[-2000:]
    assert "Traceback" not in out


def test_a_change_that_moves_nothing_passes_and_says_so_under_xdist(clone):
    # a pull request that touches docs only, with exploration's output lying in the checkout
    undo = changing(clone, "README.md")
    (clone.path / "explore-out").mkdir(exist_ok=True)
    (clone.path / "explore-out" / "result.json").write_text("[]\n")
    try:
        done = clone.run("python", "-m", "pytest", "cases/", "-n", "2", "-p", "no:cacheprovider", "--changed", "HEAD")
    finally:
        undo()
        (clone.path / "explore-out" / "result.json").unlink()
    out = done.stdout + done.stderr
    assert done.returncode == 0, done.tail  # not pytest's 5: the gate's step passes
    assert "--changed: 1 files changed (0 modules, 0 golden files)" in out, done.tail  # README alone, said under -n
    assert "--changed HEAD: the change moves no cell and no test: nothing to run (exit 0)" in out, done.tail
