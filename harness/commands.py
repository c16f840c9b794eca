"""The commands the harness prints for a user to paste: a failing cell's ``reproduce:`` line, bisect's
and exploration's. Each names this interpreter as the user would type it where the command runs
(relative to that directory when it lies under it, so a project's ``.venv/bin/python`` stays short),
and a path as typed from here."""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path


def shown(path: Path | str, where: Path | None = None) -> str:
    """``path`` as typed in ``where`` (default: here): relative when it lies under it. Its directories
    are compared as they really are, the file itself as named (a venv's ``python`` is a link out of
    the project)."""
    path = Path(os.path.abspath(path))
    path = Path(os.path.realpath(path.parent)) / path.name
    where = Path(os.path.realpath(where or Path.cwd()))
    try:
        return os.path.relpath(path, where) if path.is_relative_to(where) else str(path)
    except ValueError:  # another drive
        return str(path)


def python(where: Path | None = None) -> str:
    """This interpreter, quoted, as typed in ``where`` (default: here)."""
    return shlex.quote(shown(sys.executable, where))


def rerun_command(root: Path | str, nodeid: str) -> str:
    """The command that reruns one test exactly: this interpreter, from ``root`` (pytest's rootdir;
    ``cd`` there first when it is not here), by node id."""
    root, here = Path(root).resolve(), Path.cwd().resolve()
    command = f"{python(root)} -m pytest {shlex.quote(nodeid)}"
    return command if root == here else f"cd {shlex.quote(str(root))} && {command}"


def harness_command(module: str, *args: str) -> str:
    """``<python> -m harness.<module> <args>``, typed here."""
    return " ".join([python(), "-m", f"harness.{module}", *map(shlex.quote, args)])
