"""``python -m harness.bisect`` in a user's own project, as docs/implementations.md's "Your own implementation"
builds it.

The project (the page's files: ``pytest.ini`` with ``testpaths``, ``tests_parity/conftest.py``
registering ``tp``/``mine``, ``mypkg/tp_impl.py``) lives in a temporary directory; the harness is
installed into a virtual environment by the page's own install command, once for the run; every
command runs in a subprocess with the user's environment (no PYTHONPATH). The planted bug is the
user's column-parallel layer with its backward all-reduce forgotten: ``grad/x`` diverges when tp > 1.
"""
import json
import subprocess
from pathlib import Path

import pytest

from tests.checkout import user_env
from tests.conftest import flat
from tests.test_bisect import OUT
from tests.test_outside_project import (IMPLEMENTATIONS, code_blocks, doc_section, install_the_pages_project,
                                        project_files)

pytestmark = pytest.mark.slow

REDUCED = "    for t in (x.grad, total):  # partial sums over my features\n"
FORGOTTEN = "    for t in (total,):  # x.grad's all-reduce forgotten\n"
CELL = "tp-mine-tp2-fp32-op_colshard-b4.f32.h16.s8.v40-seed0"  # one of the page's test_mine.py cells
WIDE = "tp-mine-tp4-bf16-op_colshard-b4.f32.h16.s8.v40-seed0"


@pytest.fixture(scope="module")
def python(tmp_path_factory) -> Path:
    """The interpreter of a virtual environment made by the page's install command (in the page's own
    project, installed once for this module, a minute or two), outside the projects these tests make."""
    return install_the_pages_project(tmp_path_factory.mktemp("pages")) / ".venv" / "bin" / "python"


def make_project(path: Path, bug: bool = False) -> Path:
    """docs/implementations.md's project at ``path``; with ``bug``, its layer's backward all-reduce forgotten."""
    for name, text in project_files(code_blocks(doc_section(IMPLEMENTATIONS, "Your own implementation"))).items():
        if name == "mypkg/tp_impl.py" and bug:
            assert REDUCED in text, "docs/implementations.md's layer changed: update REDUCED"
            text = text.replace(REDUCED, FORGOTTEN)
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    (path / "mypkg" / "__init__.py").touch()
    return path


def bisect(python: Path, project: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m harness.bisect ...`` typed in the project's directory."""
    return subprocess.run([str(python), "-m", "harness.bisect", *args, "--pool-size", "4", "--case-deadline", "120"],
                          cwd=project, env=user_env(), capture_output=True, text=True, timeout=timeout)


def test_check_exits_0_on_the_users_layer_and_1_on_its_bug(python, tmp_path):
    good = make_project(tmp_path / "good")
    done = bisect(python, good, "check", CELL)
    assert done.returncode == 0 and f"{CELL}: match" in done.stdout, done.stdout + done.stderr
    assert sorted(p.name for p in good.iterdir()) == ["mypkg", "pytest.ini", "tests_parity"]  # nothing left behind
    buggy = make_project(tmp_path / "buggy", bug=True)
    done = bisect(python, buggy, "check", CELL)
    assert done.returncode == 1 and "mismatch in grad/x" in done.stdout, done.stdout + done.stderr


def test_a_name_not_registered_is_a_usage_error_saying_where_bisect_looked(python, tmp_path):
    good = make_project(tmp_path / "good")
    conftest = good / "tests_parity" / "conftest.py"
    unknown = bisect(python, good, "check", CELL.replace("-mine-", "-yours-"))
    assert unknown.returncode == 2, unknown.stdout + unknown.stderr
    message = unknown.stderr.strip()
    lines = message.splitlines()  # one message, wrapped to the screen: its continuations indented
    assert all(line.startswith("  ") for line in lines[1:]) and max(map(len, lines)) <= 200, message
    assert "no divergence" not in message
    message = flat(message)
    for part in ("unknown implementation 'yours' of tp", "registered: dtensor, hf, megatron, mine, ours",
                 f"rootdir {good}", f"ini file {good / 'pytest.ini'}", f"loaded conftests: {conftest}",
                 "register_implementation('tp', 'yours', 'module:run') in a conftest.py"):
        assert part in message, message
    component = bisect(python, good, "check", CELL.replace("tp-", "tq-", 1))
    said = flat(component.stderr)
    assert component.returncode == 2 and "unknown component 'tq'; registered: accelerate, ckpt" in said
    assert f"loaded conftests: {conftest}" in said, component.stderr
    run = bisect(python, good, "run", CELL.replace("-mine-", "-yours-"))
    assert run.returncode == 2 and "unknown implementation 'yours' of tp" in flat(run.stderr), run.stdout + run.stderr
    assert not (good / ".paritytest").exists()  # a usage error writes nothing


def test_run_on_an_id_of_the_users_implementation_shrinks_it(python, tmp_path):
    project = make_project(tmp_path / "project", bug=True)
    done = bisect(python, project, "run", WIDE)
    assert done.returncode == 1, done.stdout + done.stderr
    found = json.loads((project / OUT / "result.json").read_text())
    assert found["minimal"].startswith("tp-mine-tp2-fp32-op_colshard-") and found["essential"] == ["tp=2"]
    assert found["tensors"][0] == "grad/x" and f"harness.bisect check {found['minimal']}" in done.stdout
    # the interpreter is the installed one, outside the project: named whole, as a failing cell's reproduce line does
    assert f"reproduce: {python} -m harness.bisect check {found['minimal']}" in done.stdout.splitlines()
    assert sorted(p.name for p in project.iterdir()) == [".paritytest", "mypkg", "pytest.ini", "tests_parity"]
    assert max(map(len, (done.stdout + done.stderr).splitlines())) <= 200, done.stdout + done.stderr


def test_run_on_a_component_bisects_the_first_failing_cell_pytest_collects(python, tmp_path):
    project = make_project(tmp_path / "project", bug=True)
    done = bisect(python, project, "run", "tp")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"first failing tp cell: {CELL}" in done.stderr  # tp1 cells match; the first tp2 one does not
    found = json.loads((project / OUT / "result.json").read_text())
    assert found["original"] == CELL and found["minimal"].startswith("tp-mine-tp2-fp32-")
    unknown = bisect(python, project, "run", "tq")
    assert unknown.returncode == 2 and "unknown component 'tq'" in flat(unknown.stderr), unknown.stderr


def test_git_bisect_run_names_the_commit_that_broke_the_users_layer(python, tmp_path):
    repo = make_project(tmp_path / "repo")
    layer = repo / "mypkg" / "tp_impl.py"

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                              capture_output=True, text=True, check=True)
        return done.stdout.strip()

    def commit(message: str) -> str:
        git("add", "-A")
        git("commit", "-qm", message)
        return git("rev-parse", "HEAD")

    git("init", "-q")
    first = commit("my layer, as docs/implementations.md has it")
    layer.write_text(layer.read_text() + "# a harmless comment\n")
    commit("a comment")
    layer.write_text(layer.read_text().replace(REDUCED, FORGOTTEN))
    breaking = commit("a refactor that drops the backward all-reduce")
    (repo / "tests_parity" / "test_mine.py").write_text((repo / "tests_parity" / "test_mine.py").read_text() + "\n")
    commit("later")
    git("bisect", "start", "HEAD", first)
    done = subprocess.run(["git", "bisect", "run", str(python), "-m", "harness.bisect", "check", CELL,
                           "--pool-size", "2", "--case-deadline", "120"],
                          cwd=repo, env=user_env(), capture_output=True, text=True, timeout=900)
    assert f"{breaking} is the first bad commit" in done.stdout, done.stdout + done.stderr
    git("bisect", "reset")
