"""The one-process reference of a model cell, and the tolerance policy's reduction size for it.

The same model from the same dtype-rounded start (:func:`harness.model.batches.start_model`),
in fp64, trained on the whole global batch of every step with the case's own loss and optimizer:
the numbers a single process would compute, to which every mesh is held.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import events
from .batches import as_dtype, global_batch, start_model
from .case import ModelCase
from .hooks import Recorder


def reference(case: ModelCase, cfg) -> dict[str, torch.Tensor]:
    """``loss/step<k>``, ``grad/<p>`` (step 1), ``param/<p>`` and ``opt/<state>/<p>`` (after the last step)."""
    from reference.common import grad_name, param_name, state_name

    from .runner import loss_name

    model = start_model(case, cfg).double()
    params = dict(model.named_parameters())  # tied parameters under their first name
    optimizer = case.optimizer(list(params.values()))
    recorder = Recorder([model]) if events.active() else None
    result: dict[str, torch.Tensor] = {}
    for step in range(cfg.size("steps")):
        if recorder:
            recorder.step = step + 1
        batch = as_dtype(global_batch(case, step), torch.float64)
        loss = case.loss(case.forward(model, batch), batch)
        loss.backward()
        result[loss_name(step + 1)] = loss.detach().reshape(())
        if step == 0:
            result.update({grad_name(n): (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                           for n, p in params.items()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if recorder:
        recorder.remove()
    for name, p in params.items():
        result[param_name(name)] = p.detach().clone()
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor) and value.shape == p.shape:
                result[state_name(key, name)] = value.detach().clone()
    return result


_sizes: dict[tuple, int] = {}


def reduction_size(case: ModelCase, cfg) -> int:
    """The ``n`` of the tolerance policy for a model: ``case.reduction`` when given, else the larger
    of the largest fan-in of any ``nn.Linear`` (the terms a forward dot product adds) and the
    tokens of a global batch (the terms a parameter's gradient and a mean loss add: the elements of
    ``batch["input"]`` for integer ids, its rows times sequence otherwise, i.e. all dims but the last)."""
    if case.reduction is not None:
        return int(case.reduction)
    key = (cfg.component, cfg.seed)
    if key not in _sizes:
        model = start_model(case, cfg)
        fan_in = max((m.in_features for m in model.modules() if isinstance(m, nn.Linear)), default=1)
        batch = global_batch(case, 0)
        first = batch.get("input", next(iter(batch.values())))
        tokens = first.numel() if not first.is_floating_point() else first.numel() // max(1, first.shape[-1])
        _sizes[key] = max(fan_in, tokens)
    return _sizes[key]
