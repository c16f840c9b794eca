"""The one config type of the harness and its canonical text id.

A config is a frozen value: component, implementation, named mesh dims in order, dtype, problem
sizes, switches and seed. Its id is the pytest id, the golden file name and the argument a user
pastes to reproduce a cell; ``Config.parse(cfg.id) == cfg`` always holds.

Id grammar (only characters that ``pytest -k`` accepts, so ``-k "tp4 and bf16"`` selects cells)::

    <component>-<impl>-<mesh>-<dtype>-<switches>-<sizes>-seed<N>
    mesh     = dims joined by "."  each <name><degree>        e.g. dp2.tp4
    switches = items joined by "." each <key>_<value>          e.g. op_mlp
    sizes    = items joined by "." each <key><int>             e.g. b2.s4.h16
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .names import dim_hint

DTYPES = ("fp64", "fp32", "bf16", "fp16")

_NAME = re.compile(r"[a-z]+")
_VALUE = re.compile(r"[a-z0-9]+")
_MESH_ITEM = re.compile(r"([a-z]+)(\d+)")
_SIZE_ITEM = re.compile(r"([a-z]+)(\d+)")
_NO_SWITCHES = "plain"
ID_SHAPE = "<component>-<impl>-<mesh>-<dtype>-<switches>-<sizes>-seed<N>"  # how a config id reads


class ConfigError(ValueError):
    """An invalid config. The message names the rule that was broken and how to fix it."""


def _pairs(value, what: str) -> tuple:
    __tracebackhide__ = True
    items = tuple(value.items()) if isinstance(value, dict) else tuple(tuple(p) for p in value)
    names = [k for k, _ in items]
    if len(set(names)) != len(names):
        twice = next(k for k in names if names.count(k) > 1)
        raise ConfigError(f"{what} names must be unique, got {names}: give {twice!r} once")
    return items


@dataclass(frozen=True)
class Config:
    """One cell of the correctness matrix.

    ``mesh`` keeps its order (it is the row-major layout of ranks); ``sizes`` and ``switches`` are
    stored sorted by key so that two spellings of the same problem are one config.
    """

    component: str
    impl: str
    mesh: tuple[tuple[str, int], ...]
    dtype: str
    sizes: tuple[tuple[str, int], ...] = ()
    switches: tuple[tuple[str, str], ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        __tracebackhide__ = True
        set_ = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 (frozen dataclass)
        set_("mesh", tuple((str(k), int(v)) for k, v in _pairs(self.mesh, "mesh dim")))
        set_("sizes", tuple(sorted((str(k), int(v)) for k, v in _pairs(self.sizes, "size"))))
        set_("switches", tuple(sorted((str(k), str(v)) for k, v in _pairs(self.switches, "switch"))))
        for what, text in (("component", self.component), ("impl", self.impl)):
            if not _VALUE.fullmatch(text):
                raise ConfigError(f"{what} {text!r} must be lowercase letters and digits")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not self.mesh:
            raise ConfigError("mesh needs at least one dim, e.g. tp=1")
        for name, degree in self.mesh:
            if not _NAME.fullmatch(name):
                raise ConfigError(f"mesh dim name {name!r} must be lowercase letters, e.g. dp, tp, cp{dim_hint(name)}")
            if degree < 1:
                raise ConfigError(f"mesh dim {name}={degree} must be at least 1")
        for key, value in self.sizes:
            if not _NAME.fullmatch(key):
                raise ConfigError(f"size name {key!r} must be lowercase letters")
            if value < 1:
                raise ConfigError(f"size {key}={value} must be at least 1")
        for key, value in self.switches:
            if not _NAME.fullmatch(key) or not _VALUE.fullmatch(value):
                raise ConfigError(f"switch {key}={value!r}: key lowercase letters, value letters/digits")
        if self.seed < 0:
            raise ConfigError(f"seed {self.seed} must be non-negative")

    # ---- derived views -------------------------------------------------------------------
    @property
    def world(self) -> int:
        """Number of ranks the mesh needs."""
        return math.prod(d for _, d in self.mesh)

    @property
    def dims(self) -> dict[str, int]:
        return dict(self.mesh)

    def degree(self, name: str) -> int:
        """Degree of a mesh dim, 1 when the mesh does not name it."""
        return self.dims.get(name, 1)

    def size(self, key: str) -> int:
        try:
            return dict(self.sizes)[key]
        except KeyError:
            raise ConfigError(f"{self.id}: size {key!r} is missing") from None

    def switch(self, key: str) -> str:
        try:
            return dict(self.switches)[key]
        except KeyError:
            raise ConfigError(f"{self.id}: switch {key!r} is missing") from None

    @property
    def problem_key(self) -> tuple:
        """What determines inputs and the reference result: everything but impl and mesh."""
        return (self.component, self.dtype, self.sizes, self.switches, self.seed)

    @property
    def problem(self) -> "Config":
        """What the reference computes: this config on a mesh of one rank (every degree 1) under the
        implementation ``reference``. Everything it holds is :attr:`problem_key`, so a reference
        computed from it is the same computation for every mesh and implementation of the problem."""
        return self.replace(impl="reference", mesh=tuple((name, 1) for name, _ in self.mesh))

    # ---- the id --------------------------------------------------------------------------
    @property
    def id(self) -> str:
        mesh = ".".join(f"{k}{v}" for k, v in self.mesh)
        switches = ".".join(f"{k}_{v}" for k, v in self.switches) or _NO_SWITCHES
        sizes = ".".join(f"{k}{v}" for k, v in self.sizes)
        return "-".join([self.component, self.impl, mesh, self.dtype, switches, sizes, f"seed{self.seed}"])

    def __str__(self) -> str:
        return self.id

    @classmethod
    def parse(cls, text: str) -> "Config":
        """Parse a canonical id back into the config it names."""
        fields = text.strip().split("-")
        if len(fields) != 7:
            raise ConfigError(
                f"config id {text!r} has {len(fields)} '-'-separated fields, expected 7: {ID_SHAPE}"
            )
        component, impl, mesh, dtype, switches, sizes, seed = fields

        def items(part: str, pattern: re.Pattern, what: str) -> list[tuple[str, int]]:
            out = []
            for item in part.split(".") if part else []:
                m = pattern.fullmatch(item)
                if not m:
                    raise ConfigError(f"config id {text!r}: {what} item {item!r} is not <name><int>")
                out.append((m.group(1), int(m.group(2))))
            return out

        switch_items = []
        if switches != _NO_SWITCHES:
            for item in switches.split("."):
                key, sep, value = item.partition("_")
                if not sep:
                    raise ConfigError(f"config id {text!r}: switch {item!r} is not <key>_<value>")
                switch_items.append((key, value))
        if not re.fullmatch(r"seed\d+", seed):
            raise ConfigError(f"config id {text!r}: last field {seed!r} is not seed<N>")
        return cls(
            component=component,
            impl=impl,
            mesh=tuple(items(mesh, _MESH_ITEM, "mesh")),
            dtype=dtype,
            sizes=tuple(items(sizes, _SIZE_ITEM, "size")),
            switches=tuple(switch_items),
            seed=int(seed[4:]),
        )

    def replace(self, **changes) -> "Config":
        """A copy with some fields changed (``mesh``, ``sizes`` and ``switches`` accept dicts)."""
        values = {f: getattr(self, f) for f in ("component", "impl", "mesh", "dtype", "sizes", "switches", "seed")}
        values.update(changes)
        return Config(**values)


def require_divides(cfg: Config, dim: str, size_key: str, *, what: str | None = None) -> None:
    """Reject a config whose mesh dim does not divide a size evenly."""
    degree, size = cfg.degree(dim), cfg.size(size_key)
    if size % degree:
        raise ConfigError(
            f"{dim}={degree} does not divide {what or size_key}={size}: "
            f"choose {what or size_key} a multiple of {degree}, or another {dim} degree"
        )
