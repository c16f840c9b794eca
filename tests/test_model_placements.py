"""Plain-tensor parameters sharded by hand are assembled from the placements the case declares."""
import pytest

from harness.cell import Divergence, run_cell
from harness.model import model_cells, register_model

register_model("handmlp", "tests.model_handwritten:CASE")


@pytest.mark.parametrize("cell", model_cells("handmlp", impls=["megatron"], meshes=["tp=2", "tp=4"]), ids=str)
def test_hand_written_tensor_parallel_with_declared_placements_matches(cell, rank_pool):
    outcome = run_cell(cell, rank_pool)
    assert outcome.parity.ok and "grad/0.weight" in outcome.result and outcome.result["param/2.weight"].shape == (16, 32)


@pytest.mark.parametrize("cell", model_cells("handmlp", impls=["noreduce"], meshes=["tp=2"]), ids=str)
def test_a_row_parallel_layer_without_its_sum_is_red_and_named(cell, rank_pool):
    with pytest.raises(Divergence) as caught:
        run_cell(cell, rank_pool)
    assert "first diverging module: 2 (output, step 1, microbatch 0): its inputs still match" in str(caught.value)
