"""Child side of the warm pool.

A pool's zygote is forked by a keeper (:mod:`harness.pool.keeper`) that imported torch once, and
forks every rank from that warm image (spawning a fresh Python per rank costs ~2 s of imports each
on this machine). Every rank then serves tasks from its socket
until told to stop or until its parent disappears, each task in a world of the task's own size
(:mod:`harness.world`): the default group over the task's first ranks.
"""
from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib
import json
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from . import pooldir
from .state import Baseline

PR_SET_PDEATHSIG = 1
PR_SET_TIMERSLACK = 29
# How late the kernel may wake a rank's timed waits. gloo's transport loop (a thread per process
# group) sleeps in epoll_wait with a 10 ms timeout to poll for its own shutdown, idle or not; a rank
# holds ~20 groups, so a pool's ranks woke ~30,000 times a second: a sixth to a quarter of the
# matrix's CPU on 2 cores (docs/performance.md). A
# socket or pipe still wakes the loop at once, so collectives are as fast; only a group's teardown,
# which waits for its loop's next ticks, takes longer, off the rank's path (groups.release).
TIMER_SLACK_NS = 40_000_000


def die_with_parent(parent: int, sig: int = signal.SIGKILL, orphaned=None) -> None:
    """Receive ``sig`` when ``parent`` exits, even by SIGKILL: no orphaned ranks. ``orphaned``: what
    to call instead when the parent is found gone another way (before prctl took effect, or by the
    polling fallback off Linux); by default the process exits."""
    orphaned = orphaned or (lambda: os._exit(1))
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # the parent died before prctl took effect
        orphaned()
    if not sys.platform.startswith("linux"):  # portable fallback: poll for re-parenting

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            while True:  # orphaned() may put itself off (the zygote while it forks)
                orphaned()
                time.sleep(0.5)

        threading.Thread(target=watch, name="harness-parent-watch", daemon=True).start()


def relax_timers(slack_ns: int = TIMER_SLACK_NS) -> None:
    """Let the kernel fold this thread's timed waits, and those of the threads it starts from now on
    (gloo's loops), into fewer wakeups (:data:`TIMER_SLACK_NS`). Linux only; elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, slack_ns)


class Zygote:
    """The process that forks a pool's ranks, hosts its rendezvous store and reports their exits on
    its stdout (the status pipe). ``spec``: the ranks' socket descriptors (``fds``), ``backend``,
    the pool directory (``tmp``), and descriptors the ranks must not keep (``close``)."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.live: dict[int, int] = {}  # pid -> rank, of the ranks not yet reaped
        self.forking = {"now": False, "leave": False}
        self.leaving = threading.Lock()

    def leave(self, *_) -> None:
        """End the pool, on SIGTERM (the parent's kill, or its death) or when the parent is found
        gone. The last process of the pool out removes its directory, whatever became of the
        parent meanwhile: the ranks are killed and reaped first, so that none still writes there."""
        if self.forking["now"]:  # a rank forked but not yet in ``live`` would be missed: after the forks
            self.forking["leave"] = True
            return
        if not self.leaving.acquire(blocking=False):
            return  # already on the way out (the signal and the status pipe can both say so)
        for pid in list(self.live):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in list(self.live):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        pooldir.remove(self.spec["tmp"])
        os._exit(1)

    def report(self, record: dict) -> None:
        try:
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()
        except OSError:  # nobody reads the status pipe any more: the parent is gone
            self.leave()

    def serve(self, forked=None) -> None:
        """Fork the ranks (torch imported, the preloads done), host the store, report every rank's
        exit until none is left; ``forked()`` is called once the ranks are forked."""
        import torch.distributed

        spec = self.spec
        me = os.getpid()
        pids: dict[int, int] = {}
        refresh_baseline()  # the run's own modules, imported since the keeper took it: once, not per rank
        self.forking["now"] = True
        for rank, fd in enumerate(spec["fds"]):
            pid = os.fork()
            if pid == 0:
                for other in [*spec["fds"], *spec.get("close", ())]:
                    if other != fd:
                        os.close(other)
                try:
                    rank_main(rank, fd, me, spec)
                except BaseException:  # noqa: BLE001  into its log (os._exit skips Python's own report)
                    traceback.print_exc()
                    sys.stderr.flush()
                    os._exit(1)
                os._exit(0)
            pids[rank] = pid
            self.live[pid] = rank
        self.forking["now"] = False
        if self.forking["leave"]:
            self.leave()
        for fd in spec["fds"]:
            os.close(fd)
        if forked is not None:
            forked()
        # The rendezvous store lives here, created after the forks (no server thread is ever forked),
        # on a port the OS picks, so parallel pools never collide. The parent relays the port.
        store = torch.distributed.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        self.report({"pids": pids, "port": store.port})
        while self.live:
            try:
                pid, raw = os.wait()
            except ChildProcessError:  # reaped by ``leave`` in another thread, which is ending the pool
                return
            rank = self.live.pop(pid, None)
            if rank is not None:
                self.report({"exit": rank, "code": os.waitstatus_to_exitcode(raw)})


# The baseline every rank holds its tasks to, taken in the keeper before it forks anything (about
# thirteen thousand dict copies: 0.1 to 0.5 s of CPU, which every rank of every pool paid before):
# each zygote and rank forked from it brings its copy up to date after its own imports and set-up
# (:meth:`Baseline.rebase`, which takes what moved and what is new, as a fresh take would).
_inherited: Baseline | None = None


def take_baseline() -> None:
    """In the process whose forks serve cells, once its imports are done: the baseline they inherit."""
    global _inherited
    _inherited = Baseline.take()


def refresh_baseline() -> None:
    """Bring the inherited baseline up to date with this process's imports, so that what it forks
    inherits it current (nothing to do where none was taken)."""
    if _inherited is not None:
        _inherited.rebase()


def current_baseline() -> Baseline:
    """This process's baseline as of now: the inherited one brought up to date, else one taken here."""
    if _inherited is None:
        return Baseline.take()
    refresh_baseline()
    return _inherited


def import_torch() -> None:
    """What every zygote imports before it forks: torch, its distributed package, one thread."""
    import torch  # noqa: F401  the expensive import, paid once for all ranks
    import torch.distributed  # noqa: F401
    from torch.distributed.device_mesh import DeviceMesh  # noqa: F401  preloaded for every rank

    torch.set_num_threads(1)  # before any op: no intra-op thread pool exists to be forked


def preload(modules) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001  a rank that needs it reports the error with the case
            pass


def warm_up() -> None:
    """Pay, once and before the fork, the lazy imports a rank's first case would otherwise pay.

    The first optimizer step imports ``torch._dynamo`` (about 1 s of CPU per rank here, 8 ranks
    on 2 cores): paid after the fork, it lands inside the first case's deadline on every rank.
    """
    import torch
    import torch.nn.functional as F

    w = torch.ones(2, 2, dtype=torch.float64, requires_grad=True)
    F.gelu(F.linear(w, w)).sum().backward()
    for optimizer in (torch.optim.SGD([w], lr=0.1, momentum=0.9), torch.optim.AdamW([w], foreach=False)):
        optimizer.step()


def _send(conn: Connection, message) -> None:
    from .wire import dumps  # torch: imported by then, not by this module's importers

    conn.send_bytes(dumps(message))


def seed_rank(seed: int, rank: int) -> None:
    """Private, deterministic global random state for this rank and task."""
    import torch

    from ..context import derive_seed

    value = derive_seed("rank-global", seed, rank)
    torch.manual_seed(value)
    random.seed(value)


def build_meshes(meshes: dict, wanted, backend: str) -> bool:
    """Build every mesh of ``wanted`` (each a :class:`harness.layout.MeshDeclaration`) that ``meshes``
    lacks, and cache what this rank holds of it by the declaration; True when it built one.

    Collective: every rank of the default process group must call it with the same ``wanted``, the
    ranks outside a (smaller) mesh included, because each DeviceMesh makes its groups with
    ``new_group`` over the whole world. Shared by the pool's ranks and by torchrun's ranks
    (harness.torchrun), so both build the same groups in the same order.
    """
    import torch.distributed as dist

    from .backend import device_type

    built = False
    for mesh in wanted:
        if mesh not in meshes:
            meshes[mesh] = mesh.build(device_type(backend), dist.get_world_size())
            built = True
    return built


def context(rank: int, layout, extra, meshes: dict, device, backend: str, scratch: str):
    """The :class:`harness.context.RankContext` of a task on ``layout`` (a :class:`MeshLayout`)
    with the ``extra`` declared meshes, from this rank's built meshes."""
    from ..context import RankContext

    return RankContext(rank, layout, meshes[layout], device, backend, scratch, {m: meshes[m] for m in extra})


def rank_main(rank: int, fd: int, zygote: int, spec: dict) -> None:
    # the zygote's handler is not the rank's: a SIGTERM ends a rank, and only the rank
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    log = os.open(os.path.join(spec["tmp"], f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    die_with_parent(zygote)
    relax_timers()
    stacks = open(os.path.join(spec["tmp"], f"rank{rank}.stack"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)

    import torch
    import torch.distributed as dist

    from ..world import World
    from .backend import rank_device
    from .groups import next_task, release, share_groups

    torch.set_num_threads(1)
    conn = Connection(fd)
    backend, pool_size = spec["backend"], len(spec["fds"])
    device = rank_device(backend, rank)
    _, port = pickle.loads(conn.recv_bytes())  # ("port", p): where the zygote's store listens
    store = dist.TCPStore("127.0.0.1", port, pool_size, is_master=False)
    world = World(rank, backend, store, device, "127.0.0.1", port, per_host=pool_size)
    share_groups()
    baseline = current_baseline()  # after the harness's own set-up: what every cell must find
    _send(conn, ("ready", rank))
    meshes: dict = {}  # mesh description -> DeviceMesh or Meshes, built by build_meshes
    functions: dict[str, object] = {}
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if message[0] == "stop":
            break
        _, task, path, payload, mesh, extra, seed, scratch, (size, generation), master_port = message
        left = None
        try:
            entered = world.enter(size, generation)
            if entered:
                release(meshes, backend)
            if rank >= size:
                _send(conn, ("idle", task, rank, None, None))
                continue
            with world.inside(size, master_port):
                next_task()
                if build_meshes(meshes, (mesh, *extra), backend) or entered:
                    baseline.rebase()  # what torch installs lazily as it makes groups is no cell's doing
                if rank >= mesh.world:
                    _send(conn, ("idle", task, rank, None, None))
                    continue
                before = Before.now()
                status, value = run_task(functions, path, payload, rank, mesh, extra, meshes, device, backend,
                                         scratch, seed, size)
            left = before.left(baseline, world)
        except BaseException as error:  # noqa: BLE001  every failure goes back to the parent, with its traceback
            status, value = raised(error, size)
        if not _reply(conn, (status, task, rank, value, left), size):
            break
    os._exit(0)


# threads a library starts once for the life of a process, on first use, and that compute nothing:
# tqdm's monitor (transformers' from_pretrained shows a progress bar)
LIFELONG_THREADS = frozenset({"tqdm_monitor"})


@dataclass
class Before:
    """What a rank holds just before a task's code runs, beyond its :class:`Baseline`: its Python
    threads and the process groups of its own (:func:`harness.pool.groups.own_groups`)."""

    threads: set[int]
    groups: int

    @classmethod
    def now(cls) -> Before:
        from .groups import own_groups

        return cls({t.ident for t in threading.enumerate()}, own_groups())

    def left(self, baseline: Baseline, world, put_back_code: bool = False) -> dict:
        """What the task left changed in this rank, for the parent: ``told`` (a line each, settings
        already put back; code too with ``put_back_code``), ``fit`` (False: replace the ranks before
        the next cell), ``world`` (True: its default group was destroyed or replaced, or groups of
        its own left: enter it anew)."""
        from .groups import own_groups

        changes = baseline.check(put_back_code)
        threads = [t.name for t in threading.enumerate()
                   if t.ident not in self.threads and t.is_alive() and t.name not in LIFELONG_THREADS]
        if threads:
            changes.lines.append(f"{len(threads)} thread(s) left running ({', '.join(sorted(threads)[:3])})")
            changes.fit = False
        return {"told": changes.lines, "fit": changes.fit,
                "world": world.disturbed() or own_groups() > self.groups}


def _reply(conn: Connection, reply: tuple, size: int) -> bool:
    """Send a task's reply; one that cannot be sent (a result that cannot be pickled) goes as a
    raised one instead. False when the parent is gone."""
    try:
        try:
            _send(conn, reply)
        except BaseException as error:  # noqa: BLE001  e.g. a result that cannot be pickled
            if reply[0] == "raised":
                raise
            _send(conn, ("raised", *reply[1:3], raised(error, size)[1], reply[4]))
    except (OSError, EOFError):
        return False
    return True


def raised(error: BaseException, size: int) -> tuple[str, str]:
    """The reply of a rank whose task raised ``error`` (called while handling it): ``("raised",
    text)``, the text :func:`harness.world.explained` gives, else the traceback."""
    from ..world import explained

    return "raised", explained(error, size) or traceback.format_exc()


def run_task(functions: dict, path: str, payload, rank: int, mesh, extra, meshes: dict, device, backend: str,
             scratch: str, seed: int, size: int, inside=None) -> tuple[str, object]:
    """The one rank-side body of a task, for the pool's ranks and torchrun's (its meshes built, in
    its world, ``inside``: a context manager entered around the call): ``fn(ctx, payload)`` with
    ``fn`` loaded once from ``path`` (cached in ``functions``), this rank's seed and ctx. The reply:
    ``("ok", value)``, or :func:`raised`'s ``("raised", text)``."""
    from ..paths import load

    try:
        if path not in functions:
            functions[path] = load(path)
        seed_rank(seed, rank)
        ctx = context(rank, mesh, extra, meshes, device, backend, scratch)
        with inside if inside is not None else contextlib.nullcontext():
            return "ok", functions[path](ctx, payload)
    except BaseException as error:  # noqa: BLE001  every failure goes back with its traceback
        return raised(error, size)
