"""Events: named intermediate tensors, recorded the same way by a reference and by its parallel
implementations, so that bisect can say where a divergence starts rather than only that the end
result differs.

An event is one operation at a semantic place (its name plus keys such as ``layer``, ``microbatch``,
``ring_step``, ``expert``) with its input and output tensors. A reference records logical tensors; a
parallel implementation records its local piece of each, placed on the mesh like a result
(:class:`At`), and bisect assembles the pieces of every rank that recorded the event. An operation
recorded with :func:`op` during autograd also yields its backward event when the gradients flow: its
inputs are the gradients of the forward outputs, its outputs those of the forward inputs (parameters
included, per backward pass, before they accumulate)::

    # reference                                  # parallel
    h = F.linear(x, w1, b1)                      h = column_parallel(x, w1, b1, tp)
    events.op("fc1", {"x": x, "w1": w1},         events.op("fc1", {"x": (x, At(x_shape, dp=BATCH)),
              {"h": h})                                            "w1": (w1, At(w_shape, tp=COL))},
                                                           {"h": (h, At(h_shape, dp=BATCH, tp=Shard(2)))})

Recording is off unless bisect turns it on for one run (:func:`recording`): then every call is a
test of one module global and a return, so instrumented code pays nothing in the matrix.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Union

import torch

from .layout import Piece, Shard


class At:
    """Where a parallel rank's tensor sits in the logical one: the logical shape and the placements
    (as for :meth:`harness.layout.Piece.sharded`; mesh dims not named are replicas).

    ``grad_scale``: the factor from this rank's gradient of the tensor to the logical gradient's
    piece, for a rank whose loss is scaled differently (a mean over its own rows: 1/world)."""

    def __init__(self, shape, *, grad_scale: float = 1.0, **placements: Shard):
        self.shape = tuple(shape)
        self.placements = placements
        self.grad_scale = grad_scale

    def piece(self, tensor: torch.Tensor) -> Piece:
        return Piece.sharded(tensor, self.shape, **self.placements)


Value = Union[torch.Tensor, tuple[torch.Tensor, At]]


@dataclass
class Event:
    """One recorded operation: ``key`` names it (``"bwd fc1 layer=0"``), the tensors are pieces."""

    key: str
    inputs: dict[str, Piece] = field(default_factory=dict)
    outputs: dict[str, Piece] = field(default_factory=dict)


_recorder: list[Event] | None = None


def active() -> bool:
    """Whether events are being recorded (an implementation may skip work that only feeds events)."""
    return _recorder is not None


@contextlib.contextmanager
def recording() -> Iterator[list[Event]]:
    """Record every event of the code run inside, in order, into the list it yields."""
    global _recorder
    outer, _recorder = _recorder, []
    try:
        yield _recorder
    finally:
        _recorder = outer


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Record nothing inside: a model that calls components records its modules' events (hooks),
    not the events each component's own code records (placed for the component's cells)."""
    global _recorder
    outer, _recorder = _recorder, None
    try:
        yield
    finally:
        _recorder = outer


def append(event: Event) -> None:
    """Record an event whose pieces the caller placed itself (module hooks), when recording."""
    if _recorder is not None:
        _recorder.append(event)


def key(phase: str, name: str, where: dict) -> str:
    """The event's name: phase, operation, then its place in sorted order (``fwd block layer=1 microbatch=0``)."""
    return " ".join([phase, name, *(f"{k}={v}" for k, v in sorted(where.items()))])


def _split(value: Value) -> tuple[torch.Tensor, At | None]:
    return value if isinstance(value, tuple) else (value, None)


def _piece(tensor: torch.Tensor, at: At | None, grad: bool = False) -> Piece:
    tensor = tensor.detach().clone()  # a copy: code goes on updating buffers in place after an event
    if at is None:
        return Piece.full(tensor)
    return at.piece(tensor * at.grad_scale if grad and at.grad_scale != 1.0 else tensor)


def record(name: str, inputs: dict[str, Value], outputs: dict[str, Value], *, phase: str = "fwd", **where) -> None:
    """Record one event now: tensors as they are, no backward event (inside an autograd Function's
    forward or backward, or for values outside autograd)."""
    if _recorder is None:
        return
    _recorder.append(Event(key(phase, name, where),
                           {n: _piece(*_split(v)) for n, v in inputs.items()},
                           {n: _piece(*_split(v)) for n, v in outputs.items()}))


def op(name: str, inputs: dict[str, Value], outputs: dict[str, Value], **where) -> None:
    """Record the forward event of an operation now, and its backward event when autograd has
    computed the gradients of every input that requires one (inputs and outputs swap roles)."""
    if _recorder is None:
        return
    record(name, inputs, outputs, **where)
    needs = {n: _split(v) for n, v in inputs.items() if _split(v)[0].requires_grad}
    if not needs:
        return
    sink = _recorder
    event = Event(key("bwd", name, where))
    pending = set(needs)

    def on_output_grad(n: str, at: At | None):
        def hook(grad):
            if pending:  # a later backward through the same tensor is not this event's
                event.inputs[n] = _piece(grad, at, grad=True)
        return hook

    def on_input_grad(n: str, at: At | None):
        def hook(grad):
            if n not in pending:
                return
            event.outputs[n] = _piece(grad, at, grad=True)
            pending.discard(n)
            if not pending:  # the backward of this operation is complete
                sink.append(event)
        return hook

    for n, value in outputs.items():
        tensor, at = _split(value)
        if tensor.requires_grad:
            tensor.register_hook(on_output_grad(n, at))
    for n, (tensor, at) in needs.items():
        tensor.register_hook(on_input_grad(n, at))
