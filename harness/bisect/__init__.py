"""``python -m harness.bisect``: from a diverging cell to the smallest config that diverges the same way.

Every subcommand first loads what pytest loads from the current directory (:mod:`harness.project`:
rootdir, ini file, testpaths, conftests), so implementations a user's conftest registers count, and
a component or implementation not registered there is a usage error saying where pytest looked.

* ``run <config id>``: confirm the divergence and that it is deterministic (two runs), take its
  signature (:mod:`.signature`), then shrink the config while the signature holds (:mod:`.shrink`).
* ``run <component>``: run that component's cells as pytest collects them from here, in its order,
  and bisect the first failing one.
* ``run <config id> -- <command ...>``: the same search with any command as the oracle
  (``{}`` in the command, or the environment variable ``PARITY_CONFIG``, is the candidate id;
  exit 0 good, 125 skip, other codes below 128 bad).
* ``check <config id>``: exit 0 when the cell matches, 1 when it diverges, 125 when it cannot run
  here, for ``git bisect run python -m harness.bisect check <id>``.

Trials run in one warm pool; each is logged as a JSON line; the end is the minimal cell, the command
that reproduces it and where ``result.json`` and ``trials.jsonl`` went (``.paritytest/bisect`` in
the project's rootdir, which git ignores, or ``--out``). Then the minimal cell runs once more with events
recorded in the reference and in the implementation (:mod:`harness.events`, :mod:`.localise`):
the first event that diverges, and where the divergence starts (the first event whose inputs
match the reference and whose outputs do not).
"""
from .runner import EXIT, Trials  # noqa: F401
from .shrink import Search, steps  # noqa: F401
from .signature import Signature, of_report  # noqa: F401
