"""python -m harness.golden diff / check, in temporary git clones and projects."""
import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.config import Config
from harness.golden.store import META_KEY
from harness.resolve import resolve
from tests.project import ROOT, UserProject, imported_modules


def git(cwd, *args):
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def clone(tmp_path) -> UserProject:
    """A clone of this checkout's committed state, with a local main at its HEAD."""
    path = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(path)], check=True)
    git(path, "config", "user.email", "t@example.invalid")
    git(path, "config", "user.name", "test")
    git(path, "checkout", "-q", "-B", "main")
    git(path, "checkout", "-q", "-b", "pr")
    return UserProject(path, ini=False)


def rewrite(path: Path, change) -> tuple[str, float, float]:
    """Apply ``change`` to one tensor of a golden file (metadata kept); return the tensor, its max abs
    and max rel change, computed here from the two tensors, not by the code under test."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    name = sorted(tensors)[len(tensors) // 2]
    old = tensors[name]
    tensors[name] = change(old.clone())
    diff = (tensors[name].double() - old.double()).abs()
    save_file(tensors, path, metadata=meta)
    return name, float(diff.max()), float((diff / old.double().abs()).nan_to_num(0.0).max())


def test_diff_lists_exactly_the_three_rewritten_goldens_with_their_largest_changes(clone):
    goldens = sorted((clone.path / "golden" / "tp").glob("*fp32*"))[:40]
    a, b, c = goldens[3], goldens[17], goldens[31]

    def nudge(t):  # one element by one ulp: not bit-identical, well within tolerance
        t.view(-1)[0] = torch.nextafter(t.view(-1)[0], torch.tensor(math.inf, dtype=t.dtype))
        return t

    def bump(t):  # one element moved by 0.5: beyond any tolerance
        t.view(-1)[-1] += 0.5
        return t

    planted = {a.name: rewrite(a, nudge), b.name: rewrite(b, bump), c.name: rewrite(c, lambda t: t * 1.25)}
    git(clone.path, "commit", "-qam", "rewrite three goldens")
    done = clone.harness("golden", "diff")  # the default base: the merge base with main
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.splitlines()[0].startswith("3 golden files changed, 0 added, 0 removed since ")
    assert "2 changed beyond the tolerance policy" in out.splitlines()[0]
    rows = [line for line in out.splitlines() if line.startswith("| `") or line.startswith("| |")]
    assert len(rows) == 3  # one changed tensor per file, nothing else listed
    listed = [row.split("|")[1].strip().strip("`") for row in rows]
    assert sorted(listed) == sorted(planted)
    assert listed[0] in (b.name, c.name)  # largest change first
    for row in rows:
        cells = [x.strip() for x in row.split("|")[1:-1]]
        name, (tensor, max_abs, max_rel) = cells[0].strip("`"), planted[cells[0].strip("`")]
        assert cells[1] == f"`{tensor}`" and cells[2] == "changed"
        assert float(cells[3]) == pytest.approx(max_abs, rel=1e-2)
        assert float(cells[4]) == pytest.approx(max_rel, rel=1e-2)
        assert cells[5] == "no"  # bit-identical
        cfg = Config.parse(name[: -len(".safetensors")])
        tol = resolve(cfg).policy().get(tensor)
        assert cells[6] == ("yes" if name == a.name else "**no**"), (name, tol)

    # uncommitted: one removed, one added (a copy under a new name), the committed three still listed
    (clone.path / "golden" / "tp" / goldens[5].name).unlink()
    shutil.copy(goldens[6], clone.path / "golden" / "tp" / "tp-new-tp1-fp32-op_mlp-b4-seed0.safetensors")
    out = clone.harness("golden", "diff", "main").stdout
    assert out.splitlines()[0].startswith("3 golden files changed, 1 added, 1 removed")
    assert f"- `golden/tp/{goldens[5].name}`" in out.split("removed:")[1]
    assert "- `golden/tp/tp-new-tp1-fp32-op_mlp-b4-seed0.safetensors`" in out.split("added:")[1]

    # against the commit that holds the three, only the uncommitted changes are left
    assert clone.harness("golden", "diff", "HEAD").stdout.startswith("0 golden files changed, 1 added, 1 removed")
    bad = clone.harness("golden", "diff", "no-such-rev")
    assert bad.returncode == 2 and "'no-such-rev' is not a revision of this repository" in bad.stderr


def test_diff_finds_the_base_of_a_repository_whose_default_branch_is_master(tmp_path):
    """A team's repository with master and no main, cloned as CI clones it (only the remote's
    branches), its pull request on a branch: the base is origin's default branch."""
    origin, work = tmp_path / "origin", tmp_path / "work"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(origin)], check=True)
    git(origin, "checkout", "-q", "-B", "master")
    for branch in git(origin, "branch", "--format=%(refname:short)").split():
        if branch != "master":
            git(origin, "branch", "-q", "-D", branch)
    subprocess.run(["git", "clone", "-q", str(origin), str(work)], check=True)
    git(work, "checkout", "-q", "-b", "pr")
    assert "main" not in git(work, "branch", "-a"), git(work, "branch", "-a")
    project = UserProject(work, ini=False)
    done = project.harness("golden", "diff", env={k: v for k, v in project.env().items() if k != "GITHUB_BASE_REF"})
    assert done.returncode == 0 and done.stdout.startswith("no golden file changed since "), done.tail
    # as in a pull request's workflow run, whatever origin's HEAD says
    git(work, "remote", "set-head", "origin", "--delete")
    done = project.harness("golden", "diff", env=project.env(GITHUB_BASE_REF="master"))
    assert done.returncode == 0 and done.stdout.startswith("no golden file changed since "), done.tail


def test_diff_on_an_unchanged_tree_says_so_without_importing_torch(clone):
    # the gate's common case, on every pull request: nothing to compare, so no torch (2 s) to import
    done = clone.run("python", "-X", "importtime", "-m", "harness.golden", "diff")
    assert done.returncode == 0 and done.stdout.startswith("no golden file changed since "), done.tail
    imported = imported_modules(done.stderr)
    assert "harness.golden.store" in imported and "torch" not in imported, sorted(imported)


CASES = '''
import pytest
from harness.matrix import cells
from reference.tp import SIZES

CELLS = cells("tp", impls=["ours", "mine"], meshes=["tp=1", "tp=2"], dtypes=["fp32"], sizes=SIZES,
              switches={"op": ["mlp"]})


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_tp(cfg, parity):
    parity(cfg)
'''


def test_check_lists_orphans_gaps_and_unreadable_goldens_and_fails_on_them(user_project):
    user_project.write({
        "test_cells.py": CASES,
        "skipper.py": "def skip(cfg):\n    return 'not here' if cfg.mesh == (('tp', 2),) else None\n",
        "conftest.py": "from harness.registry import register_implementation\n"
                       "register_implementation('tp', 'mine', 'harness.parallel.tp:run', skip='skipper:skip')\n"})
    # writes the goldens of the 3 cells that run
    assert user_project.run("python", "-m", "pytest", "-p", "no:cacheprovider", "--pool-size", "4").returncode == 0
    done = user_project.harness("golden", "check")
    assert done.returncode == 0, done.tail
    assert done.stdout.splitlines()[0] == "3 golden files, 4 collected cells: OK"
    assert "1 cells skipped on this machine have no golden file" in done.stdout

    tp = user_project.path / "golden" / "tp"
    gap = tp / "tp-ours-tp2-fp32-op_mlp-b4.f32.h16.s8.v40-seed0.safetensors"
    orphan = tp / "tp-ours-tp4-fp32-op_mlp-b4.f32.h16.s8.v40-seed0.safetensors"
    gap.rename(orphan)  # its cell lacks it, and it belongs to no cell (its metadata is fixed below)
    data = load_file(orphan)
    save_file(data, orphan, metadata={META_KEY: '{"config": "%s"}' % orphan.name[: -len(".safetensors")]})
    corrupt = tp / "tp-ours-tp1-fp32-op_mlp-b4.f32.h16.s8.v40-seed0.safetensors"
    corrupt.write_bytes(corrupt.read_bytes()[:50])
    done = user_project.harness("golden", "check")
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    # the corrupt file is one problem (unreadable), not also a gap of its cell
    assert lines[0] == "3 golden files, 4 collected cells: 1 unreadable, 1 orphans, 1 gaps, 0 collection errors"
    python = shlex.quote(sys.executable)
    (unreadable,) = [line for line in lines if line.startswith("unreadable: ")]
    assert unreadable.startswith(f"unreadable: golden/tp/{corrupt.name}: golden file")
    # whole, up to the command that recreates it
    assert unreadable.endswith(f"{python} -m pytest 'test_cells.py::test_tp[{corrupt.name[:-12]}]' --update-golden")
    assert f"orphan: golden/tp/{orphan.name}: no collected cell has this id" in done.stdout
    (only,) = [line for line in lines if line.startswith("gap: ")]
    assert only.split("[")[1].split("]")[0] == gap.name[:-12]
    # --update-golden writes only for a cell that matches the reference: said, not promised
    assert "if it matches the reference" in only and only.endswith(" --update-golden")
    assert "(a cell that diverges from the reference (or hangs, or crashes) writes no golden file" in done.stdout


def test_diff_outside_a_git_repository_is_one_line_naming_the_fix(tmp_path):
    project = UserProject(tmp_path / "project", ini=False)
    done = project.harness("golden", "diff")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"golden diff: {project.path} is not in a git repository, and diff compares golden files "
                           "with a git revision: run it from inside the checkout whose golden/ you changed\n")

