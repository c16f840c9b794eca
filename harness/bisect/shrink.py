"""The search: the smallest config that still fails with the same signature.

Greedy, field by field: mesh degrees (down to 1, then dropped), dtype to fp32, switches to their
simplest value (as the component declares in ``Component.simplest``), sizes; each field takes the
smallest value that still fails the same way, trying 1 first, then powers of two, half, one less. A candidate the
component's rules reject is skipped without running. A bug that needs two non-trivial dims, or two
unequal degrees, keeps them: lowering either loses the signature.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..config import Config, ConfigError
from ..registry import check_rules, get

SIMPLEST_DTYPE = "fp32"


@dataclass
class Step:
    """One simplification: which field, from what to what."""

    field: str  # "mesh:tp", "dtype", "switch:mask", "size:b"
    before: str
    after: str
    cfg: Config


def _smaller(value: int) -> list[int]:
    """Smaller values to try, smallest first: 1, the powers of two below, half, one less."""
    out = {1, value // 2, value - 1} | {2**k for k in range(1, value.bit_length()) if 2**k < value}
    return sorted(v for v in out if 1 <= v < value)


def fields(cfg: Config) -> Iterator[tuple[str, list[Step]]]:
    """Each field of ``cfg`` with its simplifications, simplest first; biggest fields first."""
    component = get(cfg.component)
    for i, (name, degree) in enumerate(cfg.mesh):
        options = []
        for d in _smaller(degree):
            mesh = list(cfg.mesh)
            mesh[i] = (name, d)
            options.append(Step(f"mesh:{name}", str(degree), str(d), cfg.replace(mesh=tuple(mesh))))
        if degree == 1 and len(cfg.mesh) > 1:  # a dim of degree 1 says nothing: drop it from the id
            options.append(Step(f"mesh:{name}", "1", "absent", cfg.replace(mesh=tuple(m for m in cfg.mesh if m[0] != name))))
        yield f"mesh:{name}", options
    if cfg.dtype != SIMPLEST_DTYPE:
        yield "dtype", [Step("dtype", cfg.dtype, SIMPLEST_DTYPE, cfg.replace(dtype=SIMPLEST_DTYPE))]
    # a whole model's own switches are ordered by its case (the default, the simplest, first)
    own = component.switch_values() if component.case is not None else {}
    for key, value in cfg.switches:
        order = component.simplest.get(key) or own.get(key, ())
        simpler = order[: order.index(value)] if value in order else ()
        yield f"switch:{key}", [Step(f"switch:{key}", value, v, cfg.replace(switches=dict(cfg.switches, **{key: v})))
                                for v in simpler]
    for key, value in cfg.sizes:
        yield f"size:{key}", [Step(f"size:{key}", str(value), str(v), cfg.replace(sizes=dict(cfg.sizes, **{key: v})))
                              for v in _smaller(value)]


def steps(cfg: Config) -> Iterator[Step]:
    """Every one-field simplification of ``cfg``."""
    for _, options in fields(cfg):
        yield from options


class Budget(Exception):
    """The trial or time budget ran out."""


@dataclass
class Search:
    """State of one shrink: the best config so far, which fields were simplified, and what each
    field of the final config did when the last pass tried to simplify it further."""

    best: Config
    simplified: set[str] = field(default_factory=set)  # fields some accepted step changed
    last_pass: dict[str, str] = field(default_factory=dict)  # field -> "essential" | "fixed" | "simplified"

    def run(self, holds: Callable[[Config], bool | None]) -> Config:
        """Shrink ``best`` while ``holds(candidate)`` is True (None: the candidate could not run).

        Sweeps the fields in order; each takes its simplest value that still fails the same way
        (values the rules reject are skipped, never run); sweeps repeat until one changes nothing.
        ``holds`` may raise :class:`Budget`; ``self.best`` then keeps the best config so far.
        """
        progress = True
        while progress:
            progress, self.last_pass = False, {}
            names = [name for name, _ in fields(self.best)]
            for name in names:
                options = dict(fields(self.best)).get(name, [])  # against the current best
                verdict = "fixed"
                for step in options:
                    try:
                        check_rules(get(step.cfg.component), step.cfg)
                    except ConfigError:
                        continue
                    held = holds(step.cfg)
                    if held:
                        self.simplified.add(name)
                        self.best, verdict, progress = step.cfg, "simplified", True
                        break
                    if held is False:
                        verdict = "essential"
                self.last_pass[name] = verdict
        return self.best

    def fields(self) -> dict[str, list[str]]:
        """The minimal config's fields by role: ``essential`` (every simplification tried loses the
        failure), ``any value`` (simplified on the way: the failure does not depend on it),
        ``simplest already`` (never varied), ``fixed`` (no simplification the rules accept, or
        none that could run here)."""
        out: dict[str, list[str]] = {"essential": [], "any value": [], "simplest already": [], "fixed": []}
        cfg = self.best
        current = [(f"mesh:{n}", str(d)) for n, d in cfg.mesh] + [("dtype", cfg.dtype)]
        current += [(f"switch:{k}", v) for k, v in cfg.switches] + [(f"size:{k}", str(v)) for k, v in cfg.sizes]
        for name, value in current:
            label = f"{name.split(':')[-1]}={value}"
            if self.last_pass.get(name) == "essential":
                out["essential"].append(label)
            elif any(s.field == name for s in steps(cfg)):
                out["fixed"].append(label)
            elif name in self.simplified:
                out["any value"].append(label)
            else:
                out["simplest already"].append(label)
        present = {name for name, _ in current}
        out["any value"] += [f"{name.split(':')[-1]} (dropped)" for name in sorted(self.simplified - present)]
        return out
