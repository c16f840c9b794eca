"""A kept pool: a zygote that outlives one pytest run (opt-in: ``--keep-pool`` or
``PARITYTEST_KEEP_POOL=SECONDS``), so that the next run forks its ranks from a process that has
already imported torch and the selected third-party libraries.

The *keeper* is that zygote. It listens on a Unix socket in a directory only this user can enter
(``$XDG_RUNTIME_DIR/paritytest`` or ``<tmp>/paritytest-<uid>``, mode 0700), one per checkout,
environment (``sys.prefix``, the interpreter) and xdist worker (or one per scope that
``PARITYTEST_KEEP_POOL_SCOPE`` names, shared by the checkouts that name it). For each pool a run asks for, it
forks a *run zygote* which takes the request's rank sockets and status pipe (passed as file
descriptors), the run's working directory, environment and ``sys.path``, imports the project's own
modules, forks the ranks (a fresh process group and store per run) and ends with the client's
connection: a client that dies, however, takes its ranks with it.

Safe by construction:

* the keeper imports torch, the harness's own modules and third-party modules only, never the
  project's code (implementations, references, cases, conftests): those are imported after its
  fork, in each run, so an edit is always seen;
* the client sends a fingerprint of what the keeper's image depends on (where the harness package
  is and every file of it, the interpreter, ``sys.prefix`` and the installed distributions, through
  the mtimes of the site-packages directories and their ``.pth`` files); a keeper whose own differs
  exits, and the client starts a fresh one;
* it exits after ``idle`` seconds without a run, removing its socket, lock file and log, and when
  asked (``pytest --stop-pool``, ``python -m harness.pool stop``).

This module is the client's side (the request, ``status``, ``stop``, :class:`Remote`); the keeper
and the run zygotes it forks are :mod:`harness.pool.keeper`.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time

ENV = "PARITYTEST_KEEP_POOL"  # seconds a kept pool waits idle before it exits; unset, empty or 0: off
# a name that makes the kept pools of every checkout that gives it one (per environment and xdist worker):
# for many small projects run one after another (a test suite's), which would each start their own
SCOPE_ENV = "PARITYTEST_KEEP_POOL_SCOPE"
DEFAULT_IDLE = 900.0
MAX_FDS = 64
CONNECT_TIMEOUT = 300.0  # a keeper just started imports torch (and transformers) before it answers
_started: list[subprocess.Popen] = []  # keepers this process started (kept, so no ResourceWarning)


class KeptPoolError(RuntimeError):
    pass


def idle_from_env() -> float:
    """The idle timeout ``PARITYTEST_KEEP_POOL`` asks for (0: no kept pool)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise KeptPoolError(f"{ENV}={raw!r}: give the seconds a kept pool waits idle, e.g. {ENV}=900") from None
    return max(0.0, value)


# ---- where: one socket per checkout, environment and xdist worker, in a directory of this user ----
SOCKET_PATH_MAX = 100  # sun_path holds 108 bytes; a socket's name here is at most about 40


def runtime_dir(create: bool = True) -> str:
    """This user's directory for kept pools' sockets (mode 0700): under ``$XDG_RUNTIME_DIR``, else
    the temp directory, else ``/tmp``: the first whose sockets' paths fit in a Unix socket address."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    candidates = [os.path.join(base, "paritytest")] if base and os.path.isdir(base) else []
    candidates += [os.path.join(tempfile.gettempdir(), f"paritytest-{os.getuid()}"), f"/tmp/paritytest-{os.getuid()}"]
    path = next((c for c in candidates if len(c) + 48 <= SOCKET_PATH_MAX), candidates[-1])
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return path
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise KeptPoolError(f"{path} is not a directory of this user: remove it, or set XDG_RUNTIME_DIR")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def interpreter() -> str:
    """The interpreter, whichever name ran it: a venv's ``python`` and ``python3`` (pytest's script
    runs the one, ``python -m pytest`` often the other) are one environment, with one kept pool."""
    return os.path.realpath(sys.executable)


def checkout_key(root: str) -> str:
    """The name of ``root``'s kept pools: its checkout's, or the scope ``PARITYTEST_KEEP_POOL_SCOPE``
    names, in this environment. (The keeper imports no project's code, only torch, the harness and
    the third-party modules the runs ask for, so a scope shares those between its checkouts.)"""
    scope = os.environ.get(SCOPE_ENV, "").strip()
    where = f"scope:{scope}" if scope else os.path.realpath(root)
    text = "\0".join([where, sys.prefix, interpreter()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def address(root: str) -> str:
    return os.path.join(runtime_dir(), f"{checkout_key(root)}-{worker()}.sock")


# ---- what a keeper's image depends on ----------------------------------------------------------------
def _site_dirs() -> list[str]:
    import site

    dirs = set(getattr(site, "getsitepackages", lambda: [])())
    with contextlib.suppress(Exception):
        dirs.add(site.getusersitepackages())
    for key in ("purelib", "platlib"):
        dirs.add(sysconfig.get_paths()[key])
    return sorted(d for d in dirs if os.path.isdir(d))


def fingerprint() -> str:
    """Changes when the harness package moves or a file of it changes, or the interpreter or an
    installed distribution changes: what a keeper imported before it forks."""
    digest = hashlib.sha256()
    digest.update("\0".join([interpreter(), sys.prefix, sys.version]).encode())
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest.update(os.path.realpath(package).encode())  # a copy of the checkout is another image
    for dirpath, dirnames, filenames in os.walk(package):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                info = os.stat(os.path.join(dirpath, name))
                digest.update(f"{os.path.relpath(dirpath, package)}/{name}:{info.st_mtime_ns}:{info.st_size}\n".encode())
    for site_dir in _site_dirs():  # a distribution installed, upgraded or removed changes its directory
        digest.update(f"{site_dir}:{os.stat(site_dir).st_mtime_ns}\n".encode())
        with os.scandir(site_dir) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.name.endswith(".pth") or entry.name.startswith("__editable__"):
                    digest.update(f"{entry.name}:{entry.stat().st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


def split_preload(modules) -> tuple[list[str], list[str]]:
    """``(kept, per_run)``: the harness's own modules and the third-party modules the others
    import at their top level (found in their source, without importing them) may be imported in
    the keeper; the project's modules only after its fork, in each run."""
    import ast
    import importlib.util

    installed = [os.path.realpath(p) + os.sep for p in {*_site_dirs(), sysconfig.get_paths()["stdlib"],
                                                        sysconfig.get_paths()["platstdlib"]}]
    cache: dict[str, bool] = {}

    def third_party(name: str) -> bool:
        top = name.partition(".")[0]
        if top not in cache:
            try:
                spec = importlib.util.find_spec(top)
            except (ImportError, ValueError):
                spec = None
            origin = spec.origin if spec is not None else None
            where = origin if origin not in (None, "built-in", "frozen") else (
                next(iter(spec.submodule_search_locations or []), None) if spec else None)
            cache[top] = top != "harness" and where is not None and any(
                os.path.realpath(where).startswith(p) for p in installed)
            if spec is not None and origin in ("built-in", "frozen"):
                cache[top] = True
        return cache[top]

    kept, per_run = [], []
    for module in modules:
        if module == "harness" or module.startswith("harness."):
            kept.append(module)
            continue
        per_run.append(module)
        try:
            spec = importlib.util.find_spec(module)
            source = open(spec.origin).read() if spec and spec.origin and spec.origin.endswith(".py") else ""
            tree = ast.parse(source)
        except Exception:  # noqa: BLE001  a module that does not import is reported by the ranks
            continue
        for node in tree.body:
            bodies = [node] if not isinstance(node, ast.Try) else [*node.body]
            for inner in bodies:
                names = []
                if isinstance(inner, ast.Import):
                    names = [alias.name for alias in inner.names]
                elif isinstance(inner, ast.ImportFrom) and inner.level == 0 and inner.module:
                    names = [inner.module]
                kept += [n for n in names if third_party(n) and n not in kept]
    return kept, per_run


# ---- messages: a length, JSON, and file descriptors with the first bytes ------------------------------
def send(sock: socket.socket, message: dict, fds=()) -> None:
    data = json.dumps(message).encode()
    data = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def receive(sock: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, MAX_FDS)
    if len(data) < 4:
        data += _exactly(sock, 4 - len(data))
    size = struct.unpack("!I", data[:4])[0]
    body = data[4:]
    if len(body) < size:
        body += _exactly(sock, size - len(body))
    return json.loads(body), list(fds)


RECORD_MAX = 1 << 22  # a request holds the run's environment and sys.path: well under this


def send_record(sock: socket.socket, message: dict, fds=()) -> None:
    """One message as one record of a ``SOCK_SEQPACKET`` socket (a process's own keeper's channel),
    with its descriptors: records keep their bounds, so requests sent back to back stay apart."""
    socket.send_fds(sock, [json.dumps(message).encode()], list(fds))


def receive_record(sock: socket.socket) -> tuple[dict, list[int]]:
    """The next record of :func:`send_record`; EOFError when the other end is closed."""
    data, fds, _, _ = socket.recv_fds(sock, RECORD_MAX, MAX_FDS)
    if not data:
        for fd in fds:
            os.close(fd)
        raise EOFError("channel closed")
    return json.loads(data), list(fds)


def _exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError("connection closed")
        out += chunk
    return out


# ---- client ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(path: str):
    """An exclusive hold on ``path`` (the keeper removes the file when it exits: a hold on a file
    no longer at ``path`` is no hold, so take it again)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    return sock


def spawn_keeper(spec: dict, stderr, pass_fds=()) -> subprocess.Popen:
    """A keeper process (:func:`harness.pool.keeper.keeper_main`) with ``spec``, in a session of its
    own, seeing this process's ``sys.path``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-c", "from harness.pool.keeper import keeper_main; keeper_main()", json.dumps(spec)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True, env=env,
        cwd="/", pass_fds=pass_fds)


def _listening(keeper: subprocess.Popen, path: str, timeout: float = 60.0) -> socket.socket | None:
    """A connection to the keeper just started at ``path``; None when it exited or did not listen in
    time. It listens before it imports anything; its socket file exists from bind, a moment before it
    listens, and a connection in that moment is refused: wait for one that is taken."""
    end = time.monotonic() + timeout
    while (sock := _connect(path)) is None:
        if keeper.poll() is not None or time.monotonic() > end:
            return None
        time.sleep(0.01)
    return sock


def _connect_or_start(path: str, start) -> socket.socket:
    """A connection to the keeper at ``path``, or, when none listens there, to the one ``start()``
    starts (under the caller's hold on the path's lock)."""
    sock = _connect(path)
    if sock is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a keeper killed outright leaves its socket
        sock = start()
    return sock


def _start(path: str, idle: float, preload: list[str]) -> socket.socket:
    """Start a keeper at ``path`` and return a connection to it."""
    with open(path[:-len(".sock")] + ".log", "ab") as log:
        _started.append(spawn_keeper({"path": path, "idle": idle, "preload": preload}, log))
    sock = _listening(_started[-1], path)
    if sock is None:
        raise KeptPoolError(f"the kept pool did not start: see {path[:-len('.sock')]}.log")
    return sock


def request(root: str, idle: float, kept_preload: list[str], message: dict, fds) -> tuple[socket.socket, dict]:
    """Send a run's request (and its descriptors) to the keeper of ``root``, starting one when there
    is none or when the one there is stale. Returns the connection, which the run zygote holds: it
    ends its ranks when this side closes it, and the keeper's reply (``pid``: the run zygote)."""
    path = address(root)
    message = dict(message, op="run", fingerprint=fingerprint(), preload_kept=kept_preload, idle=idle)
    for _ in range(3):
        with _locked(path[:-len(".sock")] + ".lock"):
            sock = _connect_or_start(path, lambda: _start(path, idle, kept_preload))
            sock.settimeout(CONNECT_TIMEOUT)
            try:
                send(sock, message, fds)
                reply, _ = receive(sock)
            except (OSError, EOFError):  # it exited meanwhile (idle, stale): start another
                sock.close()
                continue
            if reply.get("stale"):
                sock.close()
                continue
            sock.settimeout(None)
            return sock, reply
    raise KeptPoolError(f"the kept pool at {path} did not take the run")


def status(root: str, of_worker: str | None = None) -> dict | None:
    """What this checkout's keeper of an xdist worker (this process's by default) says of itself:
    ``pid``, ``runs`` (pools forked), ``live`` (run zygotes alive), ``idle``, ``fingerprint``; None
    when there is none."""
    path = os.path.join(runtime_dir(create=False), f"{checkout_key(root)}-{of_worker or worker()}.sock")
    sock = _connect(path) if os.path.exists(path) else None
    if sock is None:
        return None
    sock.settimeout(CONNECT_TIMEOUT)
    try:
        send(sock, {"op": "status"})
        return receive(sock)[0]
    except (OSError, EOFError):
        return None
    finally:
        sock.close()


def statuses(root: str) -> dict[str, dict]:
    """:func:`status` of each of the checkout's keepers, by xdist worker (``main``: a run without
    xdist): ``pytest -n 2 --keep-pool`` leaves one per worker."""
    prefix = checkout_key(root) + "-"
    workers = [name[len(prefix):-len(".sock")] for name in _sockets(prefix)]
    return {w: said for w in workers if (said := status(root, w)) is not None}


def _sockets(prefix: str) -> list[str]:
    """The names of the kept pools' sockets in this user's runtime directory that start with
    ``prefix`` (not the xdist runs' keepers: they are their runs', not kept)."""
    directory = runtime_dir(create=False)
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    return [name for name in names if name.endswith(".sock") and name.startswith(prefix)
            and not name.startswith(RUN_PREFIX)]


def stop(root: str | None = None, all_workers: bool = True) -> list[str]:
    """Stop the kept pools of ``root`` (every xdist worker's), or every kept pool of this user
    (``root`` None). Returns the sockets of those that answered."""
    directory = runtime_dir(create=False)
    if not os.path.isdir(directory):
        return []
    stopped = []
    for name in _sockets(checkout_key(root) + "-" if root else ""):
        path = os.path.join(directory, name)
        sock = _connect(path)
        if sock is None:
            continue
        sock.settimeout(30)
        with contextlib.suppress(OSError, EOFError):
            send(sock, {"op": "stop"})
            receive(sock)
            stopped.append(path)
        sock.close()
        end = time.monotonic() + 10
        while os.path.exists(path) and time.monotonic() < end:
            time.sleep(0.02)
    with contextlib.suppress(OSError):
        os.rmdir(directory)  # only when empty
    return stopped


class Remote:
    """A run zygote forked by a keeper, as :class:`harness.pool.parent.Pool` uses a process:
    ``pid``, ``stdout`` (the status pipe), ``poll``, ``wait``, ``terminate`` and ``kill_group`` (it is
    gone once its end of the connection is closed). ``pid`` None: the keeper's reply, which names
    it, is read on first need, so that asking does not wait for the keeper's imports."""

    def __init__(self, pid: int | None, sock: socket.socket, status_fd: int):
        self._pid, self.sock = pid, sock
        self.stdout = os.fdopen(status_fd, "rb", buffering=0)
        self.returncode: int | None = None

    @property
    def pid(self) -> int | None:
        """The run zygote's pid; None when the keeper ended before it answered."""
        if self._pid is None and self.returncode is None:
            self.sock.settimeout(CONNECT_TIMEOUT)
            try:
                self._pid = int(receive(self.sock)[0]["pid"])
            except (OSError, EOFError, ValueError, KeyError, struct.error):
                self.returncode = -1
            finally:
                with contextlib.suppress(OSError):
                    self.sock.settimeout(None)
        return self._pid

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.sock], [], [], 0)[0]:
            if self._pid is None:  # the reply first: unread, it would hide the end of the connection
                self.pid
                if self.returncode is not None or not select.select([self.sock], [], [], 0)[0]:
                    return self.returncode
            try:
                gone = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired("kept pool run zygote", timeout)
            select.select([self.sock], [], [], min(0.5, left) if left is not None else 0.5)
        return self.returncode

    def terminate(self) -> None:
        """SIGTERM: the run zygote ends its ranks and removes the pool's directory."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def kill_group(self) -> None:
        """SIGKILL to the run zygote and its ranks at once (one process group)."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def close(self) -> None:
        self.stdout.close()
        self.sock.close()


class ForkServer:
    """This process's own keeper, for the pools that are not kept: the cells' pool, the pool of one
    beside it and every pool started again after a hang fork their run zygotes from one process
    that imported torch and the third-party modules once, instead of each importing them anew
    (seconds of CPU each, on every pytest process). Started on first use, it is reached through a
    socket pair, not a path: nothing on disk, nobody else can connect, and it ends when this
    process closes its end or dies, however."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._log = None  # the keeper's stderr: an unnamed temporary file
        self._own = ""

    def request(self, kept_preload: list[str], message: dict, fds) -> socket.socket:
        """Send a run's request (and its descriptors) without waiting for the keeper's imports: the
        run's connection, which the run zygote holds, with the reply (its pid) still to be read
        (:class:`Remote`). A keeper found gone is started again."""
        for _ in range(2):
            if self._proc is None or self._proc.poll() is not None:
                self._start(kept_preload)
            ours, theirs = socket.socketpair()
            try:
                send_record(self._control, dict(message, op="run", fingerprint=self._own, preload_kept=kept_preload,
                                                idle=None), [*fds, theirs.fileno()])
            except OSError:
                ours.close()
                self.close()
                continue
            finally:
                theirs.close()
            return ours
        raise KeptPoolError(f"this process's keeper did not take the run: {self.log()}")

    def _start(self, preload: list[str]) -> None:
        """A new keeper, importing ``preload`` before it serves."""
        self.close()
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._own = fingerprint()
        self._log = tempfile.TemporaryFile()
        spec = {"control": theirs.fileno(), "idle": None, "preload": preload, "parent": os.getpid(), "own": self._own}
        try:
            self._proc = spawn_keeper(spec, self._log, pass_fds=[theirs.fileno()])
        finally:
            theirs.close()

    def log(self) -> str:
        """The last lines the keeper wrote."""
        if self._log is None:
            return "(no keeper)"
        self._log.seek(0)
        return "\n".join(self._log.read().decode(errors="replace").splitlines()[-20:]) or "(its log is empty)"

    def close(self, grace: float = 10.0) -> None:
        """End the keeper (it ends its run zygotes and their ranks) and wait for it."""
        if self._control is not None:
            self._control.close()  # its end of the channel: the keeper stops
            self._control = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


RUN_PREFIX = "run-"  # the socket of an xdist run's keeper: run-<key>.sock


class RunKeeperClient:
    """The keeper an xdist run's workers share (:class:`harness.pool.keeper.RunKeeper`), for their
    pools that are not kept: on two workers, one import of torch and the third-party modules where
    each worker's own :class:`ForkServer` made two. The first worker to need it starts it; its
    socket's name holds the run's id, the environment, the import path and the fingerprint of the
    harness, so a worker whose differ (an edit between two workers' first cells) starts its own.
    Its life is its starter's and then its run zygotes' (it retires when its starter ends): nothing
    of it outlives the run."""

    def __init__(self, run: str):
        self.run = run
        self._own = ""
        self._proc: subprocess.Popen | None = None  # the keeper this worker started, if it did
        self._log = None  # its stderr

    def path(self) -> str:
        if not self._own:
            self._own = fingerprint()  # once, as a process's own keeper's: a later edit does not split the run
        text = "\0".join([self.run, sys.prefix, interpreter(), self._own, *(p for p in sys.path if p)])
        return os.path.join(runtime_dir(), f"{RUN_PREFIX}{hashlib.sha256(text.encode()).hexdigest()[:16]}.sock")

    def request(self, kept_preload: list[str], message: dict, fds) -> socket.socket:
        """As :meth:`ForkServer.request`: the run's connection, the reply (the run zygote's pid) still
        to be read, so the keeper's imports overlap the caller's work."""
        path = self.path()
        message = dict(message, op="run", fingerprint=self._own, preload_kept=kept_preload, idle=None)
        for _ in range(3):
            with _locked(path[:-len(".sock")] + ".lock"):
                sock = _connect_or_start(path, lambda: self._start(path, kept_preload))
                try:
                    send(sock, message, fds)
                except OSError:  # it retired meanwhile: start another
                    sock.close()
                    continue
            return sock
        raise KeptPoolError(f"the xdist run's keeper at {path} did not take the run")

    def _start(self, path: str, preload: list[str]) -> socket.socket:
        if self._log is not None:
            self._log.close()
        self._log = tempfile.TemporaryFile()
        self._proc = spawn_keeper({"path": path, "preload": preload, "parent": os.getpid(), "own": self._own},
                                  self._log)
        sock = _listening(self._proc, path)
        if sock is None:
            raise KeptPoolError(f"the xdist run's keeper did not start: {self.log()}")
        return sock

    def close(self, grace: float = 30.0) -> None:
        """At this worker's exit, after its pools have closed: the keeper it started retires, as on
        its death, and is waited for, so that its CPU and its pools' count as this process's
        children's (``times``, ``/usr/bin/time``: CI's step figures) rather than being reparented
        uncounted. It ends once the other workers' pools have: within the run."""
        if self._proc is None or self._proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._proc.pid, signal.SIGHUP)
        with contextlib.suppress(subprocess.TimeoutExpired):  # else it ends with the last run it serves
            self._proc.wait(timeout=grace)

    def log(self) -> str:
        """The last lines the keeper wrote, if this worker started it."""
        if self._log is None:
            return "(started by another xdist worker: its log is that worker's)"
        self._log.seek(0)
        return "\n".join(self._log.read().decode(errors="replace").splitlines()[-20:]) or "(its log is empty)"


_fork_server: ForkServer | None = None
_run_keeper: RunKeeperClient | None = None


def fork_server() -> ForkServer:
    """This process's :class:`ForkServer`, made on first use and closed at exit."""
    global _fork_server
    if _fork_server is None:
        import atexit

        _fork_server = ForkServer()
        atexit.register(_fork_server.close)
    return _fork_server


def own_keeper() -> ForkServer | RunKeeperClient:
    """The keeper this process's pools that are not kept fork from: its xdist run's
    (:func:`share_with_run`), else its own :func:`fork_server`."""
    return _run_keeper or fork_server()


def share_with_run(run: str) -> None:
    """Make this xdist worker's pools fork from the keeper of its run (``testrunuid``), shared with
    the run's other workers (:class:`RunKeeperClient`)."""
    global _run_keeper
    import atexit

    _run_keeper = RunKeeperClient(run)
    atexit.register(_run_keeper.close)  # before any pool's: run after every pool has closed
