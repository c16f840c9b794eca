"""Planted bugs in users' parallelize functions (tests/model_bugs.py): each cell is red, and the
failure names the module (or the parameter's module) where the numbers part."""
import pytest

from harness.cell import run_cell
from harness.model import model_cells, register_model
from tests.conftest import failure_of, flat

register_model("bugs", "tests.model_bugs:BUGS")
register_model("tied", "tests.model_bugs:TIED")

# (cell, what the failure must name)
BUGS = [
    (model_cells("bugs", impls=["wocol"], meshes=["tp=2"])[0], "in module layers.0.attention.wo"),
    (model_cells("bugs", impls=["nosp"], meshes=["tp=2"])[0], "layers.1.ffn_norm.weight (module layers.1.ffn_norm"),
    (model_cells("bugs", impls=["hsdpdims"], meshes=["rep=2,dp=2"])[0],
     # each replica's gradients are its own half-batch's: the reduction over rep that never ran, named so
     "first diverging parameter gradients (step 1, in backward order): output.weight (module output: differs over rep "
     "(averaged over rep it matches the reference): its reduction over rep is missing"),
    (model_cells("bugs", impls=["lossworld"], meshes=["dp=2"])[0],
     "first diverging module: none, it starts in the loss (step 1): every judged forward output matches, the "
     "gradient the loss hands back to output does not (the reference x 1/2 = 1/dp)"),
    (model_cells("tied", impls=["untied"], meshes=["pp=2"])[0], "tok_embeddings.weight (module tok_embeddings"),
    # step 1's gradients are right: the gradients of every step are compared, and the first wrong one named
    (model_cells("bugs", impls=["gradkept"], meshes=["tp=2"])[0],
     "first diverging module: none in step 1: every judged module's outputs and gradients match the reference there, "
     "and the gradients first diverge in step 2 (below): what one step leaves the next (a buffer, a hook's state), or "
     "a difference step 1 keeps within its tolerance first diverging parameter gradients (step 2, in backward order): "
     "output.weight (module output: mismatch"),
    # a pipeline's microbatch activations, joined, are compared as an unpipelined model's: the bug in
    # the second stage of 1F1B is named at its module
    (model_cells("bugs", impls=["stagereinit"], meshes=["pp=2"])[0],
     "first diverging module: layers.1.attention.wq (output, step 1, microbatch 0): its inputs still match"),
    (model_cells("bugs", impls=["stagereinit"], meshes=["pp=2,dp=2"])[0],
     "first diverging module: layers.1.attention.wq (output, step 1, microbatch 0): its inputs still match"),
]


@pytest.mark.parametrize("cell, names", BUGS, ids=[cfg.id for cfg, _ in BUGS])
def test_a_planted_bug_is_red_and_names_where_it_starts(cell, names, rank_pool):
    message = failure_of(cell, rank_pool)
    assert names in flat(message), message


@pytest.mark.parametrize("cell", model_cells("tied", impls=["tied"], meshes=["pp=2"]), ids=str)
def test_the_same_pipeline_with_its_tied_gradients_summed_matches(cell, rank_pool):
    run_cell(cell, rank_pool)
