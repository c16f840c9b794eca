"""Reshard round trips of model cells (harness.model.tasks.round_trip): a DTensor model survives
save under one mesh and load under another or one process; hand-written TP on plain tensors, which
a checkpoint stores as replicas, is red."""
import pytest

from harness.cell import run_cell
from harness.config import ConfigError
from harness.model import model_cells, register_model
from harness.resolve import check_config
from tests.conftest import failure_of

register_model("handtp", "tests.model_handtp:HANDTP")


@pytest.mark.parametrize("cfg", model_cells("handtp", impls=["fsdp"], meshes=["dp=4"],
                                            switches={"reshard": ["dp2", "one"]}), ids=str)
def test_an_fsdp2_model_survives_the_round_trip(cfg, rank_pool):
    run_cell(cfg, rank_pool)


def test_hand_written_tp_trains_right_but_its_checkpoint_does_not_reshard(rank_pool):
    plain = model_cells("handtp", impls=["handtp"], meshes=["tp=2"])[0]
    trip = model_cells("handtp", impls=["handtp"], meshes=["tp=2"], switches={"reshard": ["one"]})[0]
    run_cell(plain, rank_pool)  # the declared placements assemble: training itself is right
    message = failure_of(trip, rank_pool)
    assert "fc1" in message, message


@pytest.mark.parametrize("text, rule", [
    ("handtp-fsdp-dp2-fp32-reshard_dp4-steps3-seed0", "larger than the cell's"),
    ("handtp-fsdp-dp2-fp32-reshard_dp2-steps1-seed0", "steps2 or more"),
    ("handtp-fsdp-dp2-fp32-reshard_dpx-steps3-seed0", "reshard_dp4, reshard_rep2dp2"),
])
def test_a_reshard_cell_that_cannot_run_is_invalid_with_the_rule(text, rule):
    from harness.config import Config

    with pytest.raises(ConfigError, match=rule):
        check_config(Config.parse(text))
