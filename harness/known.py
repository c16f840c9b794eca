"""A declared divergence: what an ``xfail`` function returns for a cell it knows to be wrong, and the
line its failure must show to be that bug and no other.

    def known(cfg):
        if cfg.degree("tp") > 1:
            return Known("q_norm is left plain by the plan: its gradient stays a per-rank partial sum",
                         shows=r"^first diverging module: .*q_norm \\(parameter gradients")

A cell so declared runs in full as an xfail. It counts as known only when it fails and ``shows``
is found in its failure: in its first line (its diagnosis's, where it starts, whole; or a crash's own
line, :func:`headline`) or in the failure's text (a component's table names each tensor that
differs: ``r"^ +out mismatch"``); a cell that fails another way fails, naming both, because a second
bug behind a declared one is still a bug. A plain ``str`` reason declares any failure.
"""
from __future__ import annotations

import re

from .screen import first_line

# a crash's own line in a pool's or torchrun's failure (harness.pool.parent.CaseFailure): the first
# rank's story, without the harness's wrapping of a model's exception
_RANK_LINE = re.compile(
    r"^\s*ranks? [\d, -]+: (?:raised|died|hung)(?:: (?:harness\.model\.tasks\.ModuleError: )?(.+))?$", re.M)


class Known(str):
    """A declared divergence's reason (a ``str``), with ``shows``: a regular expression (multi-line:
    ``^`` starts any line) searched in the failure's first line and text (module docstring); empty,
    any failure is this one. ``strict`` False: whether the cell shows it depends on the
    machine (kernels that round differently by CPU), so a pass says nothing of upstream."""

    shows: str = ""
    strict: bool = True

    def __new__(cls, reason: str, shows: str = "", strict: bool = True):
        text = super().__new__(cls, reason)
        if shows:
            re.compile(shows)  # a bad pattern fails where it is declared, not in a cell's verdict
        text.shows, text.strict = shows, strict
        return text

    def holds(self, first: str, failure: str = "") -> bool:
        """Whether a failure whose first line (where it starts, or :func:`headline`) is ``first``,
        and whose text is ``failure``, is this divergence."""
        return not self.shows or any(re.search(self.shows, text, re.M) for text in (first, failure))


def headline(failure: str) -> str:
    """The line of a cell's failure that says what went wrong: for a crash or a hang, the first
    rank's own line (its exception); else the failure's first line (where a divergence starts)."""
    _, crashed, ranks = failure.partition("every rank of the case:")
    found = _RANK_LINE.search(ranks) if crashed else None
    if found:
        return found.group(1) or found.group(0).strip()
    return first_line(failure)
