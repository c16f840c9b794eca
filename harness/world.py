"""A cell's world: the default process group and torchrun's environment over exactly the cell's ranks.

Training code reads the world torchrun made: ``dist.get_world_size()``, ``dist.get_rank()``,
collectives without ``group=`` (the default group), ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``, and
``init_device_mesh(device, shape)`` over the whole world. So every task runs in a world of its own
size: a rank process holds one default group at a time, over the task's first ``size`` ranks, and
makes a new one (a fresh rendezvous under a store prefix of its own) when a task needs another size.
Ranks beyond the size hold no group and idle. Leaving a world destroys every group made in it, so
nothing made by one cell's code reaches a cell of another size; the environment a task changed is
put back after it.

The pool's ranks and torchrun's ranks keep their world the same way; the caller numbers the worlds
(``generation``) so that every rank of a new world rendezvouses under the same prefix.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import weakref
from datetime import timedelta

from .names import DENSE, GROUPS, TORCHTITAN

# what torchrun sets for every worker, set for every rank of a cell's world
ENVIRONMENT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class World:
    """This rank's default process group, sized to the task at hand.

    ``store``: the rendezvous store every rank reaches; ``address``/``port``: where it listens (the
    cell's ``MASTER_ADDR``/``MASTER_PORT``); ``per_host``: ranks per host (the pool: all of them).
    ``current``: the group this rank holds now, ``(size, generation)``, or None."""

    def __init__(self, rank: int, backend: str, store, device, address: str, port: int, per_host: int,
                 timeout: timedelta | None = None, current: tuple[int, int] | None = None):
        self.rank, self.backend, self.store, self.device = rank, backend, store, device
        self.address, self.port, self.per_host, self.timeout = address, port, per_host, timeout
        self.current = current
        self._group = None  # the default group this World made, to tell it from one a cell's code made
        if current is not None:  # handed a world already made (torchrun's job group)
            import torch.distributed as dist

            self._group = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None

    def disturbed(self) -> bool:
        """Whether the cell's code left this rank's default group other than :meth:`enter` made it:
        destroyed, or replaced by one of its own (a trainer's ``destroy_process_group`` and
        ``init_process_group``). The world is then entered anew, under a new generation, before the
        next cell."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return self._group is not None
        return dist.distributed_c10d._get_default_group() is not self._group

    def enter(self, size: int, generation: int) -> bool:
        """Hold the default group of world ``(size, generation)`` (none beyond ``size``); True when
        this changed the world, so that groups and meshes built in the old one are gone."""
        import torch.distributed as dist

        if self.current == (size, generation):
            return False
        if dist.is_initialized():
            dist.destroy_process_group()  # every group of the old world, the shared ones too
            # DTensor caches sharding decisions by mesh, and a mesh equals the old world's mesh of the
            # same shape: the cached result would name the old world's (destroyed) groups
            clear_sharding_cache()
        self.current = (size, generation)
        if self.rank < size:
            store = dist.PrefixStore(f"paritytest-world/{generation}", self.store)
            options = {"timeout": self.timeout} if self.timeout is not None else {}
            if self.backend == "nccl":
                options["device_id"] = self.device
            dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=size, **options)
            self._group = dist.distributed_c10d._get_default_group()
        else:
            self._group = None
        return True

    def environment(self, size: int, port: int | None = None) -> dict[str, str]:
        """torchrun's variables for this rank in a world of ``size`` ranks over hosts of
        ``per_host`` ranks each, the ranks numbered host by host; ``MASTER_PORT`` is ``port`` where
        given (the pool: a free one per task, where a trainer's own ``init_process_group("env://")``
        can host its store), else the world's store's."""
        host, local = divmod(self.rank, self.per_host)
        hosts = -(-size // self.per_host)
        on_host = min(self.per_host, size - host * self.per_host)
        return {"RANK": str(self.rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(size),
                "LOCAL_WORLD_SIZE": str(on_host), "GROUP_RANK": str(host), "GROUP_WORLD_SIZE": str(hosts),
                "ROLE_RANK": str(self.rank), "ROLE_WORLD_SIZE": str(size), "MASTER_ADDR": self.address,
                "MASTER_PORT": str(self.port if port is None else port)}

    @contextlib.contextmanager
    def inside(self, size: int, port: int | None = None):
        """The task's environment: torchrun's variables of this world (:meth:`environment`);
        afterwards the environment as it was before the task, whatever the task's code set or removed."""
        before = dict(os.environ)
        os.environ.update(self.environment(size, port))
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(before)


@contextlib.contextmanager
def alone():
    """A world of one for the block: this process as rank 0 of a default group of one rank (gloo, a
    store of its own) with torchrun's variables saying the same, as ``torchrun --nproc-per-node 1``
    makes it. A reference runs here, so code that reads the world (a loss divided by
    ``dist.get_world_size()``, seeding by ``dist.get_rank()``, a mesh over the world) computes what one
    process computes. In a process that already holds a world of one (a pool rank given a task of one
    rank) the block runs in it; a larger world is refused: a reference never runs beside other ranks."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"a reference must run in a world of one, not in this world of "
                               f"{dist.get_world_size()} ranks")
        yield
        return
    with _own_world_of_one():
        yield


@contextlib.contextmanager
def any_world():
    """The world this process holds, else a world of one: for the harness's own calls into a case's
    code whose values are not compared (counting its parameters, checking its batch's shape), which
    may read the world as training code does."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with _own_world_of_one():
        yield


def clear_sharding_cache() -> None:
    """Empty DTensor's cache of sharding decisions, where DTensor was imported: without it no
    cache exists, and importing it (0.6 s, sympy included) in a rank forked from a zygote that
    never did would cost every rank that time at its first change of world."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    # what torch.distributed.tensor.debug._clear_sharding_prop_cache does, without importing that
    # module: it imports CommDebugMode and with it torch._dynamo (0.6 s in each user's pytest process)
    import torch
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


@contextlib.contextmanager
def _own_world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    own = World(0, "gloo", None, None, "127.0.0.1", 0, per_host=1)
    try:
        with own.inside(1):
            yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        clear_sharding_cache()


class CellError(RuntimeError):
    """A cell's code used its world wrongly; the message is the whole story (no traceback needed)."""


class SplitNothing(CellError):
    """A mesh dim of degree above 1 over which the code under test split nothing: every rank ran the
    whole of what one process runs, so a match certifies nothing about that dim. Every rank raises
    the same line, ``<dim>=<degree>[, ...] split nothing: <what and how to declare it>``."""


class RanFp32(CellError):
    """A bf16 or fp16 model cell in which no module computed in that dtype on any rank: it ran in fp32,
    and a match would certify nothing about the dtype its id names. Every rank raises the same line,
    ``<dtype> ran in fp32: <what and how to set the precision>``."""


# the lines of a cell that ran nothing its id says: no verdict on its numbers to give
_SPLIT_NOTHING = re.compile(r"(?:(?:[a-z]+=\d+, )*[a-z]+=\d+ split nothing|(?:bf16|fp16) ran in fp32): ")


def vacuous_kind(line: str) -> str:
    """The record kind of such a line: ``split nothing`` or ``ran fp32``."""
    return "ran fp32" if re.match(r"(?:bf16|fp16) ran in fp32: ", line) else "split nothing"


def split_nothing(failure) -> str | None:
    """The line of a cell that ran nothing its id says (split nothing over a dim, or a bf16 or fp16
    cell that computed in fp32), when every rank of ``failure`` (a ``CaseFailure``) raised it; else
    None (a crash, a hang, ranks that disagree)."""
    told = {(o.status, o.summary) for r, o in failure.outcomes.items() if r < failure.world}
    if len(told) != 1:
        return None
    status, line = told.pop()
    return line if status == "raised" and _SPLIT_NOTHING.match(line) else None


def user_line(error: BaseException) -> str:
    """``file:line in function`` of the innermost frame of ``error`` in the user's code (not torch's,
    the harness's or the standard library's), or ""."""
    import sysconfig
    import traceback

    import torch

    harness = os.path.dirname(os.path.abspath(__file__))
    skip = [os.path.dirname(torch.__file__), harness, sysconfig.get_paths()["stdlib"]]
    shipped = os.path.join(harness, "examples") + os.sep  # the shipped cases are users' code

    def users(path: str) -> bool:
        path = os.path.abspath(path)
        return path.startswith(shipped) or not any(path.startswith(s + os.sep) for s in skip)

    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith("<frozen") and users(f.filename)]
    return f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""


def explained(error: BaseException, size: int) -> str | None:
    """One line for an error a cell's code made with its world (it called ``init_process_group``, built
    a mesh the world does not hold, or read an environment variable the world does not set), naming
    the fix; None for any other error."""
    for cause in (error, error.__cause__):
        if isinstance(cause, CellError):
            return str(cause)
        if cause is None:
            continue
        text = str(cause)
        where = user_line(cause)
        if "trying to initialize the default process group twice" in text:
            return (f"the cell's code called torch.distributed.init_process_group{where}, but the harness made "
                    f"this cell's world already: the default group over its {size} ranks, with RANK, WORLD_SIZE "
                    "and MASTER_ADDR/PORT set as torchrun sets them; call it only when not dist.is_initialized()")
        if "Default process group has not been initialized" in text:
            return (f"the cell's code destroyed its default process group (destroy_process_group), and then the "
                    f"cell needed it{where}: a trainer destroys it at exit; under the harness the cell's world "
                    "outlives its code (the next cell's world is made anew), so leave it, or make your own again "
                    "with init_process_group(\"env://\") as under torchrun")
        if "Mesh should not be bigger than default world size" in text:
            return (f"the cell's code built a device mesh{where} larger than its world of {size} ranks ({text}); "
                    "build it from dist.get_world_size(), its shape multiplying to the world")
        asked = re.search(r"Invalid mesh_dim_names \((.*?)\) specified", text)
        if isinstance(cause, KeyError) and asked and "ascending order" in text:  # names it has, out of order
            names = re.findall(r"'(\w+)'", asked.group(1))
            return (f"the cell's code sliced a mesh by {', '.join(names)}{where}, out of the order the mesh holds "
                    f"them in (torch: \"Mesh dim indices should be in ascending order\"): slice in the mesh's own "
                    f"order{', e.g. [' + ', '.join(repr(n) for n in reversed(names)) + ']' if len(names) == 2 else ''}")
        if isinstance(cause, KeyError) and asked:
            return _name_not_on_mesh(cause, re.findall(r"'(\w+)'", asked.group(1)), text.strip(chr(34)), where)
        if isinstance(cause, KeyError) and cause.args and isinstance(cause.args[0], str) \
                and cause.__traceback__ is not None and _raised_by_environ(cause):
            return (f"the cell's code read the environment variable {cause.args[0]}{where}, which this cell's "
                    f"world does not set: it sets {', '.join(ENVIRONMENT)} as torchrun does; read one of those, "
                    "or give a default with os.environ.get")
    return None


def _name_not_on_mesh(error: KeyError, names: list[str], text: str, where: str) -> str:
    """The line for a mesh asked for dims it does not name. The fix depends on whose mesh it is: the
    harness's under its own names (``ModelCase.mesh_names`` hands over a trainer's), the harness's
    under the names ``mesh_names`` gives (ask for one of those), or one the cell's code built."""
    asked = f"the cell's code asked a mesh for {', '.join(names)}{where}, which it does not name ({text})"
    mesh = _mesh_indexed(error)
    if mesh is None or not built_by_harness(mesh):
        return f"{asked}: the mesh is one the cell's code built; ask it for one of its own dims"
    root = mesh._get_root_mesh()
    if tuple(root.mesh_dim_names or ()) != ("world",):  # Meshes.renamed: the case's mesh_names are in effect
        shown = dict(zip(DENSE, root.mesh_dim_names[-len(DENSE):]))
        ours = [f"{n!r} is {shown[n]!r}" for n in names if shown.get(n, n) != n]
        return (f"{asked}: ModelCase.mesh_names names this case's dims as above"
                f"{' (' + ', '.join(ours) + ')' if ours else ''}; ask for one of those, or map the harness's "
                f"group ({', '.join(GROUPS)}) to that name in mesh_names (docs/models.md)")
    titan = [n for n in names if n in TORCHTITAN.values() and n not in GROUPS]
    fix = ("ModelCase(mesh_names='torchtitan') hands them over with torchtitan's names" if titan else
           "ModelCase(mesh_names={...}) hands them over with names of your own")
    return f"{asked}; the harness names the dims {', '.join(GROUPS)} (harness.names): {fix} (docs/models.md)"


# the root meshes the harness built for cells (harness.meshes), by identity: a DeviceMesh equals any
# other of its shape and names, one the cell's code built too
_HARNESS_MESHES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def harness_mesh(root):
    """``root``, a root mesh the harness built for a cell, known as such to the messages here."""
    _HARNESS_MESHES[id(root)] = root
    return root


def built_by_harness(mesh) -> bool:
    """Whether ``mesh`` was cut from a root mesh the harness built, not one the cell's code built."""
    root = mesh._get_root_mesh()
    return _HARNESS_MESHES.get(id(root)) is root


def _mesh_indexed(error: BaseException):
    """The ``DeviceMesh`` whose slicing raised ``error`` (the innermost frame's ``self`` that is one)."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh, tb = None, error.__traceback__
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, DeviceMesh):
            mesh = candidate
        tb = tb.tb_next
    return mesh


def _raised_by_environ(error: KeyError) -> bool:
    """Whether ``os.environ[...]`` raised ``error``."""
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return code.co_name == "__getitem__" and code.co_filename in (os.__file__, "<frozen os>")


def check_mesh_covers(module_or_modules, size: int) -> None:
    """Raise :class:`CellError` when a DTensor parameter lives on a mesh that does not span the
    world: a mesh shape that multiplies to fewer ranks than the cell has."""
    from torch.distributed.tensor import DTensor

    roots = module_or_modules if isinstance(module_or_modules, (list, tuple)) else [module_or_modules]
    for root in roots:
        for name, p in root.named_parameters():
            if isinstance(p, DTensor):
                mesh = p.device_mesh._get_root_mesh()
                if mesh.size() != size:
                    raise CellError(f"parameter {name} lives on a device mesh of {mesh.size()} ranks "
                                     f"(shape {tuple(mesh.shape)}), but this cell's world has {size}: build the "
                                     "mesh over the whole world, its shape multiplying to dist.get_world_size()")
