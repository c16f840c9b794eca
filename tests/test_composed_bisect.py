"""harness.bisect on the composed model's four planted bugs (tests/model_composed_bugs.py), each from
the cell tests/test_composed_bugs.py turns red: the smallest config that still fails the same way,
and where the numbers part: the block's module, the step and the microbatch (a model event's
``microbatch`` counts the module's calls in a step), or, for the skipped dp gradient sum, the step's
gradient reduction and the block whose gradients it leaves wrong.

Minimal configs that keep tp2 keep it for ``etp_2`` (bisect does not lower the etp switch, and
etp_2 needs tp2). None keeps pp: no planted bug needs the pipeline, so bisect drops it (nodpsum and
ringoff start pipelined) and the minimal config's module events compare with the reference's."""
import pytest

import tests.test_bisect as bisect_tests
from tests.conftest import flat
from tests.test_composed_bugs import BUGS

# the same model as the composed one: the same deadline (4 x --case-deadline)
CONFTEST = '''
from harness.model import register_model
register_model("composedbug", "tests.model_composed_bugs:BUGS", deadline_factor=4.0)
'''

# bug -> (where bisect starts, the minimal config, the event where the divergence starts: its inputs
# match, its outputs do not; None: every event matches, the divergence is in the gradient reduction).
# Three start from tests/test_composed_bugs.py's red cell; ringoff from the pipelined 5D seed, whose
# failure table names parameters only (a pipeline's microbatches are no slices of the batch).
FOUND = {
    "notpar": (BUGS[0][0].id, "composedbug-notpar-tp2-fp32-ep_1.etp_2-steps1-seed0",
               "fwd module microbatch=0 module=layers.1.attention step=1"),
    "nounperm": (BUGS[1][0].id, "composedbug-nounperm-tp2-fp32-ep_1.etp_2-steps1-seed0",
                 "fwd module microbatch=0 module=layers.0.moe step=1"),
    "nodpsum": (BUGS[2][0].id, "composedbug-nodpsum-dp2.tp2-fp32-ep_1.etp_2-steps1-seed0", None),
    "ringoff": ("composedbug-ringoff-pp2.dp2.cp2-fp32-ep_2-steps10-seed0", "composedbug-ringoff-cp1-fp32-ep_1-steps1-seed0",
                "fwd module microbatch=0 module=layers.0.attention step=1"),
}


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(FOUND))
def test_bisect_localises_a_planted_composed_bug_to_its_block_step_and_microbatch(bug, tmp_path, monkeypatch):
    monkeypatch.setattr(bisect_tests, "CONFTEST", CONFTEST)
    start, minimal, origin = FOUND[bug]
    assert f"-{bug}-" in start
    done = bisect_tests.bisect(tmp_path, "run", start, "--max-seconds", "240")
    assert done.returncode == 1, done.stdout + done.stderr
    result = bisect_tests.result(tmp_path)
    assert result["minimal"] == minimal, result
    place = result["localisation"]
    if origin is not None:
        assert place["origin"]["event"] == origin, place
        assert place["first_diverging"]["event"] == origin, place  # nothing diverges before it
        assert f"where it starts: {origin}: its inputs match the reference, its outputs do not" in flat(done.stdout)
    else:
        # step 1's forward and backward match in every module; the gradients of block 1, all of its
        # parameters' and no other's, do not
        assert place["first_diverging"] is None and place["result_matches"] is False and place["compared"] > 0, place
        assert "the divergence starts after the last recorded event (in the gradient reduction" in flat(done.stdout)
        assert "dp=2" in result["essential"], result
        grads = {t.removeprefix("grad/") for t in result["tensors"] if t.startswith("grad/")}
        assert grads == {f"layers.1.{p}" for p in ("attention_norm.weight", "attention.wq", "attention.wk", "attention.wv",
                                                   "attention.wo", "ffn_norm.weight", "mlp.w1", "mlp.b1", "mlp.w2",
                                                   "mlp.b2")}, result
