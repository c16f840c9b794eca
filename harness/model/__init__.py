"""Whole models: a user's ``nn.Module`` and the function that parallelizes it, trained for several
optimizer steps on the harness's meshes, against the same model on one process in fp64.

Public API (the contract of issue 19, refined here)::

    from harness.model import ModelCase, Pipelined, register_model, model_cells

* :class:`ModelCase` (``case.py``): ``build``, ``batch``, ``loss``, ``parallelize`` (name ->
  ``fn(model, meshes)``), and optional ``forward``, ``optimizer``, ``steps``, ``seq_dim``,
  ``placements``, ``reduction``, ``mixed_precision``, ``supports``, ``xfail``.
* ``parallelize`` gets :class:`harness.meshes.Meshes` and returns the module, or a
  :class:`Pipelined` (the rank's ``PipelineStage`` objects and their schedule). A module whose output
  is a DTensor has its loss computed and backpropagated under ``loss_parallel()``; there is no
  separate "loss context" type (refinement of the contract).
* Changed from the contract: ``Pipelined(stages, schedule, input, target, before_step)`` (the
  rank's ``PipelineStage`` objects; ``before_step`` sums a tied parameter's gradients over the
  stages holding copies); ``ModelCase.supports`` (impl -> fn(MeshSpec) -> reason: invalid cells,
  the model form of ``Implementation.validate``) and ``ModelCase.xfail``; ``mixed_precision`` is
  ``"autocast"`` or ``"bf16"``; ``register_model(..., impls=)`` registers without importing the case.
* ``register_model(name, case="pkg.mod:CASE")`` registers a Component named ``name``;
  ``model_cells(name, impls=, meshes=, dtypes=, steps=, switches=)`` returns its Configs.
* Ids: ``<model>-<impl>-<mesh>-<dtype>-<switches>-steps<N>-seed<S>``, mesh dims ``pp``, ``rep``,
  ``dp``, ``cp``, ``tp`` (in that order), switches ``ep_<N>``, ``etp_<N>``.
* Results: ``loss/step<k>`` (k from 1), ``grad/<param>`` (step 1), ``param/<param>`` and
  ``opt/<state>/<param>`` (after the last step), parameter names as ``named_parameters()`` of the
  unparallelized model gives them (tied parameters under their first name).
* Events (on the re-run of a failing cell only): ``fwd module module=<name> microbatch=<call>
  step=<k>`` and its ``bwd`` event, recorded by hooks on every submodule; the failure names the
  first diverging module.
"""
from .case import ModelCase, Pipelined
from .register import model_cells, register_model

__all__ = ["ModelCase", "Pipelined", "model_cells", "register_model"]
