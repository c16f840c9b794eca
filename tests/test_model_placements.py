"""Plain-tensor parameters sharded by hand are assembled from the placements the case declares."""
import pytest

from harness.cell import Divergence, run_cell
from harness.layout import Shard
from harness.model import model_cells, register_model
from harness.model.placement import declared_placements

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


@pytest.mark.parametrize("etp, placed", [(2, {"tp": Shard(0)}), (1, {})])
def test_an_experts_declared_etp_is_tp_where_the_cells_etp_is_tp_and_whole_where_it_is_1(etp, placed):
    declared = {"*.local_experts.*.fc1.weight": {"etp": Shard(0)}, "*.fc1.weight": {"tp": Shard(1)}}
    degrees = {"dp": 2, "tp": 2, "etp": etp}
    assert declared_placements("layers.1.mlp.local_experts.0.fc1.weight", declared, degrees) == placed
    assert declared_placements("layers.1.mlp.fc1.weight", declared, degrees) == {"tp": Shard(1)}  # the first match
