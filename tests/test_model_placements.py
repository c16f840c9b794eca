"""Plain-tensor parameters sharded by hand are assembled from the placements the case declares."""
import pytest
import torch

from harness.cell import Divergence, run_cell
from harness.layout import MeshLayout, Shard, assemble
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


def test_fsdp2_over_tp_is_described_as_dp_cutting_each_tp_shard_and_assembles_to_torchs_full_tensor(rank_pool):
    """FSDP2's strided shard under TP goes back as each rank's own shard (no collective), where the
    split is even; torch's full_tensor() of each parameter is what the pieces assemble to."""
    mesh = (("dp", 2), ("tp", 2))
    seen = rank_pool.run("tests.fsdp_over_tp:pieces", None, mesh)
    layout = MeshLayout.of(mesh)
    for name in ("even.weight", "even.bias", "down.weight"):
        assert all(seen[r][name][0] is not None for r in seen), (name, seen[0][name][1])
        full = seen[0][name][2]
        assert torch.equal(assemble(name, {r: seen[r][name][0] for r in seen}, layout).tensor, full), name
    assert "_S(0, 2)" in seen[0]["even.weight"][1], seen[0]["even.weight"][1]
    assert seen[0]["even.weight"][0].placements == {"dp": Shard(0, within="tp"), "tp": Shard(0)}
    assert seen[0]["down.weight"][0].placements == {"dp": Shard(0), "tp": Shard(1)}  # not strided: two dims
    # 6 rows: tp shards of 3, cut 2 and 1 by dp, where torch's strided chunks are not nested chunks
    assert "_S(0, 2)" in seen[0]["uneven.weight"][1] and seen[0]["uneven.weight"][0] is None
