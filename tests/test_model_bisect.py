"""harness.bisect on a model cell: it shrinks the mesh, the dtype and the steps of a planted bug in a
user's parallelize function, and prints the first diverging module in pytest's words; a crash is named
as the crash it is; a minimal config whose divergence starts elsewhere than the original's is said to
have slipped, with both."""
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
    assert "slipped" not in result and "slipped" not in done.stdout  # the original starts there too


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


TWO_BUGS = '''
import dataclasses

from tests.model_handtp import CALLER_REDUCES, caller_reduces


def two_bugs(model, meshes):
    """Megatron's split of the MLP with a bug at each degree: at tp=4 fc2's output scaled, at any
    other fc1's (another bug, which shrinking tp meets first)."""
    made = caller_reduces(model, meshes)
    scaled = made.mlp.fc2 if meshes.spec.tp == 4 else made.mlp.fc1
    scaled.register_forward_hook(lambda module, args, out: out * 1.01)
    return made


CASE = dataclasses.replace(CALLER_REDUCES, parallelize={"twobugs": two_bugs})
'''


@pytest.mark.slow
def test_a_minimal_config_that_starts_elsewhere_than_the_original_is_said_to_have_slipped(tmp_path, monkeypatch):
    """Both fail by the same signature (every tensor after the scaled output mismatches), so the
    search takes the smaller; where each starts tells them apart."""
    monkeypatch.setattr(bisect_tests, "CONFTEST", "from harness.model import register_model\n"
                                                  "register_model('twobugs', 'mymodel:CASE')\n")
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "mymodel.py").write_text(TWO_BUGS)
    done = bisect_tests.bisect(tmp_path, "run", "twobugs-twobugs-tp4-fp32-plain-steps3-seed0")
    assert done.returncode == 1, done.stdout + done.stderr
    result = bisect_tests.result(tmp_path)
    assert result["slipped"] == {"original": "mlp.fc2 (output)", "minimal": "mlp.fc1 (output)"}, result
    assert ("bisect slipped: the minimal config's divergence starts at mlp.fc1 (output), the original's at mlp.fc2 "
            "(output)") in flat(done.stdout), done.stdout
