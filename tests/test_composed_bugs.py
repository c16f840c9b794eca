"""Planted bugs in the composed model (tests/model_composed_bugs.py), one component broken in one
block: each turns the composed cells red, and the failure names where the numbers part."""
import pytest

from harness.model import model_cells, register_model
from tests.conftest import failure_of, flat

# the composed model's deadline factor (harness/components.py): the same model, cells of the same size;
# with 1 x 30 s the pipelined nodpsum cell hung out beside the 16-rank torchrun job (docs/design/composed-model.md)
register_model("composedbug", "tests.model_composed_bugs:BUGS", deadline_factor=4.0)

E2 = {"ep": ["2"], "etp": ["2"]}
# notpar makes the tp ranks' weights differ after step 1, so from step 2 they route the MoE's tokens
# differently and its etp all-reduce mismatches (a crash naming layers.0.moe): one step shows the table
# (cell, what the failure must name)
BUGS = [
    (model_cells("composedbug", impls=["notpar"], meshes=["dp=2,cp=2,tp=2"], switches=E2, steps=1)[0],
     "first diverging module: layers.1.attention (output, step 1"),
    (model_cells("composedbug", impls=["nounperm"], meshes=["dp=2,cp=2,tp=2"], switches=E2)[0],
     "first diverging module: layers.0.moe (output, step 1"),
    (model_cells("composedbug", impls=["nodpsum"], meshes=["pp=2,dp=2,tp=2"], switches=E2)[0],
     "first diverging parameter gradients (step 1, in backward order): layers.1.mlp.b2"),
    (model_cells("composedbug", impls=["ringoff"], meshes=["dp=2,cp=2,tp=2"], switches=E2)[0],
     "first diverging module: layers.0.attention (output, step 1"),
]


@pytest.mark.parametrize("cell, names", BUGS, ids=[cfg.id for cfg, _ in BUGS])
def test_a_planted_composed_bug_is_red_and_names_its_block(cell, names, rank_pool):
    message = failure_of(cell, rank_pool)
    assert names in flat(message), message
