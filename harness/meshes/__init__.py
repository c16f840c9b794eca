"""Device meshes: the dense and sparse meshes a trainer uses, built from one world, and the checks
that hold real groups to their pure-Python model.

* :mod:`.device_mesh`: :class:`MeshSpec` (the model), :func:`build` and :class:`Meshes` (the DeviceMeshes and
  named groups a ``parallelize`` gets);
* :mod:`.check`: real groups against the model, rank by rank;
* :mod:`.fake`: the same checks at worlds of thousands on the fake backend (``python -m harness.meshes.fake``);
* :mod:`.thirdparty`: the layouts Megatron-Core and torchtitan build, against the model.
"""
from .device_mesh import Meshes, MeshSpec, build  # noqa: F401
