"""The composed model's model case: :data:`CASE` (``model.py``'s model, batch and loss, ``parallel.py``'s
``parallelize``) and its cells (:func:`cells`, :func:`cells16`, :func:`reshard_tp`).

Implementations: ``composed`` (autograd everywhere) and ``manual`` (the 3D seed's dense MLP with a
hand-written backward, ``parallel.ManualMLP``, beside the autograd one). Both need etp = tp (switch
``etp_<tp>``) when the model has tp: the MoE's tokens are then those of the dense tp line.

Imports ``model.py`` and ``parallel.py``.
"""
from __future__ import annotations

from harness.model import ModelCase, model_cells

from . import parallel
from .model import EXPERTS, batch, build


def parallelize(model, meshes):
    return parallel.parallelize(model, meshes, manual=False)


def parallelize_manual(model, meshes):
    return parallel.parallelize(model, meshes, manual=True)


def supports(spec) -> str | None:
    if spec.tp > 1 and spec.etp != spec.tp:
        return (f"the experts' FFN runs over the dense tp ranks: give etp_{spec.tp} (etp=1 would hand each "
                "expert the same tokens from every tp rank)")
    if EXPERTS % spec.ep:
        return f"ep={spec.ep} does not divide the {EXPERTS} experts"
    return None


CASE = ModelCase(
    build=build,
    batch=batch,
    loss=parallel.loss,
    parallelize={"composed": parallelize, "manual": parallelize_manual},
    steps=10,
    seq_dim=1,
    supports={"composed": supports, "manual": supports},
)


def cells():
    """The composed model's cells on 8 ranks (cases/test_models.py)."""
    return (model_cells("composed", impls=["composed"], meshes=["pp=2,dp=2,cp=2"], switches={"ep": ["2"]})
            + model_cells("composed", meshes=["pp=2,dp=2,tp=2"], switches={"ep": ["2"], "etp": ["2"]})
            + model_cells("composed", impls=["composed"], meshes=["dp=2,cp=2,tp=2"], switches={"ep": ["2", "4"], "etp": ["2"]})
            # FSDP4·EP2 saved after step 5, loaded as HSDP 2×2·EP2 for steps 6-10 (4 ranks: the 8-rank
            # FSDP4·TP2·EP2 -> HSDP2×2·TP2·EP2 trip passes too, but takes ~30 s on a loaded 2-core
            # machine, the case deadline; it is reshard_tp in tests/test_composed.py)
            + model_cells("composed", impls=["composed"], meshes=["dp=4"],
                          switches={"ep": ["2"], "reshard": ["rep2dp2at5"]}))


def quick_cells():
    """The stand-ins ``--quick`` runs for :func:`cells` (cases/test_models.py marks them ``quick_only``):
    the same meshes and switches trained 3 steps, not 10 (a third of the time: about 0.6 s a step on 8
    ranks here). Not the reshard cell, whose trip is at step 5."""
    return [cfg.replace(sizes={"steps": 3}) for cfg in cells() if "reshard" not in dict(cfg.switches)]


def reshard_tp():
    """The reshard with tp: FSDP4·TP2·EP2 saved after step 5, HSDP 2×2·TP2·EP2 from step 6."""
    return model_cells("composed", impls=["composed"], meshes=["dp=4,tp=2"],
                       switches={"ep": ["2"], "etp": ["2"], "reshard": ["rep2dp2tp2at5"]})


def cells16():
    """The 16-rank cell (pp2·dp2·cp2·tp2, ep4): run under torchrun (tests/test_composed.py)."""
    return model_cells("composed", impls=["composed"], meshes=["pp=2,dp=2,cp=2,tp=2"],
                       switches={"ep": ["4"], "etp": ["2"]})
