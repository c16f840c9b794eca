"""The first diverging module, for free: hooks on every submodule record events.

When a failing cell runs again (and in bisect), with :func:`harness.events.recording` on, every
submodule's call records ``fwd module module=<name> microbatch=<call> step=<k>`` with its first
tensor input and its tensor outputs, and, when autograd computes them, ``bwd module ...`` with the
gradients of its outputs (inputs) and of its input (outputs), as :func:`harness.events.op` does for
an operation. ``microbatch`` counts the module's calls within a step (a pipeline runs it once per
microbatch). Off those runs no hook is installed: the matrix pays nothing.

The reference records logical tensors; a rank records its piece: a DTensor by its placements, a
plain tensor as this rank's rows of the batch (dim 0 over rep·dp, ``seq_dim`` over cp). A plain
tensor that is not laid out so does not assemble, and that event is reported as uncompared rather
than as a divergence.

A module that ``parallelize`` gave hooks of its own (a TP or EP style, a wrapper's) may turn what its
forward takes and gives into other forms (dispatched tokens, an EP router's masked scores). So its
input is recorded as the caller passed it (before the hooks that transform inputs) and its output as
the module returns it to the caller: what the rest of the model sees. Whether such an output is per
rank by design is decided by the numbers, not by the hooks
(:func:`harness.bisect.localise.per_rank_by_design`).
"""
from __future__ import annotations

import sys
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn

from .. import events
from ..layout import Piece


def _tensors(value: Any, prefix: str) -> dict[str, torch.Tensor]:
    """The floating tensors of a module's output (a tensor, a tuple/list, or a dict-like output)."""
    if isinstance(value, torch.Tensor):
        return {prefix: value} if value.is_floating_point() else {}
    if isinstance(value, (tuple, list)):
        out = {}
        for i, item in enumerate(value):
            out.update(_tensors(item, f"{prefix}.{i}") if isinstance(item, torch.Tensor) else {})
        return out
    if hasattr(value, "items"):
        return {f"{prefix}.{k}": v for k, v in value.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    return {}


def _inferring_shapes() -> bool:
    """Whether torch's ``PipelineStage`` is running its stage once to infer shapes (at its first step,
    on the first microbatch's or on empty tensors): no call of the model's."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "_forward_metadata_inference" and "pipelining" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class Recorder:
    """Hooks on every submodule of ``modules``; ``step`` is set by the training loop.

    ``place``: (tensor, module name, tensor name) -> Piece on a rank, or None when the tensor
    cannot be placed (None for ``place`` itself: the logical tensor, in the reference).
    ``names``: a module's name in the whole model by its name here, where a rank names its modules
    locally (a pipeline stage's layers, a model chunk); others keep theirs."""

    def __init__(self, modules: list[nn.Module],
                 place: Callable[[torch.Tensor, str, str], Piece | None] | None = None,
                 grad_scale: float = 1.0, microbatches: bool = False, names: dict[str, str] | None = None):
        self._step = 0
        self.place = place
        # a pipeline calls each of its modules once per microbatch: the calls of a step are joined on
        # dim 0 in microbatch order (the schedule's contiguous split of this rank's rows), one event
        # as the whole model's; its gradients are scaled as the schedule chose, so not compared
        self.microbatches = microbatches
        self._pending: dict[tuple[str, int], list[tuple[dict, dict]]] = {}
        # a rank's loss is the mean over its own slice of the batch: its activation gradients are
        # those of the global mean loss times the number of slices, which this factor undoes
        self.grad_scale = grad_scale
        self.calls: Counter = Counter()
        self.handles = []
        for root in modules:
            for name, module in root.named_modules():
                if not name:
                    continue
                name = (names or {}).get(name, name)
                inputs: dict[int, Any] = {}  # id(module) -> the call's input as the caller gave it
                self.handles.append(module.register_forward_pre_hook(
                    self._take_input(inputs), with_kwargs=True, prepend=True))
                self.handles.append(module.register_forward_hook(self._hook(name, inputs), with_kwargs=True))

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._flush()
        self._step = value

    def remove(self) -> None:
        self._flush()
        for handle in self.handles:
            handle.remove()

    def _flush(self) -> None:
        """A pipeline's calls of each module in a step, joined into the one event the reference has."""
        for (name, step), calls in self._pending.items():
            where = {"module": name, "step": step, "microbatch": 0}
            joined = []
            for role in (0, 1):
                names = set.intersection(*(set(call[role]) for call in calls))
                joined.append({n: torch.cat([call[role][n] for call in calls]) for n in sorted(names)
                               if len({call[role][n].shape[1:] for call in calls}) == 1 and calls[0][role][n].dim()})
            self._record("fwd", where, joined[0], joined[1])
            events.append(events.Event(events.key("bwd", "module", where)))
        self._pending.clear()

    def _piece(self, tensor: torch.Tensor, module: str, name: str) -> Piece | None:
        if self.place is None:
            return Piece.full(tensor.detach().clone())
        return self.place(tensor, module, name)

    @staticmethod
    def _take_input(inputs: dict):
        def hook(module, args, kwargs):
            if events.active():
                inputs[id(module)] = next((a for a in list(args) + list(kwargs.values())
                                           if isinstance(a, torch.Tensor)), None)
        return hook

    def _hook(self, name: str, taken: dict):
        def hook(module, args, kwargs, output):
            if not events.active() or (self.microbatches and _inferring_shapes()):
                return
            outputs = _tensors(output, "output")
            where = {"module": name, "step": self._step, "microbatch": self.calls[name, self._step]}
            self.calls[name, self._step] += 1
            first = taken.pop(id(module), None)
            inputs = {"input": first} if first is not None and first.is_floating_point() else {}
            if self.microbatches:
                self._pending.setdefault((name, self._step), []).append(
                    tuple({n: t.detach().clone() for n, t in tensors.items()} for tensors in (inputs, outputs)))
                return
            self._record("fwd", where, inputs, outputs)
            self._backward(where, inputs, outputs)
        return hook

    def _record(self, phase: str, where: dict, inputs: dict, outputs: dict) -> None:
        event = events.Event(events.key(phase, "module", where))
        for role, tensors in (("inputs", inputs), ("outputs", outputs)):
            for n, t in tensors.items():
                piece = self._piece(t, where["module"], n)
                if piece is not None and phase == "bwd" and self.grad_scale != 1.0:
                    piece.tensor = piece.tensor * self.grad_scale
                if piece is not None:
                    getattr(event, role)[n] = piece
        events.append(event)

    def _backward(self, where: dict, inputs: dict, outputs: dict) -> None:
        """The bwd event: gradients of the outputs (its inputs) and of the input (its output),
        recorded when the input's gradient arrives (or the outputs', for a module whose input needs none)."""
        needs = {n: t for n, t in inputs.items() if t.requires_grad}
        flowing = {n: t for n, t in outputs.items() if t.requires_grad}
        if not flowing:
            return
        grads_in: dict[str, torch.Tensor] = {}
        done = []

        def finish(grads_out: dict):
            if not done:
                done.append(True)
                self._record("bwd", where, dict(grads_in), grads_out)

        def on_output(n: str):
            def hook(grad):
                grads_in[n] = grad
                if not needs and len(grads_in) == len(flowing):
                    finish({})
            return hook

        for n, t in flowing.items():
            t.register_hook(on_output(n))
        for n, t in needs.items():
            t.register_hook(lambda grad, n=n: finish({n: grad}))


def logical_shapes(model: nn.Module, run: Callable[[], Any]) -> dict[tuple[str, str], tuple[int, ...]]:
    """(module name, tensor name) -> the logical shape of that module's input/output, from one
    forward of the unparallelized ``model`` on a global batch (``run``): what a rank's plain local
    tensor is a piece of. Only when recording."""
    shapes: dict[tuple[str, str], tuple[int, ...]] = {}

    def hook(name):
        def record(module, args, kwargs, output):
            first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if first is not None:
                shapes.setdefault((name, "input"), tuple(first.shape))
            for n, t in _tensors(output, "output").items():
                shapes.setdefault((name, n), tuple(t.shape))
        return record

    handles = [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return shapes
