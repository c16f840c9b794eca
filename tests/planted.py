"""Implementations with planted bugs, registered by tests (never flags in the production code).

Each wraps a real implementation and breaks one thing for the duration of its own call only: the
rank processes are shared with other tests' cells.
"""
import contextlib
import os

import torch

import parallel.ring_attention as ring
import parallel.tp as tp


@contextlib.contextmanager
def patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def tp_grads_over_tp(ctx, cfg):
    """Tensor parallel with every gradient divided by tp before the step (a scaling bug)."""
    real = tp.reduce_and_step

    def scaled(params, loss, groups):
        for p in params:
            p.grad /= ctx.degree("tp")
        return real(params, loss, groups)

    with patched(tp, "reduce_and_step", scaled):
        return tp.run(ctx, cfg)


def ring_never_rotates(ctx, cfg):
    """Ring attention whose K/V (and dK/dV) never move: every step sees the rank's own block.
    Needs cp > 1 to show."""
    with patched(ring, "_shift", lambda t, group: (t.clone(), [])):
        return ring.run(ctx, cfg)


def tp_noisy(ctx, cfg):
    """Tensor parallel whose output carries fresh random noise on every run: nondeterministic."""
    pieces = tp.run(ctx, cfg)
    noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    out = pieces["out"]
    out.tensor = out.tensor + torch.randn(out.tensor.shape, generator=noise).to(out.tensor.dtype)
    return pieces
