"""The pool's temporary directory goes, however the processes that own it die.

A CI runner's timeout SIGKILLs pytest and its xdist workers while both cores are busy: the zygotes
and ranks then die on their own, and whatever of the pool exits last must take its directory with
it. When everything is killed at once nobody is left to do that, so the next pool to start in the
same temporary directory removes the directories whose owners are all gone, and only those.
"""
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, own_pool_env

DIR = "harness-pool-*"


@contextlib.contextmanager
def busy_cores(n: int = 2):
    """``n`` processes spinning on a core each, as the other jobs of a loaded CI runner do."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()  # state, ppid, ...
    except OSError:
        return None


def run_processes(tmpdir: Path) -> list[int]:
    """The live processes (zombies excluded) whose TMPDIR is ``tmpdir``: every process of one run."""
    marker = f"TMPDIR={tmpdir}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read() + b"\0"
        except OSError:
            continue
        stat = _stat(int(entry))
        if marker in environ and stat and stat[0] != "Z":
            found.append(int(entry))
    return found


def children(pid: int) -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and (_stat(int(e)) or [0, 0])[1] == str(pid)]


def wait_until(check, timeout: float, step: float = 0.2):
    """``check()`` once it is falsy, or its last value after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while (value := check()) and time.monotonic() < end:
        time.sleep(step)
    return value


def reap(tmpdir: Path) -> None:
    """Kill what a failed test's run left alive, so that a failure leaves no process behind."""
    for pid in run_processes(tmpdir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def user_env(tmpdir: Path) -> dict[str, str]:
    return own_pool_env(dict(os.environ, TMPDIR=str(tmpdir), PYTHONPATH=str(ROOT)))  # the pool the run starts


@pytest.mark.slow
def test_sigkill_of_pytest_and_its_workers_under_busy_cores_leaves_nothing(tmp_path):
    """A loaded run: ``pytest -n 2`` over tp4 cells, both cores busy, pytest and its two workers
    SIGKILLed after 3 cells: one worker with pytest, mid-cell, the other 6 s later, when execnet has
    interrupted it (after 5 s without its controller) and it is tearing its pools down. Every
    process of the run and every pool directory must go by themselves."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    lines: queue.Queue = queue.Queue()
    with busy_cores():
        run = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-n", "2", "-v", "cases/test_tp.py", "-k", "tp4",
             "--case-deadline", "120"],
            cwd=ROOT, env=user_env(tmpdir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        threading.Thread(target=lambda: [lines.put(line) for line in run.stdout], daemon=True).start()
        try:
            seen, cells, end = [], 0, time.monotonic() + 600
            while cells < 3:
                try:
                    line = lines.get(timeout=max(0.0, end - time.monotonic()))
                except queue.Empty:
                    pytest.fail("3 cells did not finish in 600 s:\n" + "".join(seen[-30:]))
                seen.append(line)
                cells += bool(re.search(r"\b(PASSED|FAILED|XFAIL|XPASS|ERROR)\b", line))
                assert run.poll() is None or cells >= 3, "pytest ended early:\n" + "".join(seen[-30:])
            workers = children(run.pid)
            pools = sorted(tmpdir.glob(DIR))
            # the run is mid-flight: each worker holds its cells' pool and the pool of one beside it
            assert len(workers) == 2 and len(pools) == 4, (workers, pools)
            run.kill()
            run.wait()
            for stagger, pid in zip((0.0, 6.0), workers):
                time.sleep(stagger)
                with contextlib.suppress(ProcessLookupError):  # a worker may have ended by itself
                    os.kill(pid, signal.SIGKILL)
            left = wait_until(lambda: run_processes(tmpdir), 60)
            assert left == [], f"processes of the run still alive 60 s after the kill: {left}"
            stale = wait_until(lambda: sorted(tmpdir.glob(DIR)), 30)
            assert stale == [], f"pool directories left behind with every process of the run gone: {stale}"
        finally:
            run.kill()
            run.wait()
            reap(tmpdir)


def _python(code: str, tmpdir: Path, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=user_env(tmpdir), text=True, **kwargs)


CREATE = "from harness.pool import pooldir; print(pooldir.create()[0], flush=True)"
CREATE_AND_FORK = """
import os, sys
from harness.pool import pooldir
path, _ = pooldir.create()
if os.fork() == 0:  # the child shares the hold, as a zygote's ranks do
    sys.stdin.readline()
    os._exit(0)
print(path, flush=True)
os._exit(0)
"""


def test_sweep_removes_only_the_directories_no_live_process_holds(tmp_path):
    """Owners are real processes holding the directory: one exited, one alive, one exited leaving a
    forked child (as a zygote leaves its ranks) that holds it still."""
    gone = _python(CREATE, tmp_path, stdout=subprocess.PIPE)
    dead_owner = Path(gone.communicate(timeout=60)[0].strip())
    live = _python(CREATE + "; import sys; sys.stdin.readline()", tmp_path, stdin=subprocess.PIPE,
                   stdout=subprocess.PIPE)
    forked = _python(CREATE_AND_FORK, tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        live_owner = Path(live.stdout.readline().strip())
        held_by_child = Path(forked.stdout.readline().strip())
        forked.wait(timeout=60)
        # made by an older harness, without a lock: nothing says whether its owner lives
        older = tmp_path / "harness-pool-k2x8_q0a"
        older.mkdir()
        # a creator killed between making its directory and locking it: its pid, long gone
        unlocked = tmp_path / f"harness-pool-{gone.pid}-abcd1234"
        unlocked_new = tmp_path / f"harness-pool-{gone.pid}-efgh5678"
        unlocked.mkdir()
        unlocked_new.mkdir()
        os.utime(unlocked, (time.time() - 600, time.time() - 600))
        other = tmp_path / "not-a-pool"
        other.mkdir()

        from harness.pool import pooldir

        assert sorted(pooldir.sweep(str(tmp_path))) == sorted(map(str, [dead_owner, unlocked]))
        for kept in (live_owner, held_by_child, older, unlocked_new, other):
            assert kept.is_dir(), kept
        for owner in (live, forked):  # the live owner and the forked child go
            owner.stdin.close()
        live.wait(timeout=60)

        def still_there() -> list[Path]:
            pooldir.sweep(str(tmp_path))
            return [d for d in (live_owner, held_by_child) if d.exists()]

        assert wait_until(still_there, 30) == []
    finally:
        for p in (gone, live, forked):
            p.kill()
            p.wait()
        reap(tmp_path)


START_POOL = """
import json, sys
from harness.pool import kept
from harness.pool.parent import Pool
pool = Pool(size=2)
pool.start()
print(json.dumps([pool.pids, pool._tmp, kept.fork_server()._proc.pid]), flush=True)
sys.stdin.readline()
"""


def test_a_new_pool_removes_what_a_pool_killed_all_at_once_left_and_keeps_a_live_pool(tmp_path):
    """SIGKILL of the parent, its keeper, the zygote and the ranks together: nobody is left to remove
    the directory, so the next pool started in that temporary directory does; a live pool's stays."""
    first = _python(START_POOL, tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    live = _python(START_POOL, tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        (zygote, *ranks), killed, keeper = json.loads(first.stdout.readline())
        _, live_dir, _ = json.loads(live.stdout.readline())
        os.killpg(zygote, signal.SIGKILL)  # the zygote and its ranks: their own session
        os.kill(keeper, signal.SIGKILL)  # else it is the last one out, and sweeps as it ends
        first.kill()
        first.wait(timeout=60)
        gone = [zygote, *ranks, keeper]
        assert wait_until(lambda: [p for p in gone if _stat(p) and _stat(p)[0] != "Z"], 30) == []
        time.sleep(1)
        assert Path(killed).is_dir()  # nobody could remove it (the situation swept below)

        nxt = _python(START_POOL, tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        _, new_dir, _ = json.loads(nxt.stdout.readline())
        assert not Path(killed).exists(), f"the next pool left {killed} in place"
        assert Path(live_dir).is_dir() and Path(new_dir).is_dir()
        for p in (nxt, live):  # normal exits take their own directories
            p.communicate("go\n", timeout=60)
        assert sorted(tmp_path.glob(DIR)) == []
    finally:
        for p in (first, live):
            p.kill()
            p.wait()
        reap(tmp_path)


WRITING_POOL = """
import json
from harness.pool.parent import Pool
pool = Pool(size=2, deadline=600)
pool.start()
print(json.dumps([pool.pids, pool._tmp]), flush=True)
pool.run("tests.faults:write_files_forever", None, (("tp", 2),))
"""


def rank_files(pool_dir: Path) -> list[Path]:
    """Rank 1's files in the pool's task directories; a task directory the pool removes mid-listing
    (Python 3.11's glob does not tolerate that) reads as none yet."""
    try:
        return list(pool_dir.glob("task*/rank1-*"))
    except FileNotFoundError:
        return []


def test_parent_killed_while_ranks_write_in_the_pool_directory(tmp_path):
    """The parent SIGKILLed while its ranks write in the task's scratch (as a checkpoint save does):
    the directory must go with the pool, not race with the ranks still writing there."""
    with busy_cores():
        parent = _python(WRITING_POOL, tmp_path, stdout=subprocess.PIPE)
        try:
            pids, pool_dir = json.loads(parent.stdout.readline())
            assert wait_until(lambda: not rank_files(Path(pool_dir)), 120) is False
            parent.kill()
            parent.wait()
            assert wait_until(lambda: run_processes(tmp_path), 60) == []
            assert wait_until(lambda: sorted(tmp_path.glob(DIR)), 30) == []
        finally:
            parent.kill()
            parent.wait()
            reap(tmp_path)
