"""``python -m harness.golden diff [BASE_REV]`` and ``python -m harness.golden check``.

diff: golden files added, removed and changed between ``BASE_REV`` (default: the merge base of
HEAD with the change's base branch, :func:`base_branches`) and the working tree; per changed tensor its largest absolute and relative change,
whether it is bit-identical, and whether the change is within the tolerance policy (the cell's
dtype and the reduction size its component declares for that tensor). Markdown, so the PR summary
shows it; informational, exit 0 (exit 2 when git cannot answer).

check: every golden file loads and belongs to a cell that the cases collect, and every cell that
runs here has one (orphans and gaps listed, one per line); exit 1 on any problem.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..commands import rerun_command
from ..config import Config, ConfigError
from .store import GoldenError, golden_path, read_golden, update_command

if TYPE_CHECKING:
    import torch

SUFFIX = ".safetensors"


class GitError(Exception):
    pass


def _git(root: Path, *args: str, given: bytes | None = None) -> bytes:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], input=given, capture_output=True)
    except FileNotFoundError:
        raise GitError("git is not installed (diff compares golden files with a git revision): install git") from None
    if done.returncode:
        raise GitError(f"git {' '.join(args)}: {done.stderr.decode().strip()}")
    return done.stdout


def repo_root(start: Path) -> Path:
    """The root of the git repository that holds ``start``; outside one, a one-line error naming the fix."""
    try:
        return Path(_git(start, "rev-parse", "--show-toplevel").decode().strip())
    except GitError as error:
        if "not a git repository" not in str(error):
            raise
        raise GitError(f"{start} is not in a git repository, and diff compares golden files with a git revision: "
                       "run it from inside the checkout whose golden/ you changed") from None


def base_branches(root: Path) -> list[str]:
    """Where a change's base may be, in order: the pull request's base branch (``GITHUB_BASE_REF``, in
    GitHub Actions), the remote's default branch (``origin/HEAD``), then main and master, local or
    the remote's (a CI checkout has only the remote's)."""
    found = []
    if os.environ.get("GITHUB_BASE_REF"):
        found += [f"origin/{os.environ['GITHUB_BASE_REF']}", os.environ["GITHUB_BASE_REF"]]
    try:
        found.append(_git(root, "symbolic-ref", "--short", "refs/remotes/origin/HEAD").decode().strip())
    except GitError:
        pass  # a clone without its remote's HEAD (a shallow CI fetch) or no remote
    return list(dict.fromkeys(found + ["main", "origin/main", "master", "origin/master"]))


def merge_base(root: Path) -> str:
    """The merge base of HEAD with the first of :func:`base_branches` that exists."""
    tried = base_branches(root)
    for branch in tried:
        try:
            return _git(root, "merge-base", "HEAD", branch).decode().strip()
        except GitError:
            continue
    raise GitError(f"no merge base with {', '.join(tried)}; name the base revision: "
                   "python -m harness.golden diff <rev>")


def _load(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


@dataclass
class TensorChange:
    name: str
    change: str  # changed, added, removed, shape, dtype
    max_abs: float = 0.0
    max_rel: float = 0.0
    bit_identical: bool = False
    within_tolerance: bool | None = None  # None: no policy known for this file (unknown component)


@dataclass
class FileChange:
    path: str  # relative to the repository root
    status: str  # added, removed, changed
    tensors: list[TensorChange] = field(default_factory=list)
    note: str = ""

    @property
    def largest(self) -> float:
        return max((t.max_abs for t in self.tensors), default=0.0)


def _tolerances(stem: str):
    """The tolerance policy of the cell a golden file belongs to (the cell's own: its reference and
    its one-process run are computed here), or None if it cannot be known."""
    from ..resolve import resolve

    try:
        return resolve(Config.parse(stem)).tolerances()
    except Exception:  # noqa: BLE001  an unparsable id or unknown component: say "unknown", not crash
        return None


def compare_tensors(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], stem: str) -> list[TensorChange]:
    """Every tensor that differs between two versions of one golden file, largest change first."""
    import torch

    from ..compare.diff import compare

    tol = _tolerances(stem)
    out = []
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            out.append(TensorChange(name, "added" if name in new else "removed"))
            continue
        a, b = new[name], old[name]
        if a.shape != b.shape:
            out.append(TensorChange(name, "shape", within_tolerance=False))
            continue
        if a.dtype == b.dtype and torch.equal(a, b):
            continue
        diff = (a.double() - b.double()).abs()
        rel = diff / b.double().abs()
        rel = torch.where(diff == 0, torch.zeros_like(rel), rel)
        within = None if tol is None else compare({name: a}, {name: b}, tol).ok
        out.append(TensorChange(name, "dtype" if a.dtype != b.dtype else "changed",
                                float(diff.max()) if diff.numel() else 0.0,
                                float(rel.max()) if rel.numel() else 0.0, bit_identical=False,
                                within_tolerance=within))
    return sorted(out, key=lambda t: -t.max_abs)


def diff(root: Path, base: str, golden: str = "golden") -> list[FileChange]:
    """Golden files added, removed and changed between ``base`` and the working tree."""
    before = blob_ids(root, base, golden)
    now = {str(p.relative_to(root)) for p in (root / golden).rglob(f"*{SUFFIX}")}
    # the working tree's bytes hashed as git hashes a blob, all in one process: a file whose id is
    # the base's is byte for byte the base's, and only the others are read from git and compared
    both = sorted(now & before.keys())
    ids = _git(root, "hash-object", "--no-filters", "--stdin-paths", given="".join(f"{p}\n" for p in both).encode())
    same = {path for path, id_ in zip(both, ids.decode().split()) if before[path] == id_}
    changes = []
    for path in sorted(before.keys() | now):
        stem = Path(path).name[: -len(SUFFIX)]
        if path not in before:
            changes.append(FileChange(path, "added"))
            continue
        if path not in now:
            changes.append(FileChange(path, "removed"))
            continue
        if path in same:
            continue
        old_bytes, new_bytes = _git(root, "cat-file", "blob", before[path]), (root / path).read_bytes()
        try:
            tensors = compare_tensors(_load(old_bytes), _load(new_bytes), stem)
        except Exception as error:  # noqa: BLE001  a corrupt file is a change to report, not a crash
            changes.append(FileChange(path, "changed", note=f"cannot load: {type(error).__name__}: {error}"))
            continue
        changes.append(FileChange(path, "changed", tensors,
                                  note="" if tensors else "tensors bit-identical; metadata changed"))
    return changes


def blob_ids(root: Path, rev: str, golden: str) -> dict[str, str]:
    """The golden files of ``rev`` under ``golden``: path (from the repository root) -> blob id."""
    listed = _git(root, "ls-tree", "-r", "-z", "--full-tree", rev, "--", golden).decode()
    ids = {}
    for entry in filter(None, listed.split("\0")):
        info, path = entry.split("\t", 1)  # "<mode> blob <id>\t<path>"
        _, kind, id_ = info.split()
        if path.endswith(SUFFIX) and kind == "blob":
            ids[path] = id_
    return ids


def _yes_no(value: bool | None) -> str:
    return "?" if value is None else "yes" if value else "**no**"


def diff_markdown(changes: list[FileChange], base: str) -> str:
    """The first line is the headline the PR summary shows in its first screen."""
    count = {s: sum(c.status == s for c in changes) for s in ("changed", "added", "removed")}
    if not changes:
        return f"no golden file changed since `{base[:12]}`\n"
    beyond = sum(any(t.within_tolerance is False for t in c.tensors) for c in changes)
    lines = [f"{count['changed']} golden files changed, {count['added']} added, {count['removed']} removed "
             f"since `{base[:12]}`" + (f"; {beyond} changed beyond the tolerance policy" if beyond else ""), ""]
    for status in ("changed", "added", "removed"):
        files = [c for c in changes if c.status == status]
        if not files:
            continue
        if status == "changed":
            lines += ["| golden file | tensor | change | max abs | max rel | bit-identical | within tolerance |",
                      "|---|---|---|---:|---:|---|---|"]
            for c in sorted(files, key=lambda c: -c.largest):
                name = f"`{Path(c.path).name}`"
                if not c.tensors:
                    lines.append(f"| {name} | | {c.note} | | | {'yes' if 'bit-identical' in c.note else 'no'} | |")
                for t in c.tensors:
                    lines.append(f"| {name} | `{t.name}` | {t.change} | {t.max_abs:.3g} | {t.max_rel:.3g} | "
                                 f"{'yes' if t.bit_identical else 'no'} | {_yes_no(t.within_tolerance)} |")
                    name = ""
        else:
            lines += ["", f"{status}:"] + [f"- `{c.path}`" for c in files]
        lines.append("")
    return "\n".join(lines)


# ---- check -----------------------------------------------------------------------------------
class _Collector:
    """A pytest plugin that keeps the configs of the collected cells (and their test files)."""

    def __init__(self):
        self.cells: dict[str, tuple[Config, str]] = {}
        self.errors: list[str] = []

    def pytest_collection_modifyitems(self, items):
        for item in items:
            callspec = getattr(item, "callspec", None)
            cfg = callspec.params.get("cfg") if callspec else None
            # only the parity fixture reads and writes golden files: a test that runs a config
            # through run_cell itself (tests/ of the harness) has none to keep
            if isinstance(cfg, Config) and "parity" in getattr(item, "fixturenames", ()):
                self.cells[cfg.id] = (cfg, item.nodeid)

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append(f"{report.nodeid}: {report.longreprtext.strip().splitlines()[-1]}")


def collect_cells(root: Path, paths: list[str]) -> _Collector:
    """The cells the cases parametrize, collected by pytest in this process (conftests that register
    implementations included) with the parity plugin blocked, so no rank pool starts."""
    import contextlib
    import io
    import os

    import pytest

    from ..matrix import full_product

    collector = _Collector()
    here = os.getcwd()
    os.chdir(root)
    try:  # the listing of every collected test is not for the reader; errors come via the collector
        # every cell a golden file may belong to: the nightly full matrix's, not only the gate's
        # --assert=plain: nothing collected here runs as a test, so rewriting asserts buys nothing
        with contextlib.redirect_stdout(io.StringIO()), full_product():
            pytest.main(["--collect-only", "-q", "--assert=plain", "-p", "no:harness.plugin", "-p", "no:cacheprovider",
                         *paths], plugins=[collector])
    finally:
        os.chdir(here)
    return collector


@dataclass
class CheckResult:
    unreadable: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)
    skipped_without: list[str] = field(default_factory=list)
    checked: int = 0
    cells: int = 0
    collection_errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.unreadable or self.orphans or self.gaps or self.collection_errors)


def check(root: Path, golden_dir: Path, paths: list[str]) -> CheckResult:
    from ..resolve import resolve

    collected = collect_cells(root, paths)
    result = CheckResult(cells=len(collected.cells), collection_errors=collected.errors)
    files = sorted(golden_dir.rglob(f"*{SUFFIX}"))
    on_disk = set()
    for path in files:
        stem = path.name[: -len(SUFFIX)]
        nodeid = collected.cells.get(stem, (None, None))[1]
        rel = str(path.relative_to(root.resolve())) if path.is_relative_to(root.resolve()) else str(path)
        result.checked += 1
        try:
            cfg = Config.parse(stem)
        except ConfigError as error:
            result.unreadable.append(f"{rel}: the name is not a config id ({error})")
            continue
        if path != golden_path(golden_dir, cfg):
            result.orphans.append(f"{rel}: belongs under {golden_path(golden_dir, cfg).relative_to(golden_dir)}")
            continue
        on_disk.add(stem)  # an unreadable file is one problem, not also a gap
        try:
            read_golden(path, cfg, _command(root, nodeid) if nodeid else "")
        except GoldenError as error:  # its message ends with the command that recreates it: kept, on one line
            result.unreadable.append(f"{rel}: " + " ".join(line.strip() for line in str(error).splitlines()))
            continue
        if stem not in collected.cells:
            result.orphans.append(f"{rel}: no collected cell has this id (delete it, or restore its cell)")
    for cell_id, (cfg, nodeid) in sorted(collected.cells.items()):
        if cell_id in on_disk:
            continue
        # the fixture's own decision: an invalid cell fails when it runs, with the rule it breaks, and a
        # declared divergence never matches the reference: neither writes a golden to ask for
        disposition = resolve(cfg).disposition
        if disposition.kind in ("invalid", "xfail"):
            continue
        if disposition.kind == "skip":
            result.skipped_without.append(f"{cell_id}: skipped here ({disposition.reason})")
        else:
            result.gaps.append(f"{nodeid}: no golden file; run the cell, which writes it if it matches the "
                               f"reference: {update_command(_command(root, nodeid))}")
    return result


def _command(root: Path, nodeid: str) -> str:
    """The command that reruns a cell, as a failing cell's ``reproduce:`` line says it."""
    return rerun_command(root, nodeid)


GAP_NOTE = ("a cell that diverges from the reference (or hangs, or crashes) writes no golden file, with "
            "--update-golden or without: run it, and fix what its failure shows first")


def check_text(result: CheckResult) -> str:
    lines = [f"{result.checked} golden files, {result.cells} collected cells: "
             + ("OK" if result.ok else f"{len(result.unreadable)} unreadable, {len(result.orphans)} orphans, "
                f"{len(result.gaps)} gaps, {len(result.collection_errors)} collection errors")]
    for title, items in (("collection error", result.collection_errors), ("unreadable", result.unreadable),
                         ("orphan", result.orphans), ("gap", result.gaps)):
        lines += [f"{title}: {item}" for item in items]
    if result.gaps:
        lines.append(f"({GAP_NOTE})")
    if result.skipped_without:
        lines.append(f"{len(result.skipped_without)} cells skipped on this machine have no golden file "
                     "(not a gap: they cannot run here)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.golden", description="golden files: drift and coverage")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("diff", help="golden files added/removed/changed between BASE_REV and the working tree")
    d.add_argument("base", nargs="?", help="base revision (default: the merge base of HEAD with the pull request's "
                                           "base branch, origin's default branch, main or master)")
    d.add_argument("--golden-dir", default="golden", help="relative to the repository root (default golden)")
    c = sub.add_parser("check", help="every golden loads and has a cell; every cell has a golden")
    c.add_argument("paths", nargs="*", help="test paths to collect the cells from (default: pytest's testpaths)")
    c.add_argument("--golden-dir", default="golden", help="relative to the current directory (default golden)")
    args = parser.parse_args(argv)
    if args.command == "diff":
        try:
            root = repo_root(Path.cwd())
            base = args.base or merge_base(root)
            try:
                _git(root, "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}")
            except GitError:
                raise GitError(f"{base!r} is not a revision of this repository") from None
            changes = diff(root, base, args.golden_dir)
        except GitError as error:
            print(f"golden diff: {error}", file=sys.stderr)
            return 2
        sys.stdout.write(diff_markdown(changes, base))
        return 0
    root = Path.cwd()
    result = check(root, (root / args.golden_dir).resolve(), args.paths)
    sys.stdout.write(check_text(result))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
