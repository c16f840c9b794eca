"""The plugin's command-line options, and their checks: a bad value is a usage error naming the
option, the value and the fix, before anything runs."""
from __future__ import annotations

import os

import pytest

from .pool.defaults import DEFAULT_DEADLINE, DEFAULT_SIZE


def _seconds(option: str):
    """An optional value's type that says what to write when the next argument was not meant for it:
    argparse gives an option with an optional value the path after it (``--keep-pool cases/``)."""
    import argparse

    def parse(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number of seconds: write {option}=SECONDS, or {option} after the paths "
                f"(an optional value takes the argument after it)") from None

    return parse


def add_options(parser) -> None:
    group = parser.getgroup("parity", "parallel-training correctness harness")
    group.addoption("--update-golden", action="store_true",
                    help="write golden files that are missing or whose values changed, and print what moved")
    group.addoption("--strict-golden", action="store_true",
                    help="fail a cell whose golden file is missing instead of writing it (for CI)")
    group.addoption("--pool-size", type=int, default=DEFAULT_SIZE,
                    help=f"most rank processes in the warm pool of each pytest process (default {DEFAULT_SIZE}); "
                         "the pool starts only as large as the selected cells need")
    group.addoption("--backend", default="auto",
                    help="process-group backend: auto (nccl where CUDA is present, else gloo), gloo or nccl")
    group.addoption("--case-deadline", type=float, default=DEFAULT_DEADLINE,
                    help=f"seconds a cell may run before its ranks' stacks are taken and it fails (default {DEFAULT_DEADLINE:g})")
    group.addoption("--golden-dir", default=None, help="where golden files live (default: <rootdir>/golden)")
    group.addoption("--rank-logs", default=None,
                    help="under torchrun: where ranks other than 0 write their pytest output "
                         "(default: a directory in the system's temp dir, named in their closing line)")
    group.addoption("--quick", action="store_true",
                    help="the edit loop: of each component and implementation, a few cells that together run every "
                         "mesh dim, dtype and switch value, and no other test that needs the rank pool; the whole "
                         "matrix stays the gate")
    group.addoption("--changed", default=None, metavar="REF",
                    help="the cells a change since the git ref REF can move (the import graph from the changed files "
                         "to each cell's component, implementation, reference and model, and changed golden files); "
                         "a change to the harness's machinery selects every cell (docs/ci.md)")
    group.addoption("--full-matrix", action="store_true",
                    help="every cell of each component's product, not the gate's covering design of it (the "
                         "nightly run; also PARITYTEST_FULL_MATRIX=1)")
    group.addoption("--keep-pool", type=_seconds("--keep-pool"), nargs="?", const=-1.0, default=None, metavar="SECONDS",
                    help="keep the pool's zygote (torch and third-party libraries imported) alive after the run, "
                         "SECONDS idle (default 900, or $PARITYTEST_KEEP_POOL), and fork the next run's ranks from it (one per "
                         "checkout; checkouts that set the same $PARITYTEST_KEEP_POOL_SCOPE share one)")
    group.addoption("--no-localise", action="store_true",
                    help="a failing cell is not run again to find where it starts: a failing run takes about as "
                         "long as a green one; its reproduce command localises it")
    group.addoption("--stop-pool", action="store_true",
                    help="stop this checkout's kept pools (--keep-pool) and exit")
    group.addoption("--explore", type=int, default=0, metavar="N",
                    help="instead of running the selected cells, explore each of their (component, implementation) "
                         "pairs with up to N configs hypothesis draws (harness.explore)")
    group.addoption("--explore-ignore", action="append", default=[], metavar="TENSOR",
                    help="with --explore: a result tensor whose divergence alone does not count (repeatable), "
                         "as python -m harness.explore --ignore, e.g. the declared 'loss'")
    group.addoption("--explore-seed", type=int, default=None, metavar="N",
                    help="with --explore: the same draws in every run, as python -m harness.explore --seed")
    group.addoption("--explore-shrink-seconds", type=float, default=120.0, metavar="S",
                    help="with --explore: how long a found divergence is shrunk (default 120), as python -m "
                         "harness.explore --shrink-seconds")


def usage(option: str, value, why: str) -> pytest.UsageError:
    return pytest.UsageError(f"{option} {value}: {why}")


def check_options(config) -> None:
    """Every option value, checked; ``--full-matrix`` handed on to the case modules' matrices."""
    opt = config.getoption
    if opt("--pool-size") < 1:
        raise usage("--pool-size", opt("--pool-size"), "must be at least 1 (ranks kept warm), e.g. --pool-size 8")
    deadline = opt("--case-deadline")
    if not deadline > 0:
        raise usage("--case-deadline", deadline, "must be a positive number of seconds, e.g. --case-deadline 30")
    from .pool.backend import check

    try:
        check(opt("--backend"))
    except ValueError as error:
        raise usage("--backend", opt("--backend"), str(error)) from None
    from .matrix import FULL_ENV

    if os.environ.get(FULL_ENV, "") not in ("", "0", "1"):
        raise pytest.UsageError(f"{FULL_ENV}={os.environ[FULL_ENV]}: use 1 for the full matrix, or 0 (or unset it) "
                                "for the covering design")
    if opt("--full-matrix"):  # read by harness.matrix.design when the case modules build their cells
        os.environ[FULL_ENV] = "1"
    if opt("--explore") and opt("--explore") < 1:
        raise usage("--explore", opt("--explore"), "needs N >= 1 configs per target, and the warm pool (not torchrun)")
    if not opt("--explore-shrink-seconds") > 0:
        raise usage("--explore-shrink-seconds", opt("--explore-shrink-seconds"),
                    "must be a positive number of seconds, e.g. --explore-shrink-seconds 30")


def keep_seconds(config) -> float:
    """How long a kept pool waits idle (0: none): --keep-pool [SECONDS], else $PARITYTEST_KEEP_POOL;
    a bad value is a usage error."""
    from .pool.kept import DEFAULT_IDLE, KeptPoolError, idle_from_env

    value = config.getoption("--keep-pool")
    if value is None:
        try:
            return idle_from_env()
        except KeptPoolError as error:
            raise pytest.UsageError(str(error)) from None
    if value == -1.0:  # the option without a value
        return DEFAULT_IDLE
    if value <= 0:
        raise usage("--keep-pool", value, "must be a positive number of seconds, e.g. --keep-pool 900")
    return value
