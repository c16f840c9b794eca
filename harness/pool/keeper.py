"""The keeper of a kept pool (:mod:`harness.pool.kept`, the client, describes it): the zygote that
outlives one pytest run, listening on its Unix socket, and each run's zygote it forks.

Started by the client as ``python -c "from harness.pool.keeper import keeper_main; keeper_main()"``
with its spec (``path``, ``idle``, ``preload``) as JSON in ``argv[1]``; a process's own keeper
(:class:`harness.pool.kept.ForkServer`, :class:`OwnKeeper`) with ``control`` (its end of the
channel, a descriptor), ``parent`` and ``own`` (its fingerprint, the parent's) instead of ``path``;
the keeper of an xdist run's workers (:class:`harness.pool.kept.RunKeeperClient`, :class:`RunKeeper`)
with ``path``, ``parent`` and ``own``.
"""
from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import select
import signal
import socket
import sys
import tempfile
import time

from .kept import fingerprint, receive, receive_record, send


def keeper_main() -> None:
    spec = json.loads(sys.argv[1])
    if "control" in spec:
        keeper = OwnKeeper(spec["control"], spec["own"])
    elif "own" in spec:
        keeper = RunKeeper(spec["path"], spec["own"])
    else:
        keeper = Keeper(spec["path"], float(spec["idle"]))
    signal.signal(signal.SIGTERM, keeper.stop_all)
    signal.signal(signal.SIGINT, keeper.stop_all)
    from .rank import die_with_parent, import_torch, preload, take_baseline, warm_up

    if isinstance(keeper, RunKeeper):  # its starter's end is not the end of the others' runs
        signal.signal(signal.SIGHUP, keeper.retire)
        die_with_parent(spec["parent"], signal.SIGHUP, keeper.retire)
    elif "parent" in spec:
        die_with_parent(spec["parent"], signal.SIGTERM, keeper.stop_all)

    import_torch()
    preload(spec["preload"])
    warm_up()
    take_baseline()
    # what it imported lives as long as it does: no full collection in the keeper, nor in the
    # zygotes and ranks forked from it, need scan it again (and its pages stay shared with theirs)
    gc.freeze()
    keeper.serve()


class Keeper:
    """The keeper's state: its socket (and whether the file at its path is still its own), its
    live run zygotes, its idle clock."""

    def __init__(self, path: str, idle: float, own: str | None = None):
        self.path, self.idle = path, idle
        # before any import: an edit made while importing makes it stale, not wrong
        self.own = own if own is not None else fingerprint()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.listener.bind(path)
        finally:
            os.umask(old)
        self.listener.listen(64)
        self.inode = os.stat(path).st_ino
        self.base = path[:-len(".sock")]
        self._start_counting()

    def _start_counting(self) -> None:
        """No run zygote yet, the idle clock at zero."""
        self.children: set[int] = set()
        self.runs = 0
        self.last = time.monotonic()

    def ours(self) -> bool:
        try:
            return os.stat(self.path).st_ino == self.inode
        except FileNotFoundError:
            return False

    def finish(self, code: int = 0, lock: bool = True) -> None:
        self.listener.close()
        if self.ours():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            if lock:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.base + ".lock")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.base + ".log")
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.path))  # only when empty
        os._exit(code)

    def stop_all(self, *_) -> None:
        for pid in list(self.children):  # each ends its ranks and removes its pool directory
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.finish()

    def serve(self) -> None:
        """Until idle, stopped or stale: reap run zygotes, take each connection's request."""
        self.last = time.monotonic()
        while True:
            self._reap()
            if not select.select([self.listener], [], [], 1.0)[0]:
                if (not self.children and time.monotonic() - self.last > self.idle
                        and _idle_exit(self.base, self.listener)):
                    self.finish(lock=False)
                continue
            self._take()

    def _take(self) -> None:
        """Accept one connection and answer its request (one that breaks off is dropped)."""
        conn, _ = self.listener.accept()
        conn.settimeout(30)
        try:
            message, fds = receive(conn)
        except (OSError, EOFError, ValueError):
            conn.close()
            return
        self._answer(conn, message, fds)

    def _reap(self) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError):
                done, _ = os.waitpid(pid, os.WNOHANG)
                if not done:
                    continue
            self.children.discard(pid)
            self.last = time.monotonic()
        if self.children:
            self.last = time.monotonic()

    def _requests(self) -> socket.socket:
        """The socket requests come on (closed in each run zygote)."""
        return self.listener

    def _answer(self, conn: socket.socket, message: dict, fds: list[int]) -> None:
        """One request: ``status``, ``stop``, or a run (refused as stale by a keeper whose
        fingerprint differs from the client's, which then exits)."""
        if message.get("op") == "status":
            with contextlib.suppress(OSError):
                send(conn, {"pid": os.getpid(), "runs": self.runs, "live": sorted(self.children),
                            "idle": self.idle, "fingerprint": self.own})
            conn.close()
            return
        if message.get("op") == "stop":
            with contextlib.suppress(OSError):
                send(conn, {"stopped": True})
            conn.close()
            self.stop_all()
        if self._stale_for(message):
            with contextlib.suppress(FileNotFoundError):
                if self.ours():
                    os.unlink(self.path)  # the client starts the next keeper at this path
            with contextlib.suppress(OSError):
                send(conn, {"stale": True})
            for fd in fds:
                os.close(fd)
            conn.close()
            self.finish(lock=False)
        self._fork_run(conn, message, fds)

    def _stale_for(self, message: dict) -> bool:
        """Whether this keeper's image is not what the run would import: the harness or the installed
        packages changed (the fingerprint), or a module it holds (or is asked to preload) is found
        elsewhere on the run's ``sys.path`` (a patched copy of a library put first on PYTHONPATH).
        Checked again once the modules asked for are imported: they import others from this keeper's
        path (a harness module imports Megatron-Core, jinja2 imports markupsafe), which no name in
        the request says."""
        from .rank import preload

        path, wanted = message.get("path", []), message.get("preload_kept", ())
        if message.get("fingerprint") != self.own or shadowed(path, wanted) is not None:
            return True
        preload(wanted)
        return shadowed(path) is not None

    def _fork_run(self, conn: socket.socket, message: dict, fds: list[int]) -> None:
        from .rank import preload, refresh_baseline

        if message.get("idle") is not None:
            self.idle = float(message["idle"])
        preload(message.get("preload_kept", ()))  # third-party, kept for the next runs too
        refresh_baseline()  # and taken in here once, not by every run's zygote
        pid = os.fork()
        if pid == 0:
            self._requests().close()
            try:
                run_zygote(conn, message, fds)
            finally:
                os._exit(1)
        self.children.add(pid)
        self.runs += 1
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            send(conn, {"pid": pid})
        conn.close()
        self.last = time.monotonic()


def shadowed(path: list[str], wanted=()) -> str | None:
    """The first top-level module this process holds from a file, or of ``wanted`` (to be imported),
    that ``path`` (a run's ``sys.path``) would import from another file; None when there is none.
    Found as an import would find it: every finder of ``sys.meta_path`` (setuptools' distutils shim,
    editable installs), not the path alone."""
    held = {name: _location(module) for name, module in list(sys.modules.items()) if "." not in name}
    names = [n for n in dict.fromkeys([*held, *(w.partition(".")[0] for w in wanted)])
             if n not in sys.builtin_module_names]
    mine = {n: held.get(n) for n in names}
    missing = [n for n in names if n not in held]
    mine.update(zip(missing, _origins(missing, sys.path)))
    for name, theirs in zip(names, _origins(names, path)):
        # files or a namespace's directories, not built-in or frozen; one removed since it was imported
        # still counts (a keeper holding a deleted copy of a package would import the rest of it from nowhere)
        found = [f for f in (mine[name], theirs) if f and os.path.isabs(f)]
        if len(found) == 2 and _real(theirs) != _real(mine[name]):
            return name
    return None


def _location(module) -> str | None:
    """Where a module was imported from: its file, or a namespace package's directories (a copy
    of one put first on the path adds a directory before the installed one)."""
    file = getattr(module, "__file__", None)
    if file:
        return file
    portions = getattr(module, "__path__", None)
    return os.pathsep.join(portions) if portions is not None else None


def _real(location: str) -> str:
    return os.pathsep.join(os.path.realpath(p) for p in location.split(os.pathsep))


def _origins(names: list[str], path: list[str]) -> list[str | None]:
    """The file each top-level module of ``names`` would be imported from with ``path`` as ``sys.path``."""
    saved = sys.path[:]
    sys.path[:] = path
    try:
        return [_origin(name) for name in names]
    finally:
        sys.path[:] = saved


def _origin(name: str) -> str | None:
    for finder in sys.meta_path:
        try:
            spec = finder.find_spec(name, None)
        except Exception:  # noqa: BLE001  a finder that cannot answer is no answer
            continue
        if spec is not None:
            namespace = spec.origin in (None, "namespace") and spec.submodule_search_locations is not None
            return os.pathsep.join(spec.submodule_search_locations) if namespace else spec.origin
    return None


class OwnKeeper(Keeper):
    """A process's own keeper (:class:`harness.pool.kept.ForkServer`): requests come as records on
    its end of a socket pair, each with the run's connection among its descriptors; it serves until
    that channel closes (its process is done with it, or died), never ends for idleness, and has no
    file of its own."""

    def __init__(self, control: int, own: str):
        self.control = socket.socket(fileno=control)
        self.own, self.idle = own, None
        self._start_counting()

    def _requests(self) -> socket.socket:
        return self.control

    def _stale_for(self, message: dict) -> bool:
        return message.get("fingerprint") != self.own  # its process's own path, which it was started with

    def finish(self, code: int = 0, lock: bool = True) -> None:
        from . import pooldir

        self.control.close()
        # the last one out: its process may have died between making a pool's directory and handing it
        # to a run zygote, which would have removed it; nobody else is left to
        pooldir.sweep()
        os._exit(code)

    def serve(self) -> None:
        while True:
            self._reap()
            if not select.select([self.control], [], [], 1.0)[0]:
                continue
            try:
                message, fds = receive_record(self.control)
            except (OSError, EOFError, ValueError):
                self.stop_all()  # its process closed the channel, or is gone
            *fds, conn = fds
            self._answer(socket.socket(fileno=conn), message, fds)


class RunKeeper(Keeper):
    """The keeper the xdist workers of one run share (:class:`harness.pool.kept.RunKeeperClient`):
    one import of torch and the third-party modules for all of them, not one a worker. The worker
    that needed it first started it; the others find it at a path named by the run, the environment
    and ``own``, the fingerprint of what it imports, so it is never stale for a request that reaches
    it. When its starter ends (SIGHUP, the parent-death signal) it retires: it stops listening at
    once (a later request starts another) and exits when the run zygotes it forked have ended, each
    with its client's connection: it outlives no run."""

    def __init__(self, path: str, own: str):
        super().__init__(path, idle=float("inf"), own=own)
        self.retiring = False
        self._wake, self._woken = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)[::-1]  # retire() wakes serve()'s wait

    def _stale_for(self, message: dict) -> bool:
        return message.get("fingerprint") != self.own

    def retire(self, *_) -> None:
        self.retiring = True  # acted on by serve(), between requests
        with contextlib.suppress(OSError):
            os.write(self._wake, b"x")

    def serve(self) -> None:
        self.last = time.monotonic()
        while not self.retiring:
            self._reap()
            if self.listener in select.select([self.listener, self._woken], [], [], 1.0)[0] and not self.retiring:
                self._take()
        self._leave()

    def _leave(self) -> None:
        """Stop listening (socket and lock file removed under the lock, so no client is starting a
        keeper at the path meanwhile, and one waiting on the lock takes it again), take the requests
        already queued, wait for the run zygotes, exit."""
        lock = self.base + ".lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if self.ours():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                with contextlib.suppress(FileNotFoundError):
                    if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                        os.unlink(lock)
        finally:
            os.close(fd)  # before any fork: a run zygote holding it would hold the lock
        while select.select([self.listener], [], [], 0)[0]:  # connected before the unlink
            self._take()
        self.listener.close()
        while self.children:  # its only children: each ends with its client's connection
            try:
                self.children.discard(os.waitpid(-1, 0)[0])
            except ChildProcessError:
                break
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.path))  # only when empty
        os._exit(0)


def _idle_exit(base: str, listener: socket.socket) -> bool:
    """May the keeper exit now? Not while a client is starting or connecting (it holds the lock)."""
    try:
        fd = os.open(base + ".lock", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return not select.select([listener], [], [], 0)[0]
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if select.select([listener], [], [], 0)[0]:
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(base + ".lock")  # under the lock: a waiting client sees it gone and takes it again
        return True
    finally:
        os.close(fd)


def run_zygote(conn: socket.socket, message: dict, fds: list[int]) -> None:
    """One run's zygote, forked by the keeper: the run's descriptors, directory, environment and
    import path, the project's modules imported fresh, then the ranks forked as a pool's zygote
    forks them. It ends (ranks killed, pool directory removed) when the client's connection ends."""
    from . import pooldir
    from .rank import Zygote, preload

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    os.setpgid(0, 0)  # its ranks and itself: one group the client can kill outright
    *rank_fds, status = fds
    os.dup2(status, 1)
    os.close(status)
    log = os.open(os.path.join(message["tmp"], "zygote.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout = os.fdopen(1, "w", closefd=False)
    sys.stderr = os.fdopen(2, "w", closefd=False)
    os.chdir(message["cwd"])
    os.environ.clear()
    os.environ.update(message["env"])
    tempfile.tempdir = None  # the keeper's (the first client's TMPDIR, maybe gone): the run's, from its env
    sys.path[:] = message["path"]
    spec = {"fds": rank_fds, "backend": message["backend"], "tmp": message["tmp"], "close": [conn.fileno()]}
    pooldir.hold(spec["tmp"])
    zygote = Zygote(spec)
    signal.signal(signal.SIGTERM, zygote.leave)
    preload(message.get("preload", ()))  # the project's own modules: fresh in every run

    def watch() -> None:
        import threading

        def wait_for_eof() -> None:
            while True:
                try:
                    if not conn.recv(4096):
                        break
                except InterruptedError:
                    continue
                except OSError:
                    break
            zygote.leave()

        threading.Thread(target=wait_for_eof, name="harness-client-watch", daemon=True).start()

    conn.settimeout(None)
    zygote.serve(forked=watch)
    # every rank is gone (the client's end closed their sockets): end as on the client's EOF, which
    # the watch thread may be handling now (it exits the process; wait for it)
    zygote.leave()
    while True:
        time.sleep(1)
