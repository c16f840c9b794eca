"""harness.bisect on a model cell: it shrinks the mesh, the dtype and the steps of a planted bug in a
user's parallelize function, and prints the first diverging module."""
import pytest

import tests.test_bisect as bisect_tests

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
    assert "first diverging event: bwd module microbatch=0 module=output step=1" in done.stdout
