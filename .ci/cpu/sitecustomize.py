"""Where the suite's CPU goes, by process: with ``CPU_PROBE_LOG=FILE`` and this directory first on an
absolute ``PYTHONPATH``, every Python process of a run (the xdist workers, each user's pytest, the
keepers, the ranks they fork) appends one JSON line to FILE as it ends: its own CPU seconds, its
wall seconds, its command line and the test of the suite it ran for. ``.ci/cpu_report.py FILE``
sums them. A process killed by a signal writes nothing (most ranks: they are stopped so).

    CPU_PROBE_LOG=/tmp/cpu.log PYTHONPATH=$PWD/.ci/cpu python -m pytest -n auto tests/
    python .ci/cpu_report.py /tmp/cpu.log
"""
import atexit
import json
import os
import resource
import sys
import time

_LOG = os.environ.get("CPU_PROBE_LOG")
_started = [time.monotonic()]
_forked = [False]


def _write() -> None:
    used = resource.getrusage(resource.RUSAGE_SELF)
    record = {"pid": os.getpid(), "forked": _forked[0], "argv": " ".join(sys.argv)[:300],
              "test": os.environ.get("CPU_PROBE_TEST", ""), "cpu": round(used.ru_utime + used.ru_stime, 3),
              "wall": round(time.monotonic() - _started[0], 3), "torch": "torch" in sys.modules}
    try:
        with open(_LOG, "a") as log:  # one short write: lines of concurrent processes do not interleave
            log.write(json.dumps(record) + "\n")
    except OSError:
        pass


def _forked_child() -> None:
    _started[0], _forked[0] = time.monotonic(), True


if _LOG:
    # the suite's test that started this process (its descendants inherit the name; a user's pytest
    # sets PYTEST_CURRENT_TEST to its own tests)
    if "CPU_PROBE_TEST" not in os.environ and os.environ.get("PYTEST_CURRENT_TEST"):
        os.environ["CPU_PROBE_TEST"] = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
    _exit = os._exit

    def _probed_exit(code: int) -> None:  # ranks and zygotes end by os._exit, which skips atexit
        _write()
        _exit(code)

    os._exit = _probed_exit
    os.register_at_fork(after_in_child=_forked_child)
    atexit.register(_write)
