"""Random numbers a model draws in training mode (dropout, router jitter), noticed in its reference.

A sharded run draws other numbers than one process does (other shapes, other generators), so a
model that draws cannot match its reference whatever its parallelism does: such a cell is not
judged, and says why. :class:`Draws` notices that a step of the one-process reference advanced
torch's generator; run again watching, it names every aten op tagged ``nondeterministic_seeded``
that actually draws (a fused attention kernel or an RNN with a dropout of 0 does not), with the
innermost module whose forward is running. :func:`not_judged` is the one line a cell then says: the
ops, the modules, and how to turn them off in ``build``.
"""
from __future__ import annotations

import re

import torch
from torch import nn

# a transformers config's attributes that make its model draw: attention_dropout, hidden_dropout_prob,
# GPT-2's resid_pdrop, Mixtral's router_jitter_noise
RANDOM_ATTRIBUTE = re.compile(r"dropout|pdrop|jitter", re.IGNORECASE)
MOST = 3  # modules named per op; the rest are counted


def _arguments(func, args: tuple, kwargs: dict) -> dict:
    """An op's arguments by their schema names, defaults included (a fused attention kernel called
    without ``dropout_p``)."""
    schema = func._schema.arguments
    defaults = {a.name: a.default_value for a in schema if a.has_default_value()}
    return defaults | {a.name: value for a, value in zip(schema, args)} | kwargs


def draws(func, args: tuple, kwargs: dict) -> bool:
    """Whether this call of ``func`` draws random numbers."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    named = _arguments(func, args, kwargs)
    if named.get("train", named.get("training")) is False:
        return False
    # fused attention and RNN kernels are tagged for their dropout, and draw only when it is above 0
    rate = named.get("dropout_p", named.get("dropout", named.get("p") if "dropout" in func.__name__ else None))
    return rate is None or rate > 0


def describe(func, args: tuple, kwargs: dict) -> str:
    """``aten.bernoulli_(p=0.9)``: the op and its float arguments."""
    shown = ", ".join(f"{k}={v:g}" for k, v in _arguments(func, args, kwargs).items() if isinstance(v, float))
    return f"aten.{func.overloadpacket.__name__}" + (f"({shown})" if shown else "")


class Draws:
    """Around each training step (forward, loss and backward; not ``batch``, whose draws are the data):
    ``drew`` says whether a step advanced torch's default generator, a check that costs nothing per op.
    With ``watch``, ``found`` also collects every op that draws: its description -> the modules it ran
    in (their names in ``model``, "" for the model's own forward, None outside any forward: the loss,
    a backward), in the order met; a Python dispatch mode, so only to name what ``drew`` saw."""

    def __init__(self, model: nn.Module, watch: bool = False):
        self.model, self.watch = model, watch
        self.drew = False
        self.found: dict[str, list[str | None]] = {}

    def __enter__(self) -> "Draws":
        self.state = torch.random.get_rng_state()
        if self.watch:
            self._watch()
        return self

    def __exit__(self, *exc) -> None:
        if self.watch:
            self.mode.__exit__(*exc)
            for handle in self.handles:
                handle.remove()
        self.drew |= not torch.equal(self.state, torch.random.get_rng_state())

    def _watch(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        running: list[str] = []  # the modules whose forward is running, innermost last
        found = self.found

        def enter(name):
            return lambda module, args: running.append(name)

        def leave(name):
            def hook(module, args, output):
                if running and running[-1] == name:
                    running.pop()
            return hook

        self.handles = []
        for name, module in self.model.named_modules():
            self.handles.append(module.register_forward_pre_hook(enter(name)))
            self.handles.append(module.register_forward_hook(leave(name), always_call=True))

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if draws(func, args, kwargs):
                    where = found.setdefault(describe(func, args, kwargs), [])
                    module = running[-1] if running else None
                    if module not in where:
                        where.append(module)
                return func(*args, **kwargs)

        self.mode = Mode()
        self.mode.__enter__()


def not_judged(model: nn.Module, found: dict[str, list[str | None]]) -> str:
    """The line a cell says when its reference drew random numbers: what drew them, where, and how
    to turn them off in ``build``."""
    ops = [] if found else ["no op that draws was seen again, but a training step advanced torch's generator"]
    for op, modules in found.items():
        inside = [m or f"the model's own forward ({type(model).__name__})" for m in modules if m is not None]
        where = [f"in {', '.join(inside[:MOST])}" + (f" and {len(inside) - MOST} more" if len(inside) > MOST else "")
                 ] if inside else []
        if None in modules:
            where.append("outside any module's forward (in the case's forward or loss)")
        ops.append(f"{op} {' and '.join(where)}")
    modules = list(dict.fromkeys(m for ms in found.values() for m in ms))
    return (f"the model draws random numbers in training mode ({'; '.join(ops)}), which a parallel run cannot "
            "draw as one process does, so no cell of it is judged; turn them off in build: "
            + _how(model, modules))


def _how(model: nn.Module, modules: list[str | None]) -> str:
    """How to turn the draws off: the config attributes that enable them (a transformers model),
    else ``p=0`` for dropout modules, else ``.eval()`` on the modules that draw."""
    configs = {id(c): c for m in model.modules() if hasattr(c := getattr(m, "config", None), "to_dict")}
    for config in configs.values():
        found = _random_attributes(config.to_dict())
        if found:
            return (f"set {', '.join(f'{key}=0.0' for key, _ in found)} in the {type(config).__name__} (it has "
                    f"{', '.join(f'{key}={value:g}' for key, value in found)})")
    inside = [m for m in modules if m is not None]
    if not inside:
        return "draw nothing in the forward or the loss while training"
    owned = dict(model.named_modules())
    dropouts = [m for m in inside if isinstance(getattr(owned[m], "p", None), float) and "Dropout" in
                type(owned[m]).__name__]
    if dropouts:
        return (f"give {', '.join(dropouts[:MOST])}{' and the rest' if len(dropouts) > MOST else ''} p=0 "
                f"({dropouts[0]} is {owned[dropouts[0]]}), or call .eval() on {'it' if len(dropouts) == 1 else 'them'}")
    shown = ", ".join(m or type(model).__name__ for m in inside[:MOST])
    return f"call .eval() on {shown}{' and the rest' if len(inside) > MOST else ''} (or set what makes them draw to 0)"


def _random_attributes(values: dict, prefix: str = "") -> list[tuple[str, float]]:
    """A config's (nested configs' too) attributes named for dropout or jitter, whose value is above 0."""
    out = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += _random_attributes(value, f"{prefix}{key}.")
        elif RANDOM_ATTRIBUTE.search(str(key)) and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and value > 0:
            out.append((f"{prefix}{key}", value))
    return out
