"""A user's own project, for the tests that run the harness as a user does: its files in a directory
of its own, and the commands a user types there (``python -m pytest``, ``python -m harness.<tool>``)
run in a subprocess with this checkout importable as its installed package, the run's kept pool
(tests/conftest.py) and a temp directory inside the project's, so that what a failing rank leaves
goes with the test's.

    project = UserProject(tmp_path / "project", {"mymodel.py": MODEL, "conftest.py": CONFTEST})
    done = project.pytest("-k", "dp2")
    assert done.returncode == 1 and "1 failed" in done.stdout, done.tail

Scenarios that share a project make it once (``scope="module"`` fixtures with ``tmp_path_factory``)
and, where they can, run in one pytest subprocess whose junit XML (``Run.cells``) each test reads.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider")


def imported_modules(stderr: str) -> set[str]:
    """The modules a ``python -X importtime`` process imported, read from its ``stderr``."""
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


class Run(subprocess.CompletedProcess):
    """A finished command: ``returncode``, ``stdout``, ``stderr``, and what a failed assertion shows."""

    def __init__(self, done: subprocess.CompletedProcess, junit: Path | None = None):
        super().__init__(done.args, done.returncode, done.stdout, done.stderr)
        self.junit = junit

    @property
    def tail(self) -> str:
        """The end of its output and the start and end of its errors: enough to read why an assertion
        failed (under torchrun the ranks' own errors come first, the launcher's summary last)."""
        errors = self.stderr if len(self.stderr) <= 5000 else self.stderr[:2000] + "\n[...]\n" + self.stderr[-3000:]
        return self.stdout[-5000:] + "\n--- stderr ---\n" + errors

    @property
    def summary(self) -> str:
        """pytest's short test summary (its FAILED and ERROR lines), or ''."""
        return self.stdout.split("short test summary info")[-1] if "short test summary info" in self.stdout else ""

    def failed(self) -> list[str]:
        """The node ids of the summary's FAILED lines (under CI=true a line repeats its id in its message)."""
        return [line.split()[1] for line in self.summary.splitlines() if line.startswith("FAILED ")]

    @property
    def cells(self) -> dict:
        """The run's cells by id, from its junit XML (``harness.report.junit``)."""
        from harness.report import junit

        assert self.junit is not None and self.junit.exists(), self.tail
        return {c.cell: c for c in junit.read([self.junit]).cells}


def junit_texts(junit: Path) -> dict[str, str]:
    """What a run's junit XML keeps of each cell that did not pass, by its id: the whole failure
    (a zoo's report keeps the first line of its diagnosis)."""
    from harness.report import junit as records

    return {c.cell: c.text or c.message or "" for c in records.read([junit]).cells}


class UserProject:
    """A project at ``path`` with ``files`` (name -> text, dedented; a ``pytest.ini`` unless one is
    given or ``ini=False``)."""

    def __init__(self, path: Path, files: dict[str, str] | None = None, *, ini: bool = True):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.parent / f"{self.path.name}-tmp"  # beside it: no file of the project's
        self.tmp.mkdir(exist_ok=True)
        self.runs = 0
        self.write({"pytest.ini": "[pytest]\n"} if ini else {})
        self.write(files or {})

    def write(self, files: dict[str, str]) -> UserProject:
        for name, text in files.items():
            target = self.path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(textwrap.dedent(text))
        return self

    def env(self, **extra: str) -> dict[str, str]:
        """The environment its commands run with: this run's, with the checkout and the project
        importable (as an installed harness and pytest's rootdir would make them), ``extra`` on top."""
        paths = [str(ROOT), str(self.path), os.environ.get("PYTHONPATH", "")]
        return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), TMPDIR=str(self.tmp)) | extra

    def run(self, *command: str, timeout: float = 600, env: dict[str, str] | None = None,
            junit: Path | None = None) -> Run:
        """``command`` in the project (``python`` is this run's interpreter)."""
        argv = [sys.executable if command[0] == "python" else command[0], *command[1:]]
        done = subprocess.run(argv, cwd=self.path, env=env or self.env(), capture_output=True, text=True,
                              timeout=timeout)
        return Run(done, junit)

    def pytest(self, *args: str, timeout: float = 600, env: dict[str, str] | None = None) -> Run:
        """``python -m pytest -q`` in the project, its junit XML kept beside it (``Run.cells``)."""
        self.runs += 1
        xml = self.path.parent / f"{self.path.name}-run{self.runs}.xml"
        return self.run("python", *PYTEST, f"--junitxml={xml}", *args, timeout=timeout, env=env, junit=xml)

    def harness(self, tool: str, *args: str, timeout: float = 600, env: dict[str, str] | None = None) -> Run:
        """``python -m harness.<tool>`` in the project (bisect, explore, golden, zoo, ...)."""
        return self.run("python", "-m", f"harness.{tool}", *args, timeout=timeout, env=env)
