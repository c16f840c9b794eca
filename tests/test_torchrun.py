"""torchrun mode: real ``torchrun`` (``python -m torch.distributed.run``) jobs of pytest processes.

Each test starts torchrun as a user would and reads what rank 0 reports (its junit XML, its
output); nothing is mocked. The planted faults live in a temporary project's own implementations
(registered from its conftest), never in this project's code.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.pool.parent import free_port  # outside the ephemeral range: no gloo connection takes it meanwhile
from harness.report import junit

ROOT = Path(__file__).resolve().parents[1]

# Every component and the mesh layouts, on meshes of 1 to 4 ranks: 1-rank, 2-rank, 3-rank (uneven
# shards) and 4-rank cells (so under 4 ranks some cells leave ranks idle), and the pool-bound mesh
# checks that use ``rank_pool`` directly.
SELECTION = [
    "tp-ours-tp1-fp32-op_xent-", "tp-ours-tp4-fp32-op_mlp-", "tp-ours-dp2.tp2-fp32-op_sp-",
    "tp-dtensor-tp3-fp32-op_colshard-", "tp-ours-tp2-bf16-op_colgather-",
    "ringattn-ours-cp4-fp32-gqa_on.layout_zigzag.mask_causal-b2.d4.h16.q4.s48", "ringattn-torch-cp2-fp32-gqa_on.layout_zigzag.mask_causal-b2.d4.h16.q4.s48",
    "moe-ours-ep2-fp32-cap_none.emesh_dense.norm_off.route_rand.score_softmax-e4",
    "moe-ours-ep4-fp32-cap_100.emesh_dense.norm_on.route_rand.score_softmax-e8",
    "pp-ours-pp2-fp32-sched_1f1b.tied_on-b2", "pp-torch-pp2-fp32-sched_gpipe.tied_on-b3",
    "pp-ours-pp4-fp32-sched_interleaved.tied_on-b4",
    "fsdp-ours-dp2-fp32-plain-b72.f13.h6.m1", "fsdp-fsdp2-dp2-bf16-plain-b72.f13.h6.m1", "fsdp-ours-dp4-bf16-plain-b72.f13.h6.m3",
    "ckpt-dcp-w2-fp32-load_fsdp2.save_fsdp1-", "ckpt-dcp-w4-fp32-load_hsdp2x2.save_fsdp1-",
]
# -k takes no "=" or ",": the layouts by their dims' names (world=2 and world=4 layouts run, the
# world=8 ones skip in both runs alike, 8 not dividing 4)
MESHES = ["test_every_named_group and pp and cp and ep and not dp and not tp",
          "test_every_named_group and dp and ep and not pp and not cp and not tp and not rep"]
K = " or ".join(SELECTION + [f"({m})" for m in MESHES])


@pytest.fixture(autouse=True)
def private_tmpdir(tmp_path, monkeypatch):
    """The jobs' temp directory (rank logs of failing ranks, scratch) inside the test's, which
    pytest removes: a job that fails on purpose leaves nothing in the system's."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))


def env_for(project: Path | None = None) -> dict:
    paths = [str(ROOT)] + ([str(project)] if project else []) + [os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))


def torchrun(launcher: list[str], pytest_args: list[str], *, cwd: Path = ROOT, env: dict | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    """``torchrun <launcher> -m pytest <pytest_args>``, from ``cwd``."""
    command = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "pytest", "-p", "no:cacheprovider",
               *pytest_args]
    return subprocess.run(command, cwd=cwd, env=env or env_for(), capture_output=True, text=True, timeout=timeout)


def failed_ranks(output: str) -> list[int]:
    """The ranks torchrun's closing summary names as failed (``rank      : 6 (local_rank: 6)``)."""
    return sorted({int(r) for r in re.findall(r"^\s*rank\s*:\s*(\d+) \(local_rank", output, re.MULTILINE)})


def rank_log_tails(output: str, logs: Path, chars: int = 3000) -> str:
    """For a failed job's assertion message: the end of the ``--rank-logs`` log of every rank that
    torchrun names as failed (rank 0's output is the job's own), or of every log that reports an
    error when it names none; the logs themselves go with the test's tmp dir."""
    named = [r for r in failed_ranks(output) if r != 0]
    paths = [logs / f"rank{r}.log" for r in named] if named else [
        p for p in sorted(logs.glob("rank*.log")) if re.search(r"Error|Traceback|failed|error", p.read_text(errors="replace"))]
    tails = []
    for path in paths:
        text = path.read_text(errors="replace") if path.exists() else "(no log: the rank did not start pytest)"
        tails.append(f"--- {path.name}, its last {chars} characters ---\n{text[-chars:]}")
    return "\n".join(tails) or f"(torchrun names no failed rank but 0, and no log in {logs} reports an error)"


def outcomes(path: Path) -> list[tuple[str, str, str]]:
    """(node id, outcome, skip reason) of every test in a junit XML file, in file order."""
    return [(case.nodeid, case.outcome, case.skip_reason) for case in junit.read([path]).cases]


def test_a_selection_across_every_component_matches_the_pool_run(tmp_path):
    pool_xml, torchrun_xml = tmp_path / "pool.xml", tmp_path / "torchrun.xml"
    start = time.perf_counter()
    pool = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "cases/", "-k", K,
                           "--pool-size", "4", "--junitxml", str(pool_xml), "-q"],
                          cwd=ROOT, env=env_for(), capture_output=True, text=True, timeout=600)
    pool_seconds = time.perf_counter() - start
    assert pool.returncode == 0, pool.stdout[-3000:] + pool.stderr[-2000:]

    start = time.perf_counter()
    run = torchrun(["--standalone", "--nproc-per-node", "4"],
                   ["cases/", "-k", K, "--junitxml", str(torchrun_xml), "--rank-logs", str(tmp_path / "logs")])
    torchrun_seconds = time.perf_counter() - start
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[:6000]
    print(f"pool: {pool_seconds:.1f} s, torchrun: {torchrun_seconds:.1f} s (wall, including start)")

    expected, got = outcomes(pool_xml), outcomes(torchrun_xml)
    assert got == expected  # same ids, same order, same verdicts and skip reasons
    cells = junit.read([torchrun_xml]).cells
    assert {c.record["component"] for c in cells} == {"tp", "ringattn", "moe", "pp", "fsdp", "ckpt"}
    assert all(c.outcome in ("passed", "skipped") for c in cells)
    assert sum(c.outcome == "passed" for c in cells) >= 15
    assert sum(1 for nodeid, outcome, _ in got if "test_meshes" in nodeid and outcome == "passed") == 2
    # one report, rank 0's: the others wrote theirs into their own logs
    assert run.stdout.count("parity summary") == 1
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["rank1.log", "rank2.log", "rank3.log"]
    assert "passed" in (tmp_path / "logs" / "rank3.log").read_text()


@pytest.mark.slow
def test_two_hosts_simulated_run_eight_rank_cells(tmp_path):
    """Two torchrun processes (two "hosts") meet at a c10d rendezvous on 127.0.0.1, 4 ranks each."""
    port = free_port()
    selection = "tp-ours-tp8-fp32-op_mlp- or tp-ours-dp2.tp4-fp32-op_sp- or ringattn-ours-cp8-fp32-gqa_on.layout_zigzag.mask_causal-"
    xml = tmp_path / "node0.xml"
    procs = []
    for node in (0, 1):
        launcher = ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "4", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"two-hosts-{port}"]
        args = ["cases/", "-k", selection, "--junitxml", str(tmp_path / f"node{node}.xml"), "--case-deadline", "120",
                "--rank-logs", str(tmp_path / "logs")]
        command = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "pytest", "-p", "no:cacheprovider",
                   *args]
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env_for(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(
        [o[-3000:] for o in outputs] + [rank_log_tails("".join(outputs), tmp_path / "logs")])
    cases = junit.read([xml]).cells
    assert len(cases) == 3 and all(c.outcome == "passed" for c in cases), outputs[0][-3000:]
    assert not (tmp_path / "node1.xml").exists()  # rank 0 (on node 0) writes the one report


# ---- faults, in a project of their own ---------------------------------------------------------
FAULTY = '''
import os
import time

import harness.parallel.tp as tp


def hang(ctx, cfg):
    """The last rank never joins the first collective: the others wait in it."""
    if ctx.rank == ctx.layout.world - 1:
        while True:
            time.sleep(0.05)
    return tp.run(ctx, cfg)


def raises(ctx, cfg):
    """Every rank raises before any collective: a failed cell that leaves the group healthy."""
    raise ValueError(f"planted failure on rank {ctx.rank}")


def die(ctx, cfg):
    """Rank 1's process exits in the middle of the cell."""
    if ctx.rank == 1:
        os._exit(7)
    return tp.run(ctx, cfg)
'''

FAULT_CONFTEST = '''
from harness.registry import register_implementation

register_implementation("tp", "hang", "faulty:hang")
register_implementation("tp", "die", "faulty:die")
register_implementation("tp", "raises", "faulty:raises")
'''

FAULT_CASES = '''
import pytest
from harness.matrix import cells
from reference.tp import SIZES


def one(impl, op):
    return cells("tp", impls=[impl], meshes=["tp=2"], dtypes=["fp32"], sizes=SIZES, switches={"op": [op]})


# each fault followed by a healthy cell
CELLS = one("raises", "mlp") + one("hang", "mlp") + one("ours", "mlp") + one("die", "mlp") + one("ours", "colshard")


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_tp(cfg, parity):
    parity(cfg)
'''


def make_project(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).write_text(text)
    (path / "pytest.ini").write_text("[pytest]\n")
    return path


def test_a_hang_and_a_dying_rank_fail_their_cells_and_the_next_cells_pass(tmp_path):
    project = make_project(tmp_path / "faults", {"faulty.py": FAULTY, "conftest.py": FAULT_CONFTEST,
                                                 "test_cells.py": FAULT_CASES})
    xml = tmp_path / "faults.xml"
    start = time.perf_counter()
    run = torchrun(["--standalone", "--nproc-per-node", "2", "--max-restarts", "3"],
                   ["test_cells.py", "--case-deadline", "6", "--junitxml", str(xml), "-p", "no:cacheprovider"],
                   cwd=project, env=env_for(project))
    seconds = time.perf_counter() - start
    print(run.stdout[-6000:], run.stderr[-6000:])
    assert run.returncode != 0  # two cells failed: torchrun's exit status says so
    cases = {c.name.split("[")[1].split("-")[1] + "-" + c.record["switches"]["op"]: c for c in junit.read([xml]).cells}
    assert [c.outcome for c in junit.read([xml]).cells] == ["failed", "failed", "passed", "failed", "passed"]

    raised = cases["raises-mlp"]  # no restart for this one: every rank answered
    assert "failed after" in raised.text and "raised on ranks [0, 1]" in raised.text
    assert "ValueError: planted failure on rank 1" in raised.text

    hung = cases["hang-mlp"]
    assert "passed its deadline of 6.0 s: ranks [0, 1] still running" in hung.text
    assert "[torchrun] attempt 0 ends here" in hung.text
    assert "rank 1: hung: at faulty.py:" in hung.text and "in hang" in hung.text
    assert "rank 0: hung: in all_reduce" in hung.text
    assert f"host {socket.gethostname()}, local rank 1" in hung.text
    assert "the next attempt resumes after this cell" in hung.text

    died = cases["die-mlp"]
    assert "a rank died during it, torchrun stopped the job and restarted it (attempt 1 -> 2)" in died.text
    assert f"died: rank 1 (host {socket.gethostname()}, local rank 1, node 0" in died.text
    assert "rank 1: died: process died inside the cell" in died.text
    assert cases["ours-mlp"].outcome == "passed" and cases["ours-colshard"].outcome == "passed"
    assert seconds < 240


def test_xdist_under_torchrun_is_a_usage_error():
    run = torchrun(["--standalone", "--nproc-per-node", "1"], ["cases/test_tp.py", "-n", "2", "-k", "tp1"])
    assert run.returncode != 0
    assert "ERROR: -n 2: xdist cannot run under torchrun: each pytest process is already one rank" in run.stderr
    assert "pytest: error" not in run.stderr  # our one line, not argparse's


MISMATCH_CONFTEST = '''
import os


def pytest_collection_modifyitems(config, items):
    if os.environ.get("RANK") == "1":  # a rank that selects differently (another -k, a missing extra)
        del items[1]
'''

MISMATCH_CASES = '''
import pytest


@pytest.mark.parametrize("n", [1, 2, 3])
def test_n(n):
    pass
'''


def test_ranks_that_collect_differently_stop_at_once_naming_the_first_difference(tmp_path):
    project = make_project(tmp_path / "mismatch", {"conftest.py": MISMATCH_CONFTEST, "test_n.py": MISMATCH_CASES})
    start = time.perf_counter()
    run = torchrun(["--standalone", "--nproc-per-node", "2"], ["test_n.py"], cwd=project, env=env_for(project),
                   timeout=300)
    assert run.returncode != 0
    assert time.perf_counter() - start < 120  # no rank waits for a collective the others never reach
    assert ("torchrun ranks collected different tests: rank 0 has 3, rank 1 has 2; the first difference is "
            "test #2: rank 0 has test_n.py::test_n[2], rank 1 has test_n.py::test_n[3]") in run.stderr


SLOW_RANK_CONFTEST = '''
import os
import time


def pytest_runtest_setup(item):
    if os.environ.get("RANK") == "1" and "-tp1-" in item.nodeid:
        time.sleep(5)  # rank 1, idle in this 1-rank cell, reaches it after rank 0 has judged it
'''

TP_CASES = '''
import pytest
from harness.matrix import cells
from reference.tp import SIZES

CELLS = cells("tp", impls=["ours"], meshes={meshes}, dtypes=["fp32"], sizes=SIZES, switches={{"op": ["mlp"]}})


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_tp(cfg, parity):
    parity(cfg)
'''


def test_a_rank_late_to_a_cell_it_idles_in_still_runs_the_next_cell_and_a_cell_larger_than_the_job_skips(tmp_path):
    """Rank 0 judges the 1-rank cell before rank 1 gets there; rank 1 must still take its turn
    (and not replay rank 0's verdict as if from an earlier attempt), or the 2-rank cell after it
    waits for an outcome rank 1 files under another cell. The 4-rank cell skips, saying why."""
    # two modules: within one, the cells run largest first (harness.selection.by_world)
    project = make_project(tmp_path / "late", {"conftest.py": SLOW_RANK_CONFTEST,
                                               "test_1.py": TP_CASES.format(meshes=["tp=1"]),
                                               "test_2.py": TP_CASES.format(meshes=["tp=2", "tp=4"])})
    xml = tmp_path / "late.xml"
    run = torchrun(["--standalone", "--nproc-per-node", "2"],
                   ["test_1.py", "test_2.py", "--case-deadline", "20", "-rs", "--junitxml", str(xml)],
                   cwd=project, env=env_for(project), timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[:3000]
    ran = [(re.search(r"-(tp\d)-", nodeid).group(1), outcome) for nodeid, outcome, _ in outcomes(xml)]
    assert ran == [("tp1", "passed"), ("tp4", "skipped"), ("tp2", "passed")], run.stdout[-3000:]
    assert "needs 4 ranks and this torchrun job has 2: launch at least 4 (--nnodes x --nproc-per-node)" in run.stdout


# Rank 1's pytest fails outside the cells, where rank 0's report cannot see it: a fixture's teardown
# (a test error, exit status 1), or a plugin's hook at the session's end (an exception out of pytest:
# Python exits with 1). The cells pass on every rank. And the converse: rank 0 fails alone (its own
# report shows it), and rank 1, whose pytest passed, is not blamed.
TEARDOWN_FAILS_ON = '''
import os
import pytest


@pytest.fixture(autouse=True, scope="session")
def leaves_a_mess():
    yield
    if os.environ["RANK"] == "{rank}":
        raise RuntimeError("planted teardown failure on rank {rank}")
'''
OUTSIDE_CELLS = {
    "teardown": TEARDOWN_FAILS_ON.format(rank=1),
    "teardown on rank 0": TEARDOWN_FAILS_ON.format(rank=0),
    "hook": '''
import os


def pytest_sessionfinish(session):
    if os.environ["RANK"] == "1":
        raise RuntimeError("planted sessionfinish failure on rank 1")
''',
}
OUTSIDE_CELLS_CASES = TP_CASES.format(meshes=["tp=1", "tp=2"])


@pytest.mark.parametrize("where", sorted(OUTSIDE_CELLS))
def test_a_rank_that_fails_outside_the_cells_is_named_by_rank_0_and_keeps_its_log(tmp_path, where):
    """Every rank reports rank 0's verdicts, so a rank that fails after them (the two-host run's rank
    6, exit status 1 after 3 passed) must be named where the job's output is read, with its log."""
    project = make_project(tmp_path / "outside", {"conftest.py": OUTSIDE_CELLS[where],
                                                  "test_cells.py": OUTSIDE_CELLS_CASES})
    run = torchrun(["--standalone", "--nproc-per-node", "2"], ["test_cells.py", "-k", "tp2"],
                   cwd=project, env=env_for(project), timeout=300)
    assert run.returncode != 0
    assert "1 passed" in run.stdout  # rank 0's report: the cell passed
    if where == "teardown on rank 0":  # in rank 0's report: rank 1, which passed, is not named
        assert "RuntimeError: planted teardown failure on rank 0" in run.stdout
        assert "[torchrun] rank 1" not in run.stderr and "rank 1 (host" not in run.stderr, run.stderr[-3000:]
        return
    said = re.search(r"\[torchrun\] rank 1 \(host \S+, local rank 1, node 0, pid \d+\) ended its pytest with "
                     r"exit status 1 where rank 0 ended with 0: (.*)", run.stderr)
    assert said, run.stderr[-3000:]
    assert said.group(1) == {
        "teardown": "test_cells.py::test_tp[tp-ours-tp2-fp32-op_mlp-b4.f32.h16.s8.v40-seed0] failed there and not "
                    "on rank 0 (teardown: RuntimeError: planted teardown failure on rank 1). Its output: its rank "
                    "log (--rank-logs, rank1.log)",
        "hook": "an exception ended its pytest after the tests (RuntimeError: planted sessionfinish failure on "
                "rank 1). Its output: its rank log (--rank-logs, rank1.log)"}[where]
    kept = re.search(r"rank 1 \(host \S+, local rank 1\): its pytest ended with exit status 1, otherwise than "
                     r"rank 0's; its pytest output: (\S+)", run.stderr)
    assert kept, run.stderr[-3000:]
    assert f"planted {'teardown' if where == 'teardown' else 'sessionfinish'} failure on rank 1" in Path(
        kept.group(1)).read_text()


TMP_PATH_CASES = '''
import os
from pathlib import Path


def test_tells_where_its_tmp_path_lives(tmp_path, tmp_path_factory):
    (tmp_path / "x").write_text("x")
    (Path(os.environ["ROOTS"]) / f"rank{os.environ['RANK']}").write_text(str(tmp_path_factory.getbasetemp()))
'''


@pytest.mark.parametrize("basetemp", [False, True], ids=["default", "basetemp"])
def test_each_rank_keeps_its_tmp_path_under_a_root_of_its_own(tmp_path, basetemp):
    """The ranks of a job end together; sharing pytest's ``pytest-of-<user>``, two of them at once
    unlink its dead ``pytest-current`` link and one exits 1 after its tests passed (the 16-rank
    composed run's lost rank 6). Rank 0 keeps pytest's place, each other rank a root of its own.
    A ``--basetemp`` given to all ranks, which pytest empties at its start, becomes one per rank."""
    import getpass

    project = make_project(tmp_path / "tmp_paths", {"test_tmp.py": TMP_PATH_CASES})
    roots = tmp_path / "roots"
    roots.mkdir()
    given = ["--basetemp", str(tmp_path / "base")] if basetemp else []
    run = torchrun(["--standalone", "--nproc-per-node", "3"],
                   ["test_tmp.py", "-o", "tmp_path_retention_policy=failed", "--rank-logs", str(tmp_path / "logs"),
                    *given],
                   cwd=project, env=dict(env_for(project), ROOTS=str(roots)), timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + rank_log_tails(run.stdout + run.stderr,
                                                                                         tmp_path / "logs")
    found = {p.name: Path(p.read_text()) for p in roots.iterdir()}
    if basetemp:
        base = (tmp_path / "base").resolve()
        assert found == {"rank0": base, "rank1": Path(f"{base}-rank1"), "rank2": Path(f"{base}-rank2")}, found
        return
    shared = (tmp_path / "tmp" / f"pytest-of-{getpass.getuser()}").resolve()  # the job's TMPDIR (private_tmpdir)
    found = {rank: path.parent for rank, path in found.items()}
    assert found == {"rank0": shared, "rank1": shared / "paritytest-rank1" / shared.name,
                     "rank2": shared / "paritytest-rank2" / shared.name}, found
