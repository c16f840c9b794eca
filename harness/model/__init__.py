"""Whole models: a user's ``nn.Module`` and the function that parallelizes it, trained for several
optimizer steps on the harness's meshes, against the same model on one process in fp64.

Public API::

    from harness.model import (ModelCase, Pipelined, Parallelized, load_shards, register_model, model_cells,
                               cell_dir, switches, running)

* :class:`ModelCase`: ``build``, ``batch``, ``loss``, ``parallelize`` (name -> ``fn(model, meshes)``),
  and optional ``forward``, ``optimizer``, ``steps``, ``seq_dim``, ``placements``, ``reduction``,
  ``mixed_precision``, ``supports``, ``xfail``.
* ``parallelize`` gets :class:`harness.meshes.Meshes` and returns the module, a :class:`Pipelined`
  (the rank's ``PipelineStage`` objects and their schedule), or a :class:`Parallelized` (the module,
  the code that finishes its gradients before each optimizer step, a rank's own parameter names).
  ``load_shards(module, whole, placements)`` loads the seeded start by name into a model its
  framework built already sharded. A module whose output is a DTensor has
  its loss computed and backpropagated under ``loss_parallel()``.
* ``cell_dir()``: the directory a cell's ranks share, for a ``parallelize`` that goes through files
  (``save_pretrained`` / ``from_pretrained``); ``switches()``: the cell's values of the case's own
  switches (``ModelCase.switches``), which exploration draws; ``running()``: the running cell (its
  id, dtype, mesh degrees, switches and steps), for a ``parallelize`` that sets its own precision.
* ``register_model(name, case="pkg.mod:CASE")`` registers a Component named ``name``;
  ``model_cells(name, impls=, meshes=, dtypes=, steps=, switches=)`` returns its Configs.
* Ids: ``<model>-<impl>-<mesh>-<dtype>-<switches>-steps<N>-seed<S>``, mesh dims ``pp``, ``rep``,
  ``dp``, ``cp``, ``tp`` (in that order, :mod:`harness.names`), switches ``ep_<N>``, ``etp_<N>``,
  ``reshard_<layout>`` and the case's own.
* Results: ``loss/step<k>`` (k from 1), ``grad/<param>`` (step 1) and ``step<k>/grad/<param>`` (each
  later step), ``param/<param>`` and
  ``opt/<state>/<param>`` (after the last step), parameter names as ``named_parameters()`` of the
  unparallelized model gives them (tied parameters under their first name).
* Events (when a failing cell runs again, and in bisect): ``fwd module module=<name> microbatch=<call>
  step=<k>`` and its ``bwd`` event, recorded by hooks on every submodule; the failure names the
  first diverging module.

Inside, data flows one way: the case (``case.py``: the user's value) -> the cell's plan (``plan.py``:
mesh spec, rules, reshard round trip) -> one training loop (``train.py``, with ``batches.py``) on the
ranks and in the reference (``tasks.py``, the entry points bound to the case) -> pieces
(``placement.py``) -> comparison -> one diagnosis (``diagnose.py``, with ``hooks.py``' events).
``split.py`` fails a cell whose function split nothing over a dim of its mesh; ``register.py``
makes a case a Component.
"""
from .case import ModelCase, Parallelized, Pipelined
from .cell import Running, cell_dir, running, switches
from .register import model_cells, register_model

__all__ = ["ModelCase", "Parallelized", "Pipelined", "Running", "cell_dir", "load_shards", "model_cells", "register_model",
           "running", "switches"]


def __getattr__(name: str):
    # load_shards runs on the ranks: imported here, its module would import torch.distributed.tensor
    # (and sympy through it) into every pytest process that collects a model cell
    if name == "load_shards":
        from .placement import load_shards

        return load_shards
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
