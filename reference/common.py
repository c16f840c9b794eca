"""What every component's reference and parallel side share: the training step they both take.

Shared on purpose, so that the two sides differ only in the parallel algorithm: the optimizer and
its settings and the probe loss (the names results are reported under are harness.names').
"""
from __future__ import annotations

from typing import Callable

import torch

from harness.compare.tolerance import TORCH_DTYPE
from harness.config import Config
from harness.names import grad_name, param_name, state_name

# One SGD step with momentum. lr is large enough that the update shows in bf16 parameters.
SGD = dict(lr=0.5, momentum=0.9, weight_decay=0.01)
# AdamW, for components whose optimizer state is part of what is checked. eps is large on purpose:
# with eps=1e-8 the first step is lr*sign(g), so rounding noise in a near-zero gradient would move a
# parameter by a full lr; with eps=1e-3 the step is a smooth function of the gradient.
ADAMW = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.01)


def sgd_step(params: list[torch.Tensor]) -> None:
    """One optimizer step, in place, on tensors that carry ``.grad``."""
    torch.optim.SGD(params, **SGD).step()


def probe_loss(out: torch.Tensor, probe: torch.Tensor, tokens: int) -> torch.Tensor:
    """``<out, probe> / tokens`` in at least fp32: its gradient with respect to ``out`` is ``probe / tokens``."""
    dtype = torch.promote_types(out.dtype, torch.float32)
    return (out.to(dtype) * probe.to(dtype)).sum() / tokens


def adamw(params: list[torch.Tensor]) -> torch.optim.AdamW:
    """The AdamW optimizer both sides use (single-tensor path: the same arithmetic on any shard)."""
    return torch.optim.AdamW(params, **ADAMW, foreach=False)


def record_adamw_state(optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor],
                       result: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add each parameter's AdamW moments (``opt/exp_avg/<name>``, ``opt/exp_avg_sq/<name>``)."""
    for name, p in params.items():
        state = optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            result[state_name(key, name)] = state[key].detach().clone()
    return result


def record_step(params: dict[str, torch.Tensor], result: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """After backward: add every parameter's gradient, take the SGD step, add the parameters after it."""
    result.update({grad_name(k): t.grad.clone() for k, t in params.items()})
    with torch.no_grad():
        sgd_step(list(params.values()))
    result.update({param_name(k): t.detach() for k, t in params.items()})
    return result


def in_cell_dtype(reference: Callable[..., dict[str, torch.Tensor]]) -> Callable[[Config], dict[str, torch.Tensor]]:
    """A component's calibration: its ``reference(cfg, dtype)`` on one process in the cell's dtype
    instead of fp64, the rounding right code makes (part 3 of :mod:`harness.compare.tolerance`)."""
    def calibration(cfg: Config) -> dict[str, torch.Tensor]:
        return reference(cfg, TORCH_DTYPE[cfg.dtype])
    return calibration
