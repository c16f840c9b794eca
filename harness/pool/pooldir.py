"""The pool's temporary directory (rank logs, stack dumps, task scratch) and its removal, however the
pool's processes die and in whatever order.

Every process of a pool holds a shared ``flock`` on the directory's lock file while it lives: the
parent through its own descriptor, the zygote through another that its ranks inherit when they are
forked. The kernel drops a dead process's hold, SIGKILL included, so a lock that can be taken
exclusively means that no process of that pool is alive, whatever its pid became (pid reuse) and in
whatever pid namespace it ran. The zygote removes the directory when it ends its pool, told by its
parent or on the parent's death, after it has killed and reaped its ranks: the last one out, so
nothing is written there meanwhile, whenever and however the parent died. When everything was
killed at once nobody is left to do it, so a new pool sweeps its temporary directory first:
:func:`sweep` removes the pool directories that nobody holds, never one a live process holds.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
import time

PREFIX = "harness-pool-"
LOCK = "owners.lock"
# A directory without its lock file is either one from a harness before this module (left alone: it
# cannot say whether its owner lives) or one whose creator died between making it and locking it,
# microseconds apart: its name carries the creator's pid, and it must be older than this.
UNLOCKED_GRACE = 60.0
_OWNER = re.compile(re.escape(PREFIX) + r"(\d+)-")


def create(root: str | None = None) -> tuple[str, int]:
    """A new pool directory under ``root`` (the temporary directory by default), held by this
    process: ``(path, descriptor of the hold)``. Close the descriptor once the directory is removed."""
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)
    return path, hold(path)


def hold(path: str) -> int:
    """Hold ``path`` for this process (and the children it forks, which share the descriptor):
    no sweep removes it while the hold lives. Returns the descriptor."""
    fd = os.open(os.path.join(path, LOCK), os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def remove(path: str, attempts: int = 5) -> None:
    """Remove ``path`` and everything in it. A rank killed a moment ago may still complete a file
    it was creating while the tree is being walked, so try again until it is gone."""
    for attempt in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return
        time.sleep(0.05 * (attempt + 1))


def sweep(root: str | None = None) -> list[str]:
    """Remove this user's pool directories under ``root`` that no live process holds; the paths removed."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        try:
            if (not entry.name.startswith(PREFIX) or not entry.is_dir(follow_symlinks=False)
                    or entry.stat(follow_symlinks=False).st_uid != os.getuid()):
                continue
        except OSError:  # removed meanwhile
            continue
        if _remove_if_abandoned(entry.path, entry.name):
            removed.append(entry.path)
    return removed


def _remove_if_abandoned(path: str, name: str) -> bool:
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        owner = _OWNER.match(name)
        if owner and not _alive(int(owner.group(1))) and _age(path) > UNLOCKED_GRACE:
            remove(path)
            return True
        return False
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a process of that pool lives: not ours to touch
            return False
        remove(path)  # under the lock: a second sweeper cannot take it meanwhile
        return True
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _age(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0
