"""What a cell's code can leave changed in its process, found after every task.

A rank serves cell after cell, and the pool of one every reference; a fresh process per cell would
cost its imports and rendezvous every time. So a rank takes a :class:`Baseline` once, as it starts
serving, and after each task holds the process to it:

* **settings** (grad mode, default dtype and device, autocast, deterministic algorithms, matmul
  precision, anomaly mode, threads, ``torch.backends`` flags, modes and global module hooks): read
  through torch's own getters and put back through its setters where there is one;
* **code**: a function, class, method or property of any loaded module or of a class it defines,
  replaced or removed (a kernel library patching ``torch.nn.functional`` or a modeling module). Which
  of some thirteen thousand dicts moved is read from the version tag CPython keeps on every dict (8
  bytes a dict, about 2 ms a task with torch, transformers and Megatron-Core); only a moved dict is
  compared. Where the tag cannot be read (another interpreter), every dict is compared (about 15 ms).

What moved is told in one line each (``grad mode left off``, ``torch.nn.functional.gelu replaced``,
``default dtype float64``). A setting is put back in place; what cannot be put back exactly (code
that others may have bound by name meanwhile, a mode left entered) makes the process unfit for the
next cell: the pool replaces its ranks, and a torchrun rank (which cannot be replaced) puts back
what it can. Process groups and threads are :mod:`harness.world`'s and the rank loop's to check.
"""
from __future__ import annotations

import ctypes
import gc
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

_MISSING = object()


@dataclass(frozen=True)
class Setting:
    """One piece of process-global state: ``read()`` its value, ``write(value)`` it back (None:
    it cannot be put back in place), ``told(value)`` the line that says it moved to ``value``."""

    name: str
    read: Callable[[], Any]
    write: Callable[[Any], None] | None
    told: Callable[[Any], str]


def _switch(name: str) -> Callable[[Any], str]:
    return lambda on: f"{name} left {'on' if on else 'off'}"


def _value(name: str) -> Callable[[Any], str]:
    return lambda value: f"{name} {_shown(value)}"


def _shown(value: Any) -> str:
    text = str(value)
    return text.removeprefix("torch.")


def _settings() -> tuple[Setting, ...]:
    """Every setting a fresh process has, that torch can read on this build."""
    import torch
    import torch.backends.cudnn
    import torch.backends.mkldnn
    import torch.backends.opt_einsum
    import torch.nn.modules.module as nn_module

    out = [
        Setting("grad mode", torch.is_grad_enabled, torch.set_grad_enabled, _switch("grad mode")),
        Setting("inference mode", torch.is_inference_mode_enabled, None, _switch("inference mode")),
        Setting("default dtype", torch.get_default_dtype, torch.set_default_dtype, _value("default dtype")),
        Setting("deterministic algorithms",
                lambda: (torch.are_deterministic_algorithms_enabled(),
                         torch.is_deterministic_algorithms_warn_only_enabled()),
                lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
                lambda v: f"deterministic algorithms left {'on' if v[0] else 'off'}"
                          + (" (warn only)" if v[0] and v[1] else "")),
        Setting("float32 matmul precision", torch.get_float32_matmul_precision,
                torch.set_float32_matmul_precision, _value("float32 matmul precision")),
        Setting("anomaly detection", lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
                lambda v: torch.set_anomaly_enabled(*v), lambda v: f"anomaly detection left {'on' if v[0] else 'off'}"),
        Setting("intra-op threads", torch.get_num_threads, torch.set_num_threads, _value("intra-op threads")),
        # a TorchFunctionMode or TorchDispatchMode entered and never left (torch.device("meta") as a
        # context, a FakeTensorMode): every later op runs under it
        Setting("torch function modes", torch._C._len_torch_function_stack, None,
                lambda n: f"{n} torch function mode(s) left active"),
        Setting("torch dispatch modes", torch._C._len_torch_dispatch_stack, None,
                lambda n: f"{n} torch dispatch mode(s) left active"),
        Setting("global module hooks",
                lambda: tuple(len(getattr(nn_module, n)) for n in sorted(vars(nn_module))
                              if n.startswith("_global_") and n.endswith("hooks")),
                None, lambda _: "a global nn.Module hook left registered"),
    ]
    if hasattr(torch, "get_default_device"):
        out.append(Setting("default device", lambda: str(torch.get_default_device()),
                           lambda v: torch.set_default_device(None if v == "cpu" else v), _value("default device")))
    for device in ("cpu", "cuda"):
        out.append(Setting(f"autocast ({device})",
                           lambda d=device: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)),
                           None, lambda v, d=device: f"autocast left {'on' if v[0] else 'off'} ({d}, {_shown(v[1])})"))
    flags = {"cudnn": ("enabled", "benchmark", "deterministic", "allow_tf32"), "mkldnn": ("enabled",),
             "opt_einsum": ("enabled",)}
    for module, names in flags.items():
        owner = getattr(torch.backends, module)
        for name in names:
            if hasattr(owner, name):
                path = f"torch.backends.{module}.{name}"
                out.append(Setting(path, lambda o=owner, n=name: getattr(o, n),
                                   lambda v, o=owner, n=name: setattr(o, n, v), _value(path)))
    matmul = torch.backends.cuda.matmul
    for name in ("allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"):
        path = f"torch.backends.cuda.matmul.{name}"
        out.append(Setting(path, lambda n=name: getattr(matmul, n), lambda v, n=name: setattr(matmul, n, v),
                           _value(path)))
    cuda = torch.backends.cuda
    for kind in ("flash", "mem_efficient", "math", "cudnn"):
        read, write = getattr(cuda, f"{kind}_sdp_enabled", None), getattr(cuda, f"enable_{kind}_sdp", None)
        if read is not None and write is not None:
            out.append(Setting(f"{kind} SDPA", read, write, lambda on, k=kind: f"{k} scaled-dot-product attention "
                                                                                f"left {'on' if on else 'off'}"))
    return tuple(out)


# ---- code: the attributes of every loaded module and of the classes it defines ----------------

def _is_code(value: Any) -> bool:
    """Whether replacing ``value`` changes what code runs: a function, class, method, property or
    other callable, not a module (a submodule imported later) nor data (a cache a module refills)."""
    kind = type(value)  # not isinstance: no __class__ lookup, which some deprecated names warn on
    return (callable(value) or issubclass(kind, (classmethod, staticmethod, property))) \
        and not issubclass(kind, types.ModuleType)


def _torch_hook(old: Any, new: Any) -> bool:
    """Whether ``new`` is torch's own wrapper of ``old``, installed on first use: an optimizer
    class's ``step`` wrapped for the profiler by its first instance (``Optimizer._patch_step_function``)."""
    return getattr(new, "hooked", False) is True and getattr(new, "__wrapped__", None) is old


# what is not a cell's to change, and computes nothing: the interpreter's hooks and streams (torch's
# init_process_group installs an excepthook on every call), and, under torchrun where a rank is a
# pytest process, the test runner's own hooks (pytest swaps warnings' display and its assertion
# helpers around every test)
_UNWATCHED = ("sys", "warnings", "pytest", "_pytest", "pluggy")


def _watched(name: str) -> bool:
    return name.partition(".")[0] not in _UNWATCHED


def _owners(modules: dict[str, types.ModuleType]):
    """``(label, the dict that holds its attributes)`` of each module and each class it defines."""
    for name, module in modules.items():
        if not isinstance(module, types.ModuleType) or not _watched(name):
            continue
        try:
            space = object.__getattribute__(module, "__dict__")
        except AttributeError:
            continue
        if type(space) is not dict:
            continue
        yield name, space
        for value in list(space.values()):
            if not issubclass(type(value), type):
                continue
            try:
                if type.__getattribute__(value, "__module__") != name:
                    continue
                held = gc.get_referents(type.__dict__["__dict__"].__get__(value))  # the mappingproxy's dict
            except Exception:  # noqa: BLE001  a class that will not say where it lives
                continue
            if len(held) == 1 and type(held[0]) is dict:
                yield f"{name}.{value.__qualname__}", held[0]


def _tag_offset() -> int | None:
    """The byte offset of a dict's version tag in this interpreter (CPython 3.6 to 3.13 bump it on
    every change), or None where a probe does not find it behaving so."""
    if sys.implementation.name != "cpython":
        return None
    offset = object.__basicsize__ + ctypes.sizeof(ctypes.c_ssize_t)  # after the header and ma_used
    probe: dict = {}
    used = ctypes.c_ssize_t.from_address(id(probe) + offset - ctypes.sizeof(ctypes.c_ssize_t))
    tag = ctypes.c_uint64.from_address(id(probe) + offset)
    before = tag.value
    probe["a"] = 1
    after_one = tag.value
    probe["a"] = 2
    after_two = tag.value
    ok = used.value == 1 and before != after_one != after_two != before
    return offset if ok else None


_TAG = _tag_offset()


class _Tags:
    """The version tags of many dicts, read in one gather: numpy indexes a view of the address range
    the tags lie in (a ctypes view per dict costs a rank 1 to 4 ms a task for the 12,600 dicts of
    torch, transformers and Megatron-Core). Each dict must stay alive while it is here
    (:class:`_Spaces` holds it), so that its address stays its own."""

    def __init__(self) -> None:
        self.addresses: list[int] = []
        self._memory = self._index = None

    def add(self, space: dict) -> None:
        self.addresses.append(id(space) + _TAG)
        self._memory = None

    def read(self) -> np.ndarray:
        """Every tag now, in the order added."""
        if not self.addresses:
            return np.empty(0, np.uint64)
        if self._memory is None:
            addresses = np.array(self.addresses, dtype=np.uint64)
            base = int(addresses.min())
            span = (int(addresses.max()) - base) // 8 + 1
            self._memory = np.frombuffer((ctypes.c_uint64 * span).from_address(base), dtype=np.uint64)
            self._index = ((addresses - base) // 8).astype(np.intp)
        return self._memory[self._index]


@dataclass
class _Spaces:
    """The dicts of every loaded module and class, each kept with a copy of its contents (the copy
    holds every value alive, so an identity compared later is never a reused address) and its tag."""

    labels: list[str] = field(default_factory=list)
    dicts: list[dict] = field(default_factory=list)
    copies: list[dict] = field(default_factory=list)
    reader: _Tags = field(default_factory=_Tags)
    tags: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint64))  # each dict's, when last looked at
    modules: set[str] = field(default_factory=set)
    patched: set[int] = field(default_factory=set)  # the dicts whose copy still holds code since replaced

    def add_new(self) -> None:
        """Take in the modules imported since the last call (their state now is their state at
        import as far as a later cell can tell)."""
        if len(sys.modules) == len(self.modules):
            return
        new = {n: m for n, m in list(sys.modules.items()) if n not in self.modules}
        self.modules.update(new)
        for label, space in _owners(new):
            self.labels.append(label)
            self.dicts.append(space)
            self.copies.append(dict(space))
            if _TAG is not None:
                self.reader.add(space)
        if _TAG is not None:  # the tags of the dicts already watched stay as last looked at
            self.tags = np.concatenate([self.tags, self.reader.read()[len(self.tags):]])

    def _candidates(self) -> list[int]:
        """The dicts that may have changed since last looked at: their tag moved (or, without tags,
        their contents differ)."""
        if _TAG is None:
            return [i for i, (d, c) in enumerate(zip(self.dicts, self.copies)) if not _same(d, c)]
        now = self.reader.read()
        moved = np.flatnonzero(now != self.tags)
        if moved.size:
            self.tags = now
        return moved.tolist()

    def moved(self) -> list[str]:
        """``<owner>.<name> replaced``/``removed`` for each piece of code that changed since taken;
        a dict whose changes are not code (a cache refilled, a submodule imported) is taken anew."""
        lines = []
        for i in self._candidates():
            space, copy = self.dicts[i], self.copies[i]
            found = [f"{self.labels[i]}.{key} {'removed' if new is _MISSING else 'replaced'}"
                     for key, old in copy.items()
                     if (new := space.get(key, _MISSING)) is not old and _is_code(old) and not _torch_hook(old, new)]
            if found:
                lines.extend(found)
                self.patched.add(i)
            elif i not in self.patched:
                self.copies[i] = dict(space)
        return lines

    def rebase(self) -> None:
        """Take every dict as it is now, and the modules imported since."""
        for i in self._candidates():
            self.copies[i] = dict(self.dicts[i])
        self.patched.clear()
        self.add_new()

    def put_back(self) -> None:
        """The code of every module and class replaced since taken, put back (for a process that
        cannot be replaced: what bound the replacement by name meanwhile keeps it)."""
        for i in sorted(self.patched):
            space, copy = self.dicts[i], self.copies[i]
            for key, old in copy.items():
                if (new := space.get(key, _MISSING)) is not old and _is_code(old) and not _torch_hook(old, new):
                    space[key] = old
            self.copies[i] = dict(space)
        self.patched.clear()
        if _TAG is not None:
            self.tags = self.reader.read()


def _same(space: dict, copy: dict) -> bool:
    if len(space) != len(copy):
        return False
    try:
        return tuple(space.values()) == tuple(copy.values())  # identical items compare equal at C speed
    except Exception:  # noqa: BLE001  a value whose == raises (a tensor): compare one by one
        return all(space.get(k, _MISSING) is v for k, v in copy.items())


# ---- the baseline ------------------------------------------------------------------------------

@dataclass
class StateChanges:
    """What a task left changed: ``lines`` to tell, and whether the process is still fit for the
    next cell (every change put back in place)."""

    lines: list[str] = field(default_factory=list)
    fit: bool = True


class Baseline:
    """The state this process serves every cell from: taken once (:meth:`take`), checked after each
    task (:meth:`check`)."""

    def __init__(self, settings: tuple[Setting, ...], values: list, spaces: _Spaces):
        self.settings, self.values, self.spaces = settings, values, spaces

    @classmethod
    def take(cls) -> Baseline:
        settings = _settings()
        spaces = _Spaces()
        spaces.add_new()
        return cls(settings, [s.read() for s in settings], spaces)

    def rebase(self) -> None:
        """Take what the process holds now as the baseline: after the harness's own set-up (a world
        made, a mesh built), which may import and install what torch installs lazily."""
        self.values = [s.read() for s in self.settings]
        self.spaces.rebase()

    def check(self, put_back_code: bool = False) -> StateChanges:
        """What moved since the baseline, settings put back where torch can set them; the code
        too when ``put_back_code`` (a process that cannot be replaced: under torchrun)."""
        changes = StateChanges()
        # those that can be put back first: putting back the default device leaves its mode
        pairs = sorted(zip(self.settings, self.values), key=lambda pair: pair[0].write is None)
        for setting, before in pairs:
            try:
                now = setting.read()
            except Exception:  # noqa: BLE001  a getter that needs what this build lacks
                continue
            if now == before:
                continue
            changes.lines.append(setting.told(now))
            if setting.write is None:
                changes.fit = False
                continue
            try:
                setting.write(before)
            except Exception:  # noqa: BLE001  cannot be set back: the process is unfit
                changes.fit = False
        code = self.spaces.moved()
        changes.lines.extend(code)
        if self.spaces.patched:
            if put_back_code:
                self.spaces.put_back()
            else:
                changes.fit = False
        # a module first imported during the task is taken as it is now: a later task that patches
        # it is found, one that patched it while importing it is not (see docs/architecture.md)
        self.spaces.add_new()
        return changes
