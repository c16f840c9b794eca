"""The ``skip`` paths of the example models that need third-party libraries.

They look for a package without importing it, so the pytest process resolves these models' cells
without importing transformers (about 3 s); the pools import it once, before they fork, because the
models name :mod:`harness.examples.hf` in their ``preload``.
"""
from __future__ import annotations

from harness.parallel.thirdparty import _missing


def transformers(cfg) -> str | None:
    """Skip when transformers is not installed, saying how to install it."""
    return _missing("transformers")


def accelerate(cfg) -> str | None:
    """Skip when transformers or accelerate is not installed (both in the thirdparty extra)."""
    return _missing("transformers") or _missing("accelerate")
