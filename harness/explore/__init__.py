"""``python -m harness.explore``: hypothesis searches the config space the fixed matrix never runs.

For each target (``<component>[:<impl>]``), hypothesis draws valid configs from what the component
declares (:mod:`.strategies`: its ``Space``, ``simplest`` order, rules and the pool size) and runs
each in the warm pool as a bisect trial. A divergence is shrunk by hypothesis while it keeps its
signature, located by bisect's localisation, and reported with its config id, the command that
reproduces it and the line that adds it to the matrix. Hypothesis's example database (default
``.hypothesis/explore`` in the directory it runs from) keeps the failure, so every later run
replays it first until it passes. Implementations registered in the ``conftest.py`` files of the
directory it runs from are explored too, as bisect does.
"""
from .runner import Budget, Exploration, explore  # noqa: F401
from .strategies import configs  # noqa: F401
