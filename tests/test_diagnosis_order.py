"""The order a failing model cell's table lists its tensors in (harness.model.diagnose.table_order):
the named module's first, its subtree's where it owns no parameter, then backward's order."""
from harness.model.diagnose import table_order

# the order backward computed the gradients of a two-layer decoder (head first)
BACKWARD = ["lm_head.weight", "model.norm.weight", "model.layers.1.mlp.down_proj.weight",
            "model.layers.1.self_attn.o_proj.weight", "model.layers.1.self_attn.q_norm.weight",
            "model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"]


def test_a_module_that_owns_parameters_leads_with_them():
    assert table_order(BACKWARD, "model.layers.1.self_attn.o_proj")[:2] == [
        "model.layers.1.self_attn.o_proj.weight", "lm_head.weight"]


def test_a_module_that_owns_none_leads_with_its_subtree_in_backward_order():
    assert table_order(BACKWARD, "model.layers.1.self_attn") == [
        "model.layers.1.self_attn.o_proj.weight", "model.layers.1.self_attn.q_norm.weight",
        "model.layers.1.self_attn.q_proj.weight", "lm_head.weight", "model.norm.weight",
        "model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"]
    # a prefix of a name is not its parent: layers.1 is not layers.10's
    assert table_order(["a.layers.10.x.w", "a.layers.1.x.w"], "a.layers.1") == ["a.layers.1.x.w", "a.layers.10.x.w"]


def test_no_named_module_keeps_backward_order():
    assert table_order(BACKWARD, None) == BACKWARD
