"""The first diverging module, for free: forward hooks on every submodule record events.

On the re-run of a failing cell (and in bisect) only, with :func:`harness.events.recording` on,
every submodule's call records ``fwd module module=<name> microbatch=<call> step=<k>`` with its
first tensor input and its tensor outputs, and, when autograd computes them, ``bwd module ...``
with the gradients of its outputs (inputs) and of its input (outputs), as :func:`harness.events.op`
does for an operation. ``microbatch`` counts the module's calls within a step (a pipeline runs it
once per microbatch). Off the re-run no hook is installed: the matrix pays nothing.

The reference records logical tensors; a rank records its piece: a DTensor by its placements, a
plain tensor as this rank's rows of the batch (dim 0 over rep·dp, ``seq_dim`` over cp). A plain
tensor that is not laid out so (a tensor-parallel local shard) does not assemble, and that event
is reported as uncompared rather than as a divergence.
"""
from __future__ import annotations

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


class Recorder:
    """Hooks on every submodule of ``modules``; ``step`` is set by the training loop.

    ``place``: (tensor, module name, tensor name) -> Piece on a rank (None: the logical tensor, in
    the reference)."""

    def __init__(self, modules: list[nn.Module],
                 place: Callable[[torch.Tensor, str, str], Piece | None] | None = None, grad_scale: float = 1.0):
        self.step = 0
        self.place = place
        # a rank's loss is the mean over its own slice of the batch: its activation gradients are
        # those of the global mean loss times the number of slices, which this factor undoes
        self.grad_scale = grad_scale
        self.calls: Counter = Counter()
        self.handles = []
        for root in modules:
            for name, module in root.named_modules():
                if name:
                    self.handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _piece(self, tensor: torch.Tensor, module: str, name: str) -> Piece | None:
        if self.place is None:
            return Piece.full(tensor.detach().clone())
        return self.place(tensor, module, name)

    def _hook(self, name: str):
        def hook(module, args, kwargs, output):
            if not events.active():
                return
            where = {"module": name, "step": self.step, "microbatch": self.calls[name, self.step]}
            self.calls[name, self.step] += 1
            first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
            inputs = {"input": first} if first is not None and first.is_floating_point() else {}
            outputs = _tensors(output, "output")
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
