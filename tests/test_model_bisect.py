"""harness.bisect on a model cell: it shrinks the mesh, the dtype and the steps of a planted bug in a
user's parallelize function, and prints the first diverging module in pytest's words; a crash is named
as the crash it is."""
import pytest

import tests.test_bisect as bisect_tests
from tests.conftest import flat

CONFTEST = '''
from harness.model import register_model
register_model("bugs", "tests.model_bugs:BUGS")
'''


@pytest.mark.slow
def test_bisect_shrinks_a_model_cell_and_names_the_module(tmp_path, monkeypatch):
    monkeypatch.setattr(bisect_tests, "CONFTEST", CONFTEST)
    done = bisect_tests.bisect(tmp_path, "run", "bugs-lossworld-rep2.dp2-bf16-plain-steps3-seed0")
    assert done.returncode == 1, done.stdout + done.stderr
    result = bisect_tests.result(tmp_path)
    assert result["minimal"] == "bugs-lossworld-dp2-fp32-plain-steps1-seed0", result
    assert "minimal: bugs-lossworld-dp2-fp32-plain-steps1-seed0" in done.stdout
    # the line pytest prints under the cell's table (tests/test_model_bugs.py), from the same function
    assert ("first diverging module: none, it starts in the loss (step 1): every judged forward output matches, the "
            "gradient the loss hands back to output does not (the reference x 1/2 = 1/dp)") in flat(done.stdout), done.stdout
    assert result["localisation"]["diagnosis"].startswith("first diverging module: none, it starts in the loss")
    assert "first diverging event: bwd module microbatch=0 module=output step=1" in flat(done.stdout)


@pytest.mark.slow
def test_a_crash_in_one_module_is_named_as_that_crash_not_as_a_divergence(tmp_path, monkeypatch):
    """``wo`` sharded colwise: the matmul in layers.0.attention.wo raises on every rank."""
    monkeypatch.setattr(bisect_tests, "CONFTEST", CONFTEST)
    done = bisect_tests.bisect(tmp_path, "run", "bugs-wocol-tp2-fp32-plain-steps3-seed0")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "minimal: bugs-wocol-tp2-fp32-plain-steps1-seed0 fails with crash" in done.stdout, done.stdout
    assert ("it crashes: ranks [0, 1] raised ModuleError: in module layers.0.attention.wo: RuntimeError: a and b "
            "must have same reduction dim") in flat(done.stdout), done.stdout
    assert "events recorded before it match the reference" in done.stdout
    assert "gradient reduction" not in done.stdout and "not recorded by the implementation" not in done.stdout
