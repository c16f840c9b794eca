"""Building a component's matrix of cells from axes: the full product, or a covering design of it.

The gate runs a covering design where a component's matrix is a product of many switches: of each
implementation on each mesh, cells such that every pair of values of any two axes (dtype, a switch,
a size that varies) appears together in at least one of them. Bugs that need one value, or two
values together, are met on every mesh, at a fraction of the cells. The full product runs with
``pytest --full-matrix`` (or ``PARITYTEST_FULL_MATRIX=1``): the nightly job, and ``harness.golden
check``, which must see every cell a golden file belongs to.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
from collections import defaultdict
from typing import Iterable, Iterator

from .config import Config, ConfigError


def mesh(text: str) -> tuple[tuple[str, int], ...]:
    """``"dp=2,tp=4"`` -> ``(("dp", 2), ("tp", 4))``; a text that is no such list raises
    :class:`ConfigError` saying how to write it (the names and degrees are the config's to check)."""
    __tracebackhide__ = True  # pytest shows a bad mesh at the user's line, not as a traceback of ours
    example = ",".join(f"{name}={degree}" for name, degree in re.findall(r"([a-z_]+)\s*=?\s*(\d+)", text)) or "dp=2,tp=2"
    if re.search(r"[;:/ |]", text.strip()):
        raise ConfigError(f"mesh {text!r}: separate its dims with commas, e.g. {example!r}")
    dims = []
    for item in text.split(","):
        name, eq, degree = (part.strip() for part in item.partition("="))
        if not eq or not name or not re.fullmatch(r"-?\d+", degree):
            raise ConfigError(f"mesh {text!r}: {item.strip()!r} is not <dim>=<degree>, e.g. {example!r}")
        dims.append((name, int(degree)))
    return tuple(dims)


def cells(component: str, *, impls: Iterable[str], meshes: Iterable[str], dtypes: Iterable[str],
          sizes: dict[str, int], switches: dict[str, Iterable[str]], seed: int = 0) -> list[Config]:
    """Every combination of the axes, in a stable order."""
    __tracebackhide__ = True
    keys = sorted(switches)
    out = []
    for impl, mesh_text, dtype, values in itertools.product(
        impls, meshes, dtypes, itertools.product(*(switches[k] for k in keys))
    ):
        out.append(Config(component, impl, mesh(mesh_text), dtype, sizes, dict(zip(keys, values)), seed))
    return out


FULL_ENV = "PARITYTEST_FULL_MATRIX"  # "1": design() returns the full product (pytest --full-matrix sets it)


def full_matrix() -> bool:
    """True when the run asked for the full product of every matrix (``--full-matrix``)."""
    return os.environ.get(FULL_ENV, "") == "1"


@contextlib.contextmanager
def full_product() -> Iterator[None]:
    """Within the block, matrices are built in full (for a collection that must see every cell)."""
    old = os.environ.get(FULL_ENV)
    os.environ[FULL_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[FULL_ENV]
        else:
            os.environ[FULL_ENV] = old


def _values(cfg: Config) -> dict[str, str]:
    return {"dtype": cfg.dtype, **{f"size {k}": str(v) for k, v in cfg.sizes},
            **{f"switch {k}": v for k, v in cfg.switches}, "seed": str(cfg.seed)}


def covering(configs: list[Config]) -> list[Config]:
    """Of each (component, implementation, mesh), a subset of ``configs`` in which every pair of values
    of two axes that appears together in some config of that group appears in one chosen config (a
    strength-2 covering design, chosen greedily: deterministic, in the given order). Configs are
    taken as they come, so rules that make some combinations invalid are respected: only pairs that
    exist are asked for. A group with one varying axis keeps every value; one with none, its config."""
    groups: dict[tuple, list[Config]] = defaultdict(list)
    for cfg in configs:
        groups[(cfg.component, cfg.impl, cfg.mesh)].append(cfg)
    chosen: set[Config] = set()
    for group in groups.values():
        values = [_values(cfg) for cfg in group]
        axes = sorted(a for a in values[0] if len({v.get(a) for v in values}) > 1)

        def pairs(v: dict[str, str]) -> set:
            if len(axes) == 1:
                return {(axes[0], v.get(axes[0]))}
            return {(a, v.get(a), b, v.get(b)) for a, b in itertools.combinations(axes, 2)}

        covers = [pairs(v) for v in values]
        wanted = set().union(*covers)
        if not wanted:  # no axis varies: the group is its one config
            chosen.add(group[0])
        while wanted:
            best = max(range(len(group)), key=lambda i: (len(covers[i] & wanted), -i))
            chosen.add(group[best])
            wanted -= covers[best]
    return [cfg for cfg in configs if cfg in chosen]


def design(configs: list[Config]) -> list[Config]:
    """The cells a run takes of a product: its covering design, or all of it under ``--full-matrix``."""
    return list(configs) if full_matrix() else covering(configs)
