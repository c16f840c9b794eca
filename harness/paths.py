"""Import paths: how a registration names what every process imports for itself.

The rank processes never see the objects a parent process registered, only their paths:

* ``"package.module:name"`` names an object; ``name`` may be dotted (``"pkg.mod:Class.method"``);
* ``"package.module:function[package.module:VALUE]"`` names ``function`` with ``VALUE`` bound as its
  first argument: a whole model's rank task is ``"harness.model.tasks:run[mypkg.cases:CASE]"``.
"""
from __future__ import annotations

import functools
import importlib
import re

_BOUND = re.compile(r"(?P<function>[^\[\]]+)\[(?P<value>[^\[\]]+)\]")


def load(path: str):
    """The object ``path`` names (see the module docstring)."""
    bound = _BOUND.fullmatch(path)
    if bound:
        return functools.partial(load(bound["function"]), load(bound["value"]))
    module, sep, name = path.partition(":")
    if not sep or not name:
        raise ValueError(f"{path!r} is not of the form 'package.module:function'")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def modules(path: str) -> list[str]:
    """The modules importing ``path`` imports (both of a bound path)."""
    bound = _BOUND.fullmatch(path)
    if bound:
        return modules(bound["function"]) + modules(bound["value"])
    return [path.partition(":")[0]]
