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
def __getattr__(name: str):
    """The search's names, imported on first use: ``python -m harness.explore --help`` answers
    without importing torch and hypothesis."""
    if name in ("Budget", "Exploration", "explore"):
        from . import runner

        return getattr(runner, name)
    if name == "configs":
        from .strategies import configs

        return configs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
