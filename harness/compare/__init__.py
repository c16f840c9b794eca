"""Comparison: a result against its expectation, under one tolerance policy.

* :mod:`.tolerance`: the policy, a relative tolerance from the dtype and the reduction size;
* :mod:`.diff`: per tensor the worst element, the error over tolerance, the norm ratio and the
  ranks whose shards hold bad values, as a :class:`~.diff.Report` that reads as a table.
"""
from .diff import Report, Row, compare  # noqa: F401
from .tolerance import Tolerance, Tolerances, tolerance  # noqa: F401
