"""The kept pool (``--keep-pool`` / ``PARITYTEST_KEEP_POOL``), as a user runs it: docs/implementations.md's "Your own
implementation" project in a temp directory, pytest in a subprocess with this environment's
interpreter, the kept pool's socket directory and the temp directory private to the test.

* an edit of a registered implementation between two runs against one kept pool is seen;
* a kept pool exits after its idle timeout and leaves nothing: no process, no socket, no directory;
* a kept pool is not used across checkouts, unless they name one ``PARITYTEST_KEEP_POOL_SCOPE``;
  ``--stop-pool`` and ``python -m harness.pool stop``;
* a client killed outright takes its ranks with it, and the kept pool serves the next run;
* without a kept pool, an xdist run's workers share one keeper, gone with the run.
"""
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.checkout import copy_checkout, user_env
from tests.test_outside_project import IMPLEMENTATIONS, code_blocks, doc_section, project_files

ROOT = Path(__file__).resolve().parent.parent
# what one pytest run asks a kept pool for: the cells' pool and the pool of one beside it (references)
POOLS_PER_RUN = 2
ONE_CELL = "tp2 and fp32"


HEAVY_PROBE = """
import os, sys

def pytest_unconfigure(config):
    with open(os.environ["HEAVY_OUT"], "w") as out:
        out.write(" ".join(name for name in ("torch._dynamo", "sympy", "pandas") if name in sys.modules))
"""


def make_project(where: Path) -> Path:
    """docs/implementations.md's project (its package, conftest, test and pytest.ini), not installed: run from it."""
    for name, text in project_files(code_blocks(doc_section(IMPLEMENTATIONS, "Your own implementation"))).items():
        path = where / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (where / "mypkg" / "__init__.py").touch()
    return where


@pytest.fixture
def box(tmp_path):
    """Private runtime and temp directories, and the environment that points there."""
    runtime = Path(tempfile.mkdtemp(prefix="kp", dir="/tmp"))  # short: a socket's path has 108 bytes
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(user_env(), XDG_RUNTIME_DIR=str(runtime), TMPDIR=str(tmp))
    yield {"runtime": runtime, "tmp": tmp, "env": env, "root": tmp_path}
    # whatever a failed test left running: every kept pool in the test's own runtime directory
    subprocess.run([sys.executable, "-m", "harness.pool", "stop", "--all"], cwd=tmp_path, env=env, timeout=60)
    shutil.rmtree(runtime, ignore_errors=True)


def pytest_in(project: Path, env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=project,
                          env=env, capture_output=True, text=True, timeout=timeout)


def status(project: Path, env: dict) -> dict | None:
    """What the project's keeper says (asked from here: ``python -m harness.pool status`` would
    import torch first, longer than a short idle timeout)."""
    from harness.pool import kept

    saved = {k: os.environ.get(k) for k in ("XDG_RUNTIME_DIR", "PYTEST_XDIST_WORKER", kept.SCOPE_ENV)}
    os.environ["XDG_RUNTIME_DIR"] = env["XDG_RUNTIME_DIR"]
    os.environ.pop("PYTEST_XDIST_WORKER", None)  # the runs in the project are not xdist workers
    os.environ.pop(kept.SCOPE_ENV, None)
    if env.get(kept.SCOPE_ENV):
        os.environ[kept.SCOPE_ENV] = env[kept.SCOPE_ENV]
    try:
        return kept.status(str(project))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def gone(pid: int) -> bool:
    """Exited (a zombie nobody reaped counts: it runs nothing and holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line or working directory names ``text``: the keeper, its run
    zygotes and their ranks (forks of the keeper, with its command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if (text in cmdline or cwd.startswith(text)) and not gone(int(entry.name)):
            found.append(int(entry.name))
    return found


def left_in(directory: Path) -> list[str]:
    """What the harness left there (torch's own caches, ``torchinductor_<user>``, are not ours)."""
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("torchinductor_")) \
        if directory.exists() else []


def wait_until(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def test_python_and_python3_of_one_environment_share_its_kept_pool(tmp_path):
    """``.venv/bin/pytest`` runs python3 and ``.venv/bin/python -m pytest`` python: the same kept pool
    (before, ``--stop-pool`` from one missed the pools the other started, and each started its own)."""
    names = [n for n in ("python", "python3") if (Path(sys.prefix) / "bin" / n).exists()]
    if len(names) < 2:
        pytest.skip(f"this environment has only {names}")
    code = "from harness.pool import kept; print(kept.checkout_key('.'), kept.fingerprint())"
    said = {subprocess.run([str(Path(sys.prefix) / "bin" / n), "-c", code], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout for n in names}
    assert len(said) == 1, said


@pytest.mark.slow
def test_an_edit_of_a_registered_implementation_is_seen_by_the_next_run_on_a_kept_pool(box):
    project = make_project(box["root"] / "project")
    env = dict(box["env"], PARITYTEST_KEEP_POOL="120")
    # what the run imported, written as pytest ends: the edit loop's time is pytest's process's
    (box["root"] / "heavyprobe.py").write_text(HEAVY_PROBE)
    heavy = box["root"] / "heavy.txt"
    probed = dict(env, PYTHONPATH=str(box["root"]), HEAVY_OUT=str(heavy))
    first = pytest_in(project, probed, "-p", "heavyprobe", "-k", ONE_CELL)
    assert first.returncode == 0 and "1 passed" in first.stdout, first.stdout[-3000:] + first.stderr[-2000:]
    # a passing cell: its reference computed on a rank, no summary through pandas, no
    # torch.unravel_index (sympy): pytest's process imports torch and no more of torch's lazy modules
    assert heavy.read_text() == "", heavy.read_text()
    kept = status(project, env)
    assert kept and kept["runs"] == POOLS_PER_RUN, kept  # alive
    # and no run's ranks left, once the run zygote has seen its client's end (a fast client exits first)
    assert wait_until(lambda: status(project, env)["live"] == [], 10), status(project, env)

    impl = project / "mypkg" / "tp_impl.py"
    source = impl.read_text()
    assert "out = F.linear(x, w, b)" in source
    impl.write_text(source.replace("out = F.linear(x, w, b)", "out = F.linear(x, w, b) * 2"))
    second = pytest_in(project, env, "-k", ONE_CELL)
    assert second.returncode == 1, second.stdout[-3000:]
    assert "diverges from the reference" in second.stdout, second.stdout[-3000:]
    again = status(project, env)
    assert again["pid"] == kept["pid"] and again["runs"] == 2 * POOLS_PER_RUN, (kept, again)  # the same kept pool

    impl.write_text(source)
    third = pytest_in(project, env, "-k", ONE_CELL)
    assert third.returncode == 0 and "1 passed" in third.stdout, third.stdout[-3000:]
    assert status(project, env)["pid"] == kept["pid"]

    # python -m harness.bisect forks from the same kept pool (each check of a git bisect run), and
    # says which value it cannot read
    def bisect(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "harness.bisect", *args], cwd=project, env=dict(env, **extra),
                              capture_output=True, text=True, timeout=300)

    check = bisect("check", "tp-mine-tp2-fp32-op_colshard-b4.f32.h16.s8.v40-seed0")
    assert check.returncode == 0, check.stdout + check.stderr
    assert status(project, env)["pid"] == kept["pid"] and status(project, env)["runs"] > 3 * POOLS_PER_RUN
    wrong = bisect("check", "tp-mine-tp2-fp32-op_colshard-b4.f32.h16.s8.v40-seed0", PARITYTEST_KEEP_POOL="soon")
    assert wrong.returncode == 2 and "PARITYTEST_KEEP_POOL='soon'" in wrong.stderr, wrong.stderr
    assert "Traceback" not in wrong.stderr

    stopped = pytest_in(project, env, "--stop-pool")
    assert stopped.returncode == 0 and "stopped 1 kept pool" in stopped.stdout + stopped.stderr, stopped
    assert wait_until(lambda: gone(kept["pid"]), 30)
    assert left_in(box["runtime"]) == [] and left_in(box["tmp"]) == []


@pytest.mark.slow
def test_a_namespace_package_or_a_library_put_first_on_the_path_is_what_the_next_run_imports(box):
    """A kept pool holds the third-party modules a project imports; a run whose path finds one of
    them elsewhere (a patched copy put first on PYTHONPATH) must get that copy, not the held one: a
    namespace package (megatron: no ``__init__.py``, no file of its own, which a copy put first
    extends with a directory before the installed one), then a regular one (filelock). One project,
    one run after another, each adding one copy to the path: each run's keeper is stale by that
    copy alone, so neither check rides on the other's restart."""
    import filelock

    core = pytest.importorskip("megatron.core", reason="megatron-core (README's thirdparty extra) is the namespace "
                                                       "package installed here")
    namespace, library = box["root"] / "patched-megatron", box["root"] / "patched-filelock"
    (namespace / "megatron" / "core").mkdir(parents=True)
    (namespace / "megatron" / "core" / "__init__.py").write_text("# a patched megatron.core\n")
    shutil.copytree(os.path.dirname(filelock.__file__), library / "filelock")

    project = make_project(box["root"] / "project")
    impl = project / "mypkg" / "tp_impl.py"
    seen = box["root"] / "seen.txt"
    impl.write_text("import os\nimport megatron.core, filelock  # third-party: the kept pool imports them\n"
                    "open(os.environ['SEEN'], 'a').write(f'{megatron.core.__file__} {filelock.__file__}\\n')\n"
                    + impl.read_text())
    env = dict(box["env"], PARITYTEST_KEEP_POOL="120", SEEN=str(seen))
    patched_core, patched_lock = str(namespace / "megatron" / "core" / "__init__.py"), str(library / "filelock" / "__init__.py")
    for path, imported in [("", (core.__file__, filelock.__file__)),
                           (str(namespace), (patched_core, filelock.__file__)),
                           (os.pathsep.join([str(namespace), str(library)]), (patched_core, patched_lock))]:
        before = len(seen.read_text().splitlines()) if seen.exists() else 0
        done = pytest_in(project, dict(env, **({"PYTHONPATH": path} if path else {})), "-k", ONE_CELL)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        imported_now = seen.read_text().splitlines()[before:]  # by every process of this run that imported it
        assert imported_now and set(imported_now) == {" ".join(imported)}, (path, seen.read_text())
    pytest_in(project, env, "--stop-pool")


@pytest.mark.slow
def test_a_library_that_a_preloaded_module_imports_is_the_copy_the_runs_path_finds(box):
    """The keeper imports what a run asks it to preload, and with it what those modules import, from
    the keeper's own path: a run whose path finds one of those elsewhere (a patched copy put first on
    PYTHONPATH, as the Megatron zoo's planted bugs are) must get that copy. The keeper here was started
    by a run that imported neither; the next run's project imports jinja2, which imports markupsafe,
    patched on that run's path alone: not a module the keeper held, nor one the run asked for."""
    import markupsafe

    patched = box["root"] / "patched"
    shutil.copytree(os.path.dirname(markupsafe.__file__), patched / "markupsafe")
    project = make_project(box["root"] / "project")
    env = dict(box["env"], PARITYTEST_KEEP_POOL="120")
    assert pytest_in(project, env, "-k", ONE_CELL).returncode == 0
    seen = box["root"] / "seen.txt"
    impl = project / "mypkg" / "tp_impl.py"
    impl.write_text("import os\nimport jinja2  # third-party: the kept pool imports it, and markupsafe with it\n"
                    "import markupsafe\nopen(os.environ['SEEN'], 'a').write(markupsafe.__file__ + '\\n')\n"
                    + impl.read_text())
    done = pytest_in(project, dict(env, SEEN=str(seen), PYTHONPATH=str(patched)), "-k", ONE_CELL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert set(seen.read_text().split()) == {str(patched / "markupsafe" / "__init__.py")}, seen.read_text()
    pytest_in(project, env, "--stop-pool")


@pytest.mark.slow
def test_a_kept_pool_exits_after_its_idle_timeout_and_leaves_nothing(box):
    project = make_project(box["root"] / "project")
    env = dict(box["env"], PARITYTEST_KEEP_POOL="15")
    run = pytest_in(project, env, "-k", ONE_CELL)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
    kept = status(project, env)  # None only if this loaded machine took 15 s to get here: then it is gone
    if kept is not None:
        assert kept["idle"] == 15.0, kept
        assert wait_until(lambda: set(processes_naming(str(box["runtime"]))) <= {kept["pid"]}, 10)  # no ranks wait
        assert wait_until(lambda: gone(kept["pid"]), 60), "the kept pool outlived its idle timeout"
    assert wait_until(lambda: not processes_naming(str(box["runtime"])), 10)
    assert left_in(box["runtime"]) == []  # socket, lock file, log and their directory
    assert left_in(box["tmp"]) == []  # no pool directory


@pytest.mark.slow
def test_a_kept_pool_belongs_to_one_checkout_or_scope_and_stale_harness_files_restart_it(box, tmp_path):
    a, b = make_project(box["root"] / "project_a"), make_project(box["root"] / "project_b")
    # harness files of this test's own: touching this checkout's would make a keeper of a test running
    # beside this one (on the other xdist worker) stale as well
    checkout = copy_checkout(tmp_path / "checkout")
    env = dict(box["env"], PARITYTEST_KEEP_POOL="120", PYTHONPATH=str(checkout))
    assert pytest_in(a, env, "-k", ONE_CELL).returncode == 0
    assert pytest_in(b, env, "-k", ONE_CELL).returncode == 0
    in_a, in_b = status(a, env), status(b, env)
    assert in_a["pid"] != in_b["pid"] and in_a["runs"] == in_b["runs"] == POOLS_PER_RUN, (in_a, in_b)
    assert len([n for n in left_in(box["runtime"] / "paritytest") if n.endswith(".sock")]) == 2

    # a keeper whose harness files changed since it started is stale: the next run starts another
    os.utime(checkout / "harness" / "pool" / "kept.py")
    assert pytest_in(a, env, "-k", ONE_CELL).returncode == 0
    fresh = status(a, env)
    assert fresh["pid"] != in_a["pid"] and fresh["runs"] == POOLS_PER_RUN, (in_a, fresh)
    assert wait_until(lambda: gone(in_a["pid"]), 30)

    for project in (a, b):
        done = subprocess.run([sys.executable, "-m", "harness.pool", "stop"], cwd=project, env=env,
                              capture_output=True, text=True, timeout=60)
        assert "stopped 1 kept pool" in done.stderr, done.stderr
    assert wait_until(lambda: gone(fresh["pid"]) and gone(in_b["pid"]), 30)
    assert wait_until(lambda: left_in(box["runtime"]) == [], 10), left_in(box["runtime"] / "paritytest")
    assert left_in(box["tmp"]) == []

    # checkouts that name one scope share its kept pool (a test suite's many small projects)
    scoped = dict(env, PARITYTEST_KEEP_POOL_SCOPE="suite")
    assert pytest_in(a, scoped, "-k", ONE_CELL).returncode == 0
    assert pytest_in(b, scoped, "-k", ONE_CELL).returncode == 0
    shared = status(b, scoped)
    # one keeper (not its live zygotes: the last run's may still be ending as it is asked)
    keeper = lambda s: (s["pid"], s["runs"], s["fingerprint"])  # noqa: E731
    assert keeper(shared) == keeper(status(a, scoped)) and shared["runs"] == 2 * POOLS_PER_RUN, shared
    assert status(a, env) is None  # the checkout's own is another
    # a scope's keeper serves one harness at a time: a run from another copy of it gets a keeper of
    # that copy (its files carry the same mtimes), and once that copy is removed, a run from the first
    # gets one of its own again, not ranks importing the rest of a package that is gone
    impl = a / "mypkg" / "tp_impl.py"
    seen = box["root"] / "seen.txt"
    impl.write_text("import os, tempfile\nimport harness.pool.tasks\n"
                    "open(os.environ['SEEN'], 'a').write(f'{harness.pool.tasks.__file__} {tempfile.gettempdir()}\\n')\n"
                    + impl.read_text())
    other = Path(shutil.copytree(checkout, tmp_path / "other"))  # its files' mtimes too
    in_other = dict(scoped, PYTHONPATH=str(other), SEEN=str(seen))
    assert pytest_in(a, in_other, "-k", ONE_CELL).returncode == 0
    of_other = status(a, in_other)
    assert of_other["pid"] != shared["pid"] and of_other["runs"] == POOLS_PER_RUN, (shared, of_other)
    assert str(other / "harness" / "pool" / "tasks.py") in seen.read_text().split()
    shutil.rmtree(other)
    seen.unlink()
    done = pytest_in(a, dict(scoped, SEEN=str(seen)), "-k", ONE_CELL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    again = status(a, scoped)
    assert again["pid"] not in (shared["pid"], of_other["pid"]), (shared, of_other, again)
    tasks = str(checkout / "harness" / "pool" / "tasks.py")
    assert {line.split()[0] for line in seen.read_text().splitlines()} == {tasks}  # the run zygote's too
    # a run with a temp directory of its own: its ranks' is that one, not the one the keeper started with
    seen.unlink()
    own_tmp = box["root"] / "own-tmp"
    own_tmp.mkdir()
    assert pytest_in(a, dict(scoped, SEEN=str(seen), TMPDIR=str(own_tmp)), "-k", ONE_CELL).returncode == 0
    assert status(a, scoped)["pid"] == again["pid"]
    assert {line.split()[1] for line in seen.read_text().splitlines()} == {str(own_tmp)}
    done = subprocess.run([sys.executable, "-m", "harness.pool", "stop"], cwd=a, env=scoped,
                          capture_output=True, text=True, timeout=60)
    assert "stopped 1 kept pool" in done.stderr, done.stderr
    assert wait_until(lambda: all(gone(s["pid"]) for s in (shared, of_other, again))
                      and left_in(box["runtime"]) == [], 30)


@pytest.mark.slow
def test_under_xdist_each_worker_keeps_a_pool_and_status_and_stop_see_every_one(box):
    project = make_project(box["root"] / "project")

    def pool_command(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "harness.pool", *args], cwd=project, env=box["env"],
                              capture_output=True, text=True, timeout=120)

    done = pytest_in(project, box["env"], "-n", "2", "--keep-pool", "60", "-k", "tp2 or tp4")
    assert done.returncode == 0 and "4 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    shown = pool_command("status")
    said = json.loads(shown.stdout)
    assert shown.returncode == 0 and sorted(said) == ["gw0", "gw1"], shown.stdout + shown.stderr
    assert all(s["runs"] >= 1 for s in said.values()), said
    # an optional value takes the argument after it: the path given after --keep-pool is told as that
    wrong = pytest_in(project, box["env"], "--keep-pool", "tests_parity")
    assert wrong.returncode == 4 and "'tests_parity' is not a number of seconds: write --keep-pool=SECONDS" \
        in wrong.stderr, wrong.stderr
    assert "stopped 2 kept pool(s)" in pool_command("stop").stderr
    assert wait_until(lambda: all(gone(s["pid"]) for s in said.values()), 30)
    assert pool_command("status").returncode == 1


def keepers_of(runtime: Path) -> set[int]:
    """Live keepers started in a run whose runtime directory is ``runtime``: processes running
    ``keeper_main`` with that directory in their environment, not forked from one (run zygotes and
    ranks are forks of a keeper, with its command line)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if b"keeper_main" in cmdline and f"XDG_RUNTIME_DIR={runtime}".encode() in environ \
                and not gone(int(entry.name)):
            found[int(entry.name)] = parent
    return {pid for pid, parent in found.items() if parent not in found}


@pytest.mark.slow
def test_without_a_kept_pool_an_xdist_runs_workers_share_one_keeper_that_leaves_nothing(box):
    """Both workers' pools (cells' and pool of one each) fork from one keeper, which imported torch
    once; once the run ends, the keeper, its socket and lock file are gone."""
    from harness.pool.kept import receive, send

    project = make_project(box["root"] / "project")
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                            "-k", "tp2 or tp4"], cwd=project, env=box["env"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    keepers, said = set(), {}
    sockets = box["runtime"] / "paritytest"
    while run.poll() is None:
        keepers |= keepers_of(box["runtime"])
        for path in sockets.glob("run-*.sock") if sockets.exists() else ():
            with contextlib.suppress(OSError, EOFError, ValueError):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.settimeout(5)
                    sock.connect(str(path))
                    send(sock, {"op": "status"})
                    said = receive(sock)[0]
        time.sleep(0.1)
    out = run.stdout.read()
    run.stdout.close()
    assert run.returncode == 0 and "4 passed" in out, out[-3000:]
    assert len(keepers) == 1 and said.get("pid") in keepers, (keepers, said)
    assert said["runs"] == 2 * POOLS_PER_RUN, said  # each worker's cells' pool and pool of one
    assert wait_until(lambda: not keepers_of(box["runtime"]), 10), keepers_of(box["runtime"])
    assert wait_until(lambda: left_in(box["runtime"]) == [], 10), left_in(sockets)
    assert not [name for name in left_in(box["tmp"]) if name.startswith("harness-pool-")]  # pytest's own basetemp stays


@pytest.mark.slow
def test_a_client_killed_outright_takes_its_ranks_with_it_and_the_kept_pool_serves_the_next(box):
    project = box["root"] / "project"
    project.mkdir()
    script = textwrap.dedent("""
        import json, sys, time
        from harness.pool.parent import Pool

        pool = Pool(size=2, keep=120, preload=())
        pool.run("harness.pool.tasks:noop", None, (("tp", 2),))
        print(json.dumps(pool.pids), flush=True)
        time.sleep(600)
    """)
    client = subprocess.Popen([sys.executable, "-c", script], cwd=project, env=box["env"], stdout=subprocess.PIPE,
                              text=True)
    pids = json.loads(client.stdout.readline())
    assert len(pids) == 3  # the run's zygote and two ranks
    kept = status(project, box["env"])
    assert kept["live"] == [pids[0]]
    client.send_signal(signal.SIGKILL)
    client.wait()
    client.stdout.close()
    assert wait_until(lambda: all(gone(pid) for pid in pids), 30), [p for p in pids if not gone(p)]
    assert wait_until(lambda: status(project, box["env"])["live"] == [], 10)
    assert wait_until(lambda: left_in(box["tmp"]) == [], 10), [(p, sorted(os.listdir(p)), (p / "zygote.log").read_text() if (p / "zygote.log").exists() else "") for p in box["tmp"].iterdir()]

    again = subprocess.run([sys.executable, "-c", script.replace("time.sleep(600)", "pool.close()")], cwd=project,
                           env=box["env"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert status(project, box["env"])["pid"] == kept["pid"]
