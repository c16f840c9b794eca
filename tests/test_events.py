"""harness.events: what the reference and the implementations record for bisect's localisation."""
import torch

from harness import events
from harness.events import At
from harness.layout import MeshLayout, Shard, assemble


def test_nothing_is_recorded_unless_bisect_records():
    x = torch.ones(2, requires_grad=True)
    events.op("fc1", {"x": x}, {"y": x * 2})  # no recording: returns at once, registers no hook
    assert not x._backward_hooks and not events.active()
    with events.recording() as log:
        assert events.active()
    assert log == [] and not events.active()


def test_an_op_yields_its_forward_event_now_and_its_backward_event_when_the_gradients_flow():
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    with events.recording() as log:
        y = x * 3
        events.op("scale", {"x": x}, {"y": y}, layer=0)
        assert [e.key for e in log] == ["fwd scale layer=0"]
        y.sum().backward()
        y2 = x * 3
        y2.sum().backward()  # a second backward through x belongs to no recorded event
    assert [e.key for e in log] == ["fwd scale layer=0", "bwd scale layer=0"]
    fwd, bwd = log
    assert torch.equal(fwd.inputs["x"].tensor, x.detach()) and torch.equal(fwd.outputs["y"].tensor, y.detach())
    # backward: the output's gradient goes in, the input's comes out
    assert torch.equal(bwd.inputs["y"].tensor, torch.ones(2)) and torch.equal(bwd.outputs["x"].tensor, torch.full((2,), 3.0))


def test_an_event_keeps_a_copy_of_a_buffer_that_changes_afterwards():
    buf = torch.zeros(3)
    with events.recording() as log:
        events.record("ring", {}, {"after": buf}, ring_step=0)
        buf += 1
    assert torch.equal(log[0].outputs["after"].tensor, torch.zeros(3))


def test_pieces_of_an_event_assemble_like_results_and_gradients_are_rescaled_to_the_logical_ones():
    layout = MeshLayout.of((("dp", 2),))
    full = torch.arange(8.0).view(4, 2).requires_grad_()
    pieces = {}
    for rank in range(2):
        local = full.detach()[2 * rank:2 * rank + 2].clone().requires_grad_()
        with events.recording() as log:
            y = local * 2
            events.op("layer", {"x": (local, At((4, 2), dp=Shard(0), grad_scale=0.5))}, {"y": (y, At((4, 2), dp=Shard(0)))})
            (y.sum() * 2).backward()  # this rank's loss is twice its share of the logical loss
        pieces[rank] = log
    fwd = assemble("y", {r: pieces[r][0].outputs["y"] for r in pieces}, layout)
    assert torch.equal(fwd.tensor, full.detach() * 2)
    dx = assemble("x", {r: pieces[r][1].outputs["x"] for r in pieces}, layout)
    assert torch.equal(dx.tensor, torch.full((4, 2), 2.0))  # 4 on each rank, halved by grad_scale
    only_one = assemble("x", {1: pieces[1][1].outputs["x"], 0: pieces[0][1].outputs["x"]}, layout, every_rank=False)
    assert torch.equal(only_one.tensor, dx.tensor)
