"""Golden files: the stored result of each cell, to catch drift over time.

* :mod:`.store`: one safetensors file per cell, written atomically, read with a clear error;
* ``python -m harness.golden diff | check`` (:mod:`.__main__`): drift between revisions, coverage.
"""
from .store import GoldenError, MissingGolden, golden_path, read_golden, write_golden  # noqa: F401
