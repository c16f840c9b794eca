"""Building a component's matrix of cells from axes."""
from __future__ import annotations

import itertools
from typing import Iterable

from .config import Config


def mesh(text: str) -> tuple[tuple[str, int], ...]:
    """``"dp=2,tp=4"`` -> ``(("dp", 2), ("tp", 4))``."""
    dims = []
    for item in text.split(","):
        name, _, degree = item.partition("=")
        dims.append((name.strip(), int(degree)))
    return tuple(dims)


def cells(component: str, *, impls: Iterable[str], meshes: Iterable[str], dtypes: Iterable[str],
          sizes: dict[str, int], switches: dict[str, Iterable[str]], seed: int = 0) -> list[Config]:
    """Every combination of the axes, in a stable order."""
    keys = sorted(switches)
    out = []
    for impl, mesh_text, dtype, values in itertools.product(
        impls, meshes, dtypes, itertools.product(*(switches[k] for k in keys))
    ):
        out.append(Config(component, impl, mesh(mesh_text), dtype, sizes, dict(zip(keys, values)), seed))
    return out

