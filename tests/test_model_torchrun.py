"""Model cells under torchrun (one pytest process per rank) get the verdicts the pool gives: a
passing titan cell of each kind (TP × FSDP2, HSDP, 1F1B pipeline × FSDP2, interleaved pipeline) and a
planted bug, from a project of their own, compared test by test through the junit XML."""
import subprocess
import sys
import time

import pytest

from harness.report import junit
from tests.test_torchrun import env_for, outcomes, private_tmpdir, torchrun  # noqa: F401  (autouse fixture)

CONFTEST = '''
from harness.model import register_model

register_model("bugs", "tests.model_bugs:BUGS")
'''
TESTS = '''
import pytest

from harness.model import model_cells

CELLS = (model_cells("titan", impls=["titan"], meshes=["dp=2,tp=2", "rep=2,dp=2", "pp=2,dp=2"])
         + model_cells("titan", impls=["interleaved"], meshes=["pp=2"])
         + model_cells("bugs", impls=["lossworld"], meshes=["dp=2"]))


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_model(cfg, parity):
    parity(cfg)
'''


@pytest.mark.slow
def test_model_cells_under_torchrun_get_the_pool_verdicts(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text(CONFTEST)
    (project / "test_models_here.py").write_text(TESTS)
    (project / "pytest.ini").write_text("[pytest]\n")
    pool_xml, torchrun_xml = tmp_path / "pool.xml", tmp_path / "torchrun.xml"
    start = time.perf_counter()
    pool = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pool-size", "4",
                           "--case-deadline", "120", "--junitxml", str(pool_xml), "-q"],
                          cwd=project, env=env_for(project), capture_output=True, text=True, timeout=600)
    pool_seconds = time.perf_counter() - start
    assert pool.returncode == 1, pool.stdout[-3000:] + pool.stderr[-2000:]  # the planted bug
    start = time.perf_counter()
    run = torchrun(["--standalone", "--nproc-per-node", "4"], ["--junitxml", str(torchrun_xml), "--case-deadline", "120",
                                                               "--rank-logs", str(tmp_path / "logs")],
                   cwd=project, env=env_for(project))
    print(f"pool: {pool_seconds:.1f} s, torchrun: {time.perf_counter() - start:.1f} s (wall, including start)")
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-4000:]
    expected, got = outcomes(pool_xml), outcomes(torchrun_xml)
    assert got == expected
    verdicts = {nodeid.split("[")[1].split("-")[0]: outcome for nodeid, outcome, _ in got}
    assert sorted(outcome for _, outcome, _ in got) == ["failed"] + ["passed"] * 4 and verdicts["bugs"] == "failed"
    assert "bugs-lossworld-dp2-fp32-plain-steps3-seed0 diverges from the reference" in run.stdout
    assert "first diverging parameter gradients (step 1, in backward order): output.weight" in run.stdout
    # the same diagnosis as the pool's: the first diverging module, and the per-module record
    # (distinct lines: with CI set pytest's short summary repeats a failure's text, and a loaded CI run
    # once showed torchrun's summary without it)
    first = list(dict.fromkeys(line for line in pool.stdout.splitlines() if line.startswith("first diverging module:")))
    assert first and first == list(dict.fromkeys(line for line in run.stdout.splitlines()
                                                 if line.startswith("first diverging module:")))
    modules = {path: {c.name: [row[:3] for row in c.record.get("model", {}).get("modules", [])]
                      for c in junit.read([path]).cells} for path in (pool_xml, torchrun_xml)}
    assert modules[torchrun_xml] == modules[pool_xml] and any(modules[pool_xml].values())
