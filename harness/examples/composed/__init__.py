"""The composed model: this project's five parallel components in one small transformer.

Three modules, each importing only those before it:

* ``model.py``: the model on one process (the fp64 reference), built from ``reference/``;
* ``parallel.py``: its parallel modules built from ``harness/parallel/`` (tp, cp, ep, FSDP/HSDP
  units, the pp=2 pipeline) and ``parallelize``;
* ``case.py``: the model case :data:`CASE` (registered as ``harness.examples.composed.case:CASE``
  in harness/components.py) and its cells (``cells``, ``cells16``, ``reshard_tp``).
"""
