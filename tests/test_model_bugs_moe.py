"""Planted bug in a user's MoE plan (tests/model_bugs_moe.py): the expert gradients are not summed
over the expert copies (efsdp). Red, and the failure names where the numbers part."""
import re

import pytest

from harness.model import model_cells, register_model
from tests.conftest import failure_of, flat

pytest.importorskip("transformers", reason="pip install -e '.[thirdparty]' (transformers' Qwen3-MoE)")
register_model("qwen3moebug", "tests.model_bugs_moe:NOEXPSUM")
register_model("qwen3moerouter", "tests.model_bugs_moe:ROUTERGRAD")


def test_an_moe_plan_that_skips_the_expert_gradient_sum_is_red_and_names_the_experts(rank_pool):
    cfg = model_cells("qwen3moebug", meshes=["dp=4"], switches={"ep": ["2"]})[0]  # efsdp = 2 copies
    message = flat(failure_of(cfg, rank_pool))
    # the copies of each expert (ranks 1 and 2 hold the same experts of ep=2) step apart ...
    assert re.search(r"param/model\.layers\.\d\.mlp\.experts\.\w+ replicas", message), message
    # ... because their step-1 gradients already part: named in the backward pass, at the last layer's
    # experts (backward reaches them first), not at a router whose output is per rank by design
    assert ("first diverging module: model.layers.1.mlp.experts (parameter gradients, step 1), in the backward "
            "pass: every judged forward output matches") in message, message
    assert "first diverging parameter gradients (step 1, in backward order): model.layers.1.mlp.experts" in message


def test_a_backward_only_bug_in_the_router_of_transformers_ep_plan_is_named_in_the_backward_pass(rank_pool):
    """The router's output is per rank by design under the EP plan and is not judged: a bug in its
    gradient alone is named where backward meets it, never at the router's output."""
    cfg = model_cells("qwen3moerouter", impls=["routergrad"], meshes=["dp=2"], switches={"ep": ["2"]})[0]
    message = flat(failure_of(cfg, rank_pool))
    assert ("first diverging module: model.layers.1.mlp.gate (input gradient, step 1, microbatch 0), in the backward "
            "pass: every judged forward output matches") in message, message
    assert "model.layers.1.mlp.gate.weight (module model.layers.1.mlp.gate: mismatch, norm ratio 2" in message


def test_the_same_router_bug_under_tp_and_ep_together_is_named_in_the_backward_pass(rank_pool):
    """transformers' TP and EP plans at once, the experts over the tp ranks: every rank is given the
    same tokens, so what the router hands each rank's experts may differ by design; the bug is still
    named where backward meets it. What the experts' activation receives (each rank's dispatched
    tokens, in shapes of its own) is per rank by design and is said to be so."""
    cfg = model_cells("qwen3moerouter", impls=["tproutergrad"], meshes=["tp=2"], switches={"ep": ["2"], "etp": ["1"]})[0]
    message = flat(failure_of(cfg, rank_pool))
    assert "first diverging module: model.layers.1.mlp.gate (input gradient, step 1, microbatch 0), in the backward " \
           "pass: every judged forward output matches (what model.layers.0.mlp.experts.act_fn, " \
           "model.layers.1.mlp.experts.act_fn receive is per rank by design: ranks holding the same part hold it " \
           "differently; not judged)" in message, message
