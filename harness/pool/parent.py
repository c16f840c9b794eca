"""Parent side of the warm pool of ranks.

One pool per pytest process, started on first use and reused by every case: ranks are forked from
a zygote, itself forked from a keeper that imported torch once for every pool of the process (the
pool of one beside it, a pool started again after a hang), connected once over one process group (rendezvous through a
TCPStore on a port the OS picks, hosted by the zygote, so parallel pytest workers never collide), and sent one task at a
time. Each task runs under a deadline. When it passes, or a rank raises or dies, every rank's
outcome is reported (tracebacks; Python stacks of the stuck ones, gathered with faulthandler); a
pool with stuck or dead ranks is killed and the next task starts a fresh one.
"""
from __future__ import annotations

import atexit
import json
import os
import pickle
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from ..layout import MeshLayout, declared
from . import pooldir, wire
from .defaults import DEFAULT_DEADLINE, DEFAULT_SIZE
from .backend import resolve as resolve_backend

# How long the other ranks get to finish once one rank has raised or died: past it they are stuck.
FAILURE_GRACE = 2.0
# How long the zygote gets to end its pool itself (kill and reap its ranks, remove the directory)
# before its whole process group is killed: well under a second (8 ranks, loaded 2-core machine)
# unless the zygote is stuck outside Python.
STOP_GRACE = 10.0
PRELOAD = ("harness.context", "harness.layout", "harness.config", "harness.pool.tasks")


def default_preload(cfgs=None) -> tuple[str, ...]:
    """The harness's modules and the modules of the components and implementations ``cfgs`` use
    (every registered one when None)."""
    from ..registry import preload_modules

    return PRELOAD + tuple(preload_modules(cfgs))


def reference_preload(cfgs=None) -> tuple[str, ...]:
    """What the pool of one (:meth:`Pool.alone`) imports before its fork: the harness's modules and
    those of the references and calibrations of the components ``cfgs`` use (every registered
    one's when None)."""
    from ..registry import reference_modules

    return PRELOAD + tuple(reference_modules(cfgs))


def preloads(cfgs) -> dict:
    """:class:`Pool`'s ``preload`` and ``alone_preload`` for a run of ``cfgs`` (configs, or
    ``(component, implementation)`` pairs): what their
    components and implementations need, not every registered one's (transformers, Megatron-Core:
    seconds); None each (every registered one's) when there is none, or a None among them (a pool
    user that is not a cell)."""
    if not cfgs or not all(cfgs):
        return {"preload": None, "alone_preload": None}
    return {"preload": default_preload(cfgs), "alone_preload": reference_preload(cfgs)}


class PoolError(RuntimeError):
    """The pool could not start or cannot run a task of this shape."""


class LeftChanged(UserWarning):
    """A cell that passed left its processes changed (grad mode off, a function of torch replaced,
    ...): said on that cell, while the next cell starts from clean ones."""


def _ports_outside_ephemeral() -> list[range]:
    """The ports the kernel never hands out by itself (for a connection's own end, or a bind to 0):
    outside ``ip_local_port_range``, above the privileged and the commonly served ones."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        return []
    return [r for r in (range(20000, low), range(high + 1, 65536)) if len(r) > 1000]


_PORTS = _ports_outside_ephemeral()
_CHOICE = random.Random()  # its own: the cells' seeded global random stays untouched


def free_port() -> int:
    """A TCP port nobody listens on now: the ``MASTER_PORT`` a task sees, where a trainer's own
    ``init_process_group("env://")`` hosts its store (the world's store is elsewhere).

    Drawn outside the ephemeral range where there is one: a port the kernel picked (bind to 0) is
    free only until the kernel picks it again, for one of the thousands of gloo connections the
    ranks of this and other runs make, and the trainer's listen then fails (EADDRINUSE)."""
    for _ in range(50 if _PORTS else 0):
        port = _CHOICE.choice(_CHOICE.choice(_PORTS))
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fitting(mesh, extra_meshes, size: int, short: str) -> tuple[MeshLayout, tuple, int]:
    """``mesh`` as its :class:`MeshLayout`, each extra mesh as a :class:`harness.layout.MeshDeclaration`,
    and the world the task runs in (the largest of all its meshes'); a :class:`PoolError` when one
    needs more than ``size`` ranks (``short``: what there is and the fix, a format string with
    ``{size}`` and ``{need}``)."""
    layout = MeshLayout.of(tuple(mesh))
    extra = tuple(declared(m) for m in extra_meshes)
    for m in (layout, *extra):
        if m.world > size:
            raise PoolError(f"mesh {m.id} needs {m.world} ranks but {short.format(size=size, need=m.world)} "
                            "or choose a smaller mesh")
    return layout, extra, max(m.world for m in (layout, *extra))


@dataclass
class Outcome:
    """What one rank did with a task."""

    rank: int
    status: str  # "ok", "idle", "raised", "died", "hung"
    value: Any = None
    detail: str = ""  # traceback, stack, or how it died
    summary: str = ""  # one line

    def line(self) -> str:
        return f"rank {self.rank}: {self.status}" + (f": {self.summary}" if self.summary else "")

    @classmethod
    def of_reply(cls, rank: int, status: str, value: Any) -> Outcome:
        """The outcome of a rank's reply ``(status, value)`` (:func:`harness.pool.rank.run_task`'s,
        from the pool's ranks and torchrun's alike): a raised one's traceback is its detail, its
        last line the summary."""
        if status != "raised":
            return cls(rank, status, value=value)
        text = str(value)
        return cls(rank, "raised", detail=text, summary=(text.strip().splitlines() or ["exception"])[-1])


def failure_reason(label: str, elapsed: float, parts) -> str:
    """The one sentence of a case that failed: ``case L failed after 1.2 s: raised on ranks [1],
    ...``, ``parts`` the (what, ranks) of each kind of failure in order."""
    what = f"case {label} " if label else "case "
    return f"{what}failed after {elapsed:.1f} s: " + ", ".join(f"{kind} on ranks {ranks}" for kind, ranks in parts)


def deadline_reason(label: str, deadline: float, stuck: list[int]) -> str:
    """The one sentence of a case whose ``stuck`` ranks were still running at its deadline."""
    what = f"case {label} " if label else "case "
    return f"{what}passed its deadline of {deadline:.1f} s: ranks {stuck} still running"


def ranks_text(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-3``, ``ranks 0, 2, 5-7``."""
    runs, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(f"{start}-{r}" if r > start + 1 else f"{start}, {r}" if r == start + 1 else f"{r}")
            start = None
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(runs)


class CaseFailure(AssertionError):
    """A task that did not finish cleanly on every rank. ``outcomes`` holds every rank's story; ranks
    that tell the same one are told together, once."""

    def __init__(self, reason: str, outcomes: dict[int, Outcome], world: int):
        self.reason, self.outcomes, self.world = reason, outcomes, world
        statuses = {o.status for o in outcomes.values()}
        self.kind = "crash" if statuses & {"raised", "died"} else "hang"
        lines = [reason, "every rank of the case:"]
        for (status, summary), ranks in _alike(outcomes, lambda o: (o.status, o.summary), world):
            lines.append(f"  {ranks_text(ranks)}: {status}" + (f": {summary}" if summary else ""))
        failed = {r: o for r, o in outcomes.items() if o.status in ("raised", "hung", "died") and o.detail
                  and o.detail.strip() != o.summary}
        for (status, detail), ranks in _alike(failed, lambda o: (o.status, o.detail.rstrip())):
            lines.append(f"--- {ranks_text(ranks)} ({status}) ---\n{detail}")
        super().__init__("\n".join(lines))


def _alike(outcomes: dict[int, Outcome], key, below: int | None = None) -> list[tuple[tuple, list[int]]]:
    """Outcomes grouped by ``key``, in the order of their first rank: (key, ranks)."""
    groups: dict[tuple, list[int]] = {}
    for r in sorted(outcomes):
        if below is None or r < below:
            groups.setdefault(key(outcomes[r]), []).append(r)
    return list(groups.items())


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def summarize_stack(text: str, root: str = "") -> tuple[str, str]:
    """(one-line summary, the stack of the rank's main thread) from a faulthandler dump."""
    threads = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip())
    main = next((t for t in threads if "harness/pool/rank.py" in t), threads[-1] if threads else "")
    frames = [m.groupdict() for m in map(_FRAME.match, main.splitlines()) if m]  # innermost first

    # shortest readable path: relative to the working directory or the import root that holds it
    bases = sorted({b for b in [root, *sys.path] if b and os.path.isabs(b)}, key=len, reverse=True)

    def short(frame: dict) -> str:
        path = frame["file"]
        base = next((b for b in bases if path.startswith(b.rstrip(os.sep) + os.sep)), None)
        return f"{os.path.relpath(path, base) if base else path}:{frame['line']}"

    collective = next((f for f in frames if "distributed_c10d" in f["file"]), None) or next(
        (f for f in frames if "torch/distributed" in f["file"]), None
    )
    caller = next(
        (f for f in frames if "/torch/" not in f["file"] and not f["file"].endswith("harness/pool/rank.py")), None
    )
    parts = []
    if collective:
        parts.append(f"in {collective['func']} ({os.path.basename(collective['file'])}:{collective['line']})")
    if caller:
        parts.append(f"at {short(caller)} in {caller['func']}")
    if not parts and frames:
        parts.append(f"at {short(frames[0])} in {frames[0]['func']}")
    body = "\n".join(f"  {short(f)} in {f['func']}" for f in frames)
    return " ".join(parts) or "no Python frame", "stack, innermost first:\n" + body


def single_threaded() -> None:
    """One intra-op thread in the process that drives a pool. It only compares small tensors, and
    between two ops torch's OpenMP threads spin on the cores its ranks are waiting for: beside a busy
    neighbour, a model cell took twice the wall and 2.4x the CPU (docs/performance.md)."""
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


class Pool:
    """A warm pool of ``size`` rank processes. Thread-unsafe: one task at a time."""

    # a failing cell can be run again, with its events recorded, to find where it diverges
    can_rerun = True

    def __init__(self, size: int = DEFAULT_SIZE, backend: str = "auto", deadline: float = DEFAULT_DEADLINE,
                 start_timeout: float = 180.0, preload: tuple[str, ...] | None = None, keep: float = 0.0,
                 root: str | None = None, alone_preload: tuple[str, ...] | None = None):
        """``preload``: the modules the zygote imports before it forks the ranks (None: every
        registered component's and implementation's, :func:`default_preload`); ``alone_preload``:
        those of the pool of one beside it (:meth:`alone`; None: :func:`reference_preload`).
        ``keep``: seconds a kept pool (:mod:`.kept`) waits idle after this process is done with it;
        0 (the default): this process's own zygote, gone with it. ``root``: the checkout a kept
        pool belongs to (the working directory by default)."""
        if size < 1:
            raise PoolError(f"pool size {size} must be at least 1")
        self.size, self.deadline, self.start_timeout = size, deadline, start_timeout
        self.backend = resolve_backend(backend)
        self.preload = preload  # None: default_preload() at each launch, so late registrations count
        self.alone_preload = alone_preload
        self.keep, self.root = keep, root
        self._proc = None  # the zygote: a keeper's run zygote (kept.Remote)
        self._conns: list[Connection] = []
        self._pids: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._status_buf = b""
        self._port: int | None = None
        self._ready = False
        self._tmp: str | None = None
        self._hold: int | None = None  # this process's hold on _tmp (see pooldir)
        self._task = 0
        self._built: set[tuple] = set()
        self._world = (0, 0)
        self._alone: Pool | None = None  # the rank of one beside this pool (:meth:`alone`)
        self._unfit: str | None = None  # the scratch of the cell that left the ranks unfit for another
        self._served = False
        self.starts = 0  # how many times a pool was started (tests check restarts)
        atexit.register(self.close)

    # ---- lifecycle ---------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pids(self) -> list[int]:
        """Process ids of the zygote and the ranks, and of the pool of one beside it (empty when not
        started)."""
        return (([self._proc.pid] if self._proc and self._proc.pid else []) + list(self._pids.values())
                + (self._alone.pids if self._alone else []))

    def launch(self, alone: bool = False) -> None:
        """Start the zygote without waiting for it: the keeper's imports overlap the caller's work.
        ``alone``: the pool of one beside it too (:meth:`alone`), asked for second, so that its
        zygote forks once the keeper has imported what both need."""
        if self._proc is None or self._proc.poll() is not None:
            self._launch()
        if alone:
            self._beside().launch()

    def _launch(self) -> None:
        single_threaded()
        self.kill()
        pooldir.sweep()  # what pools killed together with their zygotes and ranks left behind
        self._tmp, self._hold = pooldir.create()
        pairs = [socket.socketpair() for _ in range(self.size)]
        child_fds = [child.fileno() for _, child in pairs]
        preload = list(default_preload() if self.preload is None else self.preload)
        try:
            self._proc = self._launch_from_keeper(child_fds, preload)
        except PoolError:
            for pair in pairs:
                for end in pair:
                    end.close()
            self.kill()  # its directory and hold
            raise
        self.starts += 1
        self._served = False  # whether these ranks ran a task (fresh tasks want ranks that did not)
        self._ready = False
        for _, child in pairs:
            child.close()
        self._conns = [Connection(parent.detach()) for parent, _ in pairs]
        self._pids, self._exits, self._status_buf, self._port = {}, {}, b"", None
        self._built: set[tuple] = set()  # (mesh, extra meshes) whose groups every rank has built
        self._world = (0, 0)  # (size, generation) of the ranks' world: none yet

    def _launch_from_keeper(self, child_fds: list[int], preload: list[str]):
        """Ask a keeper to fork this pool's zygote: this checkout's kept one (``keep``; started if
        there is none, or a stale one), else this process's own (:class:`.kept.ForkServer`), or its
        xdist run's (:class:`.kept.RunKeeperClient`). Each imported torch and the third-party modules
        once; the project's modules are imported in the run's own zygote, after the keeper's fork.
        The kept one answers at once; the others once they have imported, read when first needed, so
        those imports overlap the caller's work."""
        from . import kept

        kept_preload, per_run = kept.split_preload(preload)
        status_read, status_write = os.pipe()
        message = {"backend": self.backend, "tmp": self._tmp, "preload": per_run, "cwd": os.getcwd(),
                   "env": dict(os.environ, OMP_NUM_THREADS="1"), "path": [p for p in sys.path if p]}
        fds = [*child_fds, status_write]
        try:
            if self.keep > 0:
                sock, reply = kept.request(self.root or os.getcwd(), self.keep, kept_preload, message, fds)
                pid = reply["pid"]
            else:
                sock, pid = kept.own_keeper().request(kept_preload, message, fds), None
        except (kept.KeptPoolError, OSError) as error:
            os.close(status_read)
            raise PoolError(f"{'kept pool' if self.keep > 0 else 'pool'}: {error}") from None
        finally:
            os.close(status_write)
        return kept.Remote(pid, sock, status_read)

    def start(self, alone: bool = False) -> None:
        """Launch if needed and wait until every rank has joined the process group; ``alone``: the
        pool of one beside it (:meth:`alone`) too, the two starting together."""
        if alone:
            self.launch(alone=True)  # both asked for before either is waited for
        if not (self.alive and self._ready):
            self._start()
        if alone:
            self._beside().start()

    def _start(self) -> None:
        self.launch()
        end = time.monotonic() + self.start_timeout
        while self._port is None:
            self._read_status(max(0.0, end - time.monotonic()))
            if self._port is None and (self._proc.poll() is not None or time.monotonic() > end):
                self._fail_start("the zygote exited or did not fork the ranks in time")
        port = pickle.dumps(("port", self._port))
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(port)
            except OSError:  # its end is closed: it died before it read where the store is
                self._fail_start("died while starting", dead=rank)
        ready = set()
        while len(ready) < self.size:
            left = end - time.monotonic()
            pending = [c for r, c in enumerate(self._conns) if r not in ready]
            if left <= 0 or not wait(pending, timeout=left):
                self._fail_start(f"ranks {sorted(set(range(self.size)) - ready)} did not join the process group")
            for conn in wait(pending, timeout=0):
                try:
                    _, rank = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._fail_start("died while starting", dead=self._conns.index(conn))
                ready.add(rank)
        self._ready = True

    def _fail_start(self, why: str, dead: int | None = None) -> None:
        """Raise the :class:`PoolError` of a start that failed ``why``; ``dead``: the rank whose death
        it was, named with how it ended (its exit code or signal)."""
        if dead is not None:
            self._await_exits([dead])
            why = f"rank {dead} {why} ({self._ending(dead)})"
        logs = self._logs(range(self.size), tail=20)
        zygote = self._read(os.path.join(self._tmp, "zygote.log"))[-3000:] if self._tmp else ""
        if self.keep <= 0 and self._proc is not None and self._proc.poll() is not None:
            from . import kept

            zygote += f"\nthis process's keeper: {kept.own_keeper().log()}\n"
        self.kill()
        raise PoolError(f"pool of {self.size} ranks failed to start: {why}\n{zygote}{logs}")

    def kill(self) -> None:
        """Kill the zygote and every rank, and clean up. The zygote does it on SIGTERM (see
        ``leave`` in :mod:`.rank`), so the directory goes even if this process dies meanwhile."""
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:  # stuck outside Python: the whole group at once
                self._proc.kill_group()
                self._proc.wait()
            self._proc.close()
            self._proc = None
        for conn in self._conns:
            conn.close()
        self._conns, self._pids, self._ready = [], {}, False
        self._unfit = None
        if self._tmp:
            pooldir.remove(self._tmp)
            self._tmp = None
        if self._hold is not None:
            os.close(self._hold)
            self._hold = None

    def close(self) -> None:
        """Stop the pool and the pool of one beside it. Ranks hold nothing worth flushing, so they are
        killed outright: a polite stop only made every pytest process wait for the zygote's
        interpreter to shut down (the zygote skips its own shutdown too)."""
        self.kill()
        if self._alone is not None:
            self._alone.close()

    # ---- running a task ----------------------------------------------------------------
    def run(self, fn: str, payload: Any, mesh: tuple[tuple[str, int], ...], *, seed: int = 0,
            deadline: float | None = None, label: str = "", extra_meshes=(), scratch: str | None = None,
            fresh: bool = False) -> dict[int, Any]:
        """Run ``fn(ctx, payload)`` (an import path, ``"module:function"``) on every rank of ``mesh``.

        ``extra_meshes``: further meshes (over the first ranks of the pool: dims tuples, MeshLayouts
        or MeshSpecs, :func:`harness.layout.declared`) the task may use through ``ctx.mesh(dims)`` or
        ``ctx.meshes_for(spec)``. The task runs in a world of the largest of these meshes
        (:mod:`harness.world`: its default group, torchrun's environment), whose every rank takes
        part in creating their groups, so they must be declared here rather than built inside the
        task.

        ``scratch``: the directory the task's ranks share (``ctx.scratch``), empty; by default one of
        the pool's own, removed after the task.

        ``fresh``: on ranks no task ran on (ranks that served one are replaced first), for code whose
        libraries keep state across builds that the clean-start check cannot see; a task in a
        directory of :meth:`new_scratch` runs on the ranks that made it (``new_scratch(fresh=True)``).

        Returns each mesh rank's return value. Raises :class:`CaseFailure` when any rank raises,
        dies or is still running at the deadline, with every rank's outcome.
        """
        mesh, extra, size = fitting(mesh, extra_meshes, self.size, "the pool has {size}: run with --pool-size {need}")
        world = mesh.world
        if (self._unfit is not None and (scratch is None or scratch != self._unfit)) or \
                (fresh and self._served and scratch is None):
            self.kill()  # a cell before this one left its ranks unfit, or this one asks for new ones
        self.start()
        if self._world[0] != size:  # a world of another size: a new default group, new meshes
            self._world = (size, self._world[1] + 1)
            self._built.clear()
        if (mesh, extra) not in self._built:
            # Making the world and building a mesh's groups are rounds of rendezvous on the ranks:
            # setup, not the case, so they run first under the start timeout and the deadline
            # measures the case.
            self._task_in_scratch("harness.pool.tasks:noop", None, mesh, extra, 0, world, self.start_timeout,
                                  f"{label} (building its meshes)")
            self._built.add((mesh, extra))
        return self._task_in_scratch(fn, payload, mesh, extra, seed, world,
                                     self.deadline if deadline is None else deadline, label, scratch)

    def new_scratch(self, fresh: bool = False) -> str:
        """An empty directory for a caller's task (``run(scratch=...)``), in the pool's own temporary
        directory: gone with the pool whatever happens, removed or kept by the caller before that.
        A new directory is a new cell: ranks the last one left unfit are replaced first, and, for a
        ``fresh`` cell, ranks that ran any task (its directory lives in the pool's, so they are
        replaced here, before it is made, not by :meth:`run`)."""
        if self._unfit is not None or (fresh and self._served):
            self.kill()
        self.start()
        return tempfile.mkdtemp(prefix="cell", dir=self._tmp)

    def alone(self, fn: str, payload: Any, mesh: tuple[tuple[str, int], ...], *, seed: int = 0,
              deadline: float | None = None, label: str = "") -> Any:
        """``fn(ctx, payload)`` on ``mesh`` (every degree 1) in a world of one: on the rank of a pool
        of one kept beside this one (started with it by ``start``/``launch(alone=True)``, else on
        first use; closed with it), whose world never
        changes. Run on this pool's first rank instead, it would take this pool from the cells' world
        to one of one and back, and every mesh built for the cells would be built again after it (a
        rendezvous on every rank: the checkpoint cells ran twice as long so). A rank paid torch's
        lazy imports before its fork (the optimizer step's ``torch._dynamo``, about 1 s), so a
        reference computed here costs this process none of them. Returns that rank's value; raises
        :class:`CaseFailure` as :meth:`run`."""
        if MeshLayout.of(tuple(mesh)).world != 1:
            raise PoolError(f"a task alone runs on a mesh of one rank, not {mesh}")
        return self._beside().run(fn, payload, mesh, seed=seed, label=label,
                                  deadline=self.deadline if deadline is None else deadline)[0]

    def _beside(self) -> Pool:
        """The pool of one beside this one (:meth:`alone`), made on first use."""
        if self._alone is None:
            preload = reference_preload() if self.alone_preload is None else self.alone_preload
            self._alone = Pool(1, self.backend, self.deadline, self.start_timeout, preload, self.keep, self.root)
        return self._alone

    def _task_in_scratch(self, fn: str, payload: Any, mesh: tuple, extra: tuple, seed: int, world: int,
                         deadline: float, label: str, given: str | None = None) -> dict[int, Any]:
        self._task += 1
        self._served = True
        if given is not None:  # the caller's, and the caller's to remove
            return self._run(fn, payload, mesh, extra, seed, given, world, deadline, label)
        scratch = os.path.join(self._tmp, f"task{self._task}")
        os.mkdir(scratch)
        try:
            return self._run(fn, payload, mesh, extra, seed, scratch, world, deadline, label)
        finally:
            if self._tmp:  # a failed task may have killed the pool, and its temp dir with it
                shutil.rmtree(scratch, ignore_errors=True)

    def _run(self, fn: str, payload: Any, mesh: tuple, extra: tuple, seed: int, scratch: str, world: int,
             deadline: float, label: str) -> dict[int, Any]:
        message = wire.dumps(("run", self._task, fn, payload, mesh, extra, seed, scratch, self._world, free_port()))
        outcomes: dict[int, Outcome] = {}
        changed_on: dict[int, dict] = {}  # what each rank's task left changed (rank.Before.left)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except OSError:
                outcomes[rank] = Outcome(rank, "died")
        start = time.monotonic()
        end = start + deadline
        failed_at = None if not outcomes else start
        conn_rank = {id(c): r for r, c in enumerate(self._conns)}
        while len(outcomes) < self.size:
            limit = end if failed_at is None else min(end, failed_at + FAILURE_GRACE)
            left = limit - time.monotonic()
            pending = [c for r, c in enumerate(self._conns) if r not in outcomes]
            ready = wait(pending, timeout=max(0.0, left)) if left > 0 else []
            if not ready:
                break
            for conn in ready:
                rank = conn_rank[id(conn)]
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    outcomes[rank] = Outcome(rank, "died")
                    failed_at = failed_at or time.monotonic()
                    continue
                try:
                    status, task, _, value, changed = pickle.loads(data)
                except Exception as error:  # noqa: BLE001  e.g. a result type the parent cannot import
                    why = f"its result cannot be unpickled in the parent ({type(error).__name__}: {error}); " \
                          "return tensors, Pieces and plain Python values"
                    outcomes[rank] = Outcome(rank, "raised", detail=why, summary=why)
                    failed_at = failed_at or time.monotonic()
                    continue
                if task != self._task:
                    continue
                outcomes[rank] = Outcome.of_reply(rank, status, value)
                if changed:
                    changed_on[rank] = changed
                if status == "raised":
                    failed_at = failed_at or time.monotonic()
        told = self._settle(changed_on, scratch)
        if len(outcomes) == self.size and all(o.status in ("ok", "idle") for o in outcomes.values()):
            if told:
                warnings.warn(LeftChanged(f"{label or 'a task'}: {told}"), stacklevel=4)
            return {r: outcomes[r].value for r in range(world)}
        raise self._failure(outcomes, world, deadline, label, time.monotonic() - start, told)

    def _settle(self, left: dict[int, dict], scratch: str) -> str:
        """Act on what a task's code left changed on its ranks (:meth:`harness.pool.rank.Before.left`):
        a world disturbed is entered anew by the next task; ranks unfit to serve another cell are
        replaced before the next cell (the next task with another scratch directory, or
        :meth:`new_scratch`). The line that tells what changed, or ""."""
        if any(changed["world"] for changed in left.values()):
            self._world = (self._world[0], self._world[1] + 1)  # every rank makes the world anew
            self._built.clear()
        if any(not changed["fit"] for changed in left.values()):
            self._unfit = scratch
        ranks: dict[str, list[int]] = {}
        for rank, changed in sorted(left.items()):
            for line in changed["told"]:
                ranks.setdefault(line, []).append(rank)
        if not ranks:
            return ""
        where = "on the rank of one" if self.size == 1 else None
        said = "; ".join(f"{line} ({where or ranks_text(rs)})" for line, rs in ranks.items())
        return f"its code left its processes changed: {said}; the next cell starts clean"

    def _failure(self, outcomes: dict[int, Outcome], world: int, deadline: float, label: str,
                 elapsed: float, told: str = "") -> CaseFailure:
        """The task's :class:`CaseFailure`; ``told``: what its code left changed (:meth:`_settle`),
        maybe the very cause, said in its first line."""
        stuck = [r for r in range(self.size) if r not in outcomes]
        stacks = self._dump_stacks(stuck) if stuck else {}
        for r in stuck:
            summary, stack = summarize_stack(stacks.get(r, ""), os.getcwd())
            outcomes[r] = Outcome(r, "hung", detail=stack, summary=summary)
        dead = [r for r, o in outcomes.items() if o.status == "died"]
        if dead:
            self._await_exits(dead)
            for r in dead:
                how = self._ending(r)
                outcomes[r].summary = f"process died ({how})"
                outcomes[r].detail = f"process died ({how}); its output, last lines:\n" + self._logs([r], tail=15)
        kinds = sorted({o.status for o in outcomes.values()} - {"ok", "idle"})
        if stuck and not (dead or any(o.status == "raised" for o in outcomes.values())):
            reason = deadline_reason(label, deadline, [r for r in stuck if r < world])
        else:
            reason = failure_reason(label, elapsed, [(k, [r for r, o in sorted(outcomes.items()) if o.status == k])
                                                     for k in kinds])
        if stuck or dead:
            self.kill()  # a pool with stuck or dead ranks cannot be trusted: the next task starts afresh
        return CaseFailure(f"{reason}; {told}" if told else reason, outcomes, world)

    # ---- helpers -----------------------------------------------------------------------
    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._tmp, f"rank{rank}.stack")

    def _dump_stacks(self, ranks: list[int], settle: float = 2.0) -> dict[int, str]:
        """Every listed rank's Python stacks, from faulthandler on SIGUSR1."""
        offsets = {r: os.path.getsize(self._stack_path(r)) for r in ranks}
        for r in ranks:
            try:
                os.kill(self._pids[r], signal.SIGUSR1)
            except (ProcessLookupError, KeyError):
                pass
        end, last, stable_since = time.monotonic() + settle, None, time.monotonic()
        while time.monotonic() < end:
            sizes = tuple(os.path.getsize(self._stack_path(r)) for r in ranks)
            if sizes != last:
                last, stable_since = sizes, time.monotonic()
            elif all(s > offsets[r] for s, r in zip(sizes, ranks)) and time.monotonic() - stable_since > 0.1:
                break
            time.sleep(0.02)
        out = {}
        for r in ranks:
            with open(self._stack_path(r), errors="replace") as f:
                f.seek(offsets[r])
                out[r] = f.read()
        return out

    def _read_status(self, timeout: float) -> None:
        """Read the zygote's status lines (rank pids, rank exits)."""
        stream = self._proc.stdout
        if not select.select([stream], [], [], timeout)[0]:
            return
        chunk = os.read(stream.fileno(), 65536)
        self._status_buf += chunk
        *lines, self._status_buf = self._status_buf.split(b"\n")
        for line in lines:
            record = json.loads(line)
            if "pids" in record:
                self._pids = {int(r): p for r, p in record["pids"].items()}
                self._port = record["port"]
            else:
                self._exits[record["exit"]] = record["code"]
        if not chunk:
            time.sleep(timeout)  # EOF: the zygote is gone, nothing more will come

    def _await_exits(self, ranks: list[int], timeout: float = 1.0) -> None:
        end = time.monotonic() + timeout
        while any(r not in self._exits for r in ranks) and time.monotonic() < end and self._proc:
            self._read_status(max(0.0, end - time.monotonic()))

    def _ending(self, rank: int) -> str:
        """How the rank's process ended, as its zygote reported it."""
        code = self._exits.get(rank)
        if code is None:
            return "unknown exit status"
        return f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    @staticmethod
    def _read(path: str) -> str:
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _logs(self, ranks, tail: int) -> str:
        if not self._tmp:
            return ""
        out = []
        for r in ranks:
            lines = self._read(os.path.join(self._tmp, f"rank{r}.log")).splitlines()[-tail:]
            if lines:
                out.append(f"[rank {r} output]\n" + "\n".join(lines))
        return "\n".join(out)


_shared: Pool | None = None


def shared_pool(**options) -> Pool:
    """The pool of this process, created on first use with ``options``."""
    global _shared
    if _shared is None:
        _shared = Pool(**options)
    return _shared
