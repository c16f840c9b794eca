"""Import paths: how a registration names what every process imports for itself.

The rank processes never see the objects a parent process registered, only their paths:

* ``"package.module:name"`` names an object; ``name`` may be dotted (``"pkg.mod:Class.method"``);
* ``"package.module:function[package.module:VALUE]"`` names ``function`` with ``VALUE`` bound as its
  first argument: a whole model's rank task is ``"harness.model.tasks:run[mypkg.cases:CASE]"``;
* ``"package.module:factory(key)"`` names what ``factory("key")`` returns, called once per process:
  a family of cases made by one function (``"harness.zoo.transformers:case(llama)"``), with no module
  global per case. ``key`` is a plain string (no brackets, parentheses or commas).
"""
from __future__ import annotations

import functools
import importlib
import re

_BOUND = re.compile(r"(?P<function>[^\[\]]+)\[(?P<value>[^\[\]]+)\]")
_MADE = re.compile(r"(?P<factory>[^\[\]()]+)\((?P<key>[^\[\](),]*)\)")


def load(path: str):
    """The object ``path`` names (see the module docstring)."""
    bound = _BOUND.fullmatch(path)
    if bound:
        return functools.partial(load(bound["function"]), load(bound["value"]))
    made = _MADE.fullmatch(path)
    if made:
        return _made(made["factory"], made["key"])
    module, sep, name = path.partition(":")
    if not sep or not name:
        raise ValueError(f"{path!r} is not of the form 'package.module:function'")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


@functools.cache
def _made(factory: str, key: str):
    """``factory(key)``, once per process: every load of the path gets the same object."""
    return load(factory)(key)


def modules(path: str) -> list[str]:
    """The modules importing ``path`` imports (both of a bound path)."""
    bound = _BOUND.fullmatch(path)
    if bound:
        return modules(bound["function"]) + modules(bound["value"])
    made = _MADE.fullmatch(path)
    return [(made["factory"] if made else path).partition(":")[0]]
