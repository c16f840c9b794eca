"""Third-party layouts under the same check: the groups Megatron-Core and torchtitan build.

Megatron-Core lays its dims out by an order string, fastest first (default ``"tp-cp-ep-dp-pp"``: tp
varies over consecutive ranks, pp is slowest), one rank generator for the dense part (tp, cp, dp, pp;
ep = 1) and one for the experts (tp = etp, ep, dp = expert dp, pp; cp = 1) with the same order.
:func:`megatron_model` is that layout as our row-major model (``MeshLayout.from_order``); the groups
Megatron builds must equal it. :data:`MEGATRON_TO_OURS` says which of our named groups each Megatron
group is when the order is Megatron's default, so Megatron is also held to :class:`MeshSpec`.

torchtitan's ``ParallelDims`` (0.3.0) unflattens the world into pp, batch, cp, tp (data loading),
pp, dp_replicate, dp_shard, cp, tp or pp, dp_replicate, fsdp, tp (dense, by its ``spmd_backend``) and
pp, dp_replicate, efsdp, ep (sparse: no etp, so ep borrows from dp_shard·cp·tp, our etp = 1), and
flattens batch·cp into loss: our dims in our order under its names (:data:`harness.names.ELSEWHERE`),
so its groups are held to :class:`MeshSpec` directly.

The tasks here create every group on every pool rank (Megatron's ``new_group`` calls, torchtitan's
meshes): run them on a mesh covering the whole pool.
"""
from __future__ import annotations

from ..layout import MeshLayout
from ..names import ELSEWHERE
from ..versions import pins
from .device_mesh import MeshSpec

# the pin is pyproject.toml's (the thirdparty extra), read from the installed metadata
MEGATRON_INSTALL = 'pip install -e ".[thirdparty]"' + (f"  (megatron-core=={pins()['megatron-core']})"
                                                      if "megatron-core" in pins() else "")
TORCHTITAN_INSTALL = ("pip install --no-deps torchtitan==0.3.0 spmd-types==0.2.3 && pip install tyro  (torchtitan's other "
                      "dependencies are for training, not ParallelDims; tyro's own are needed)")

# Megatron group -> (getter in parallel_state, its keyword arguments, rank generator, dims it spans)
MEGATRON_GROUPS = {
    "tp": ("get_tensor_model_parallel_group", {}, "dense", ("tp",)),
    "pp": ("get_pipeline_model_parallel_group", {}, "dense", ("pp",)),
    "cp": ("get_context_parallel_group", {}, "dense", ("cp",)),
    "dp": ("get_data_parallel_group", {}, "dense", ("dp",)),
    "dp-cp": ("get_data_parallel_group", {"with_context_parallel": True}, "dense", ("dp", "cp")),
    "tp-pp": ("get_model_parallel_group", {}, "dense", ("tp", "pp")),
    "tp-dp": ("get_tensor_and_data_parallel_group", {}, "dense", ("tp", "dp")),
    "tp-dp-cp": ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}, "dense", ("tp", "dp", "cp")),
    "tp-cp": ("get_tensor_and_context_parallel_group", {}, "dense", ("tp", "cp")),
    "ep": ("get_expert_model_parallel_group", {}, "expert", ("ep",)),
    "etp": ("get_expert_tensor_parallel_group", {}, "expert", ("tp",)),
    "etp-ep": ("get_expert_tensor_and_model_parallel_group", {}, "expert", ("tp", "ep")),
    "etp-ep-pp": ("get_expert_tensor_model_pipeline_parallel_group", {}, "expert", ("tp", "ep", "pp")),
    "edp": ("get_expert_data_parallel_group", {}, "expert", ("dp",)),
}
# with Megatron's default order, which of our named groups each Megatron group is
MEGATRON_TO_OURS = {"tp": "tp", "pp": "pp", "cp": "cp", "dp": "batch", "dp-cp": "loss",
                    "ep": "ep", "etp": "etp", "edp": "efsdp"}
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def megatron_degrees(world: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None) -> dict:
    """The dense and expert degrees Megatron derives from the sizes it is given."""
    etp = tp if etp is None else etp
    return {"dense": {"tp": tp, "cp": cp, "ep": 1, "dp": world // (tp * pp * cp), "pp": pp},
            "expert": {"tp": etp, "cp": 1, "ep": ep, "dp": world // (etp * ep * pp), "pp": pp}}


def megatron_model(world: int, order: str, **sizes) -> dict[str, list[list[int]]]:
    """Every Megatron group, as our model lays out Megatron's order string."""
    degrees = megatron_degrees(world, **sizes)
    # as Megatron's RankGenerator: a dim the order leaves out must be 1 and goes last (slowest)
    full = order + "".join(f"-{n}" for n in ("tp", "cp", "ep", "dp", "pp") if n not in order.split("-"))
    layouts = {part: MeshLayout.from_order(full, degrees[part]) for part in ("dense", "expert")}
    return {name: layouts[part].flat_groups(dims) for name, (_, _, part, dims) in MEGATRON_GROUPS.items()}


def megatron_as_spec(world: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None) -> MeshSpec:
    """The :class:`MeshSpec` a Megatron run with these sizes means: its dp is ours."""
    etp = tp if etp is None else etp
    return MeshSpec.of(world, pp=pp, dp=world // (tp * pp * cp), cp=cp, tp=tp, ep=ep, etp=etp)


def compare(world: int, seen: dict[int, dict[str, list[int]]], want: dict[str, list[list[int]]]) -> dict[str, list[int]]:
    """Group name -> ranks whose group (as a set of ranks) differs from ``want``'s group holding them."""
    bad: dict[str, list[int]] = {}
    for name, groups in want.items():
        for rank in range(world):
            (mine,) = [g for g in groups if rank in g]
            if name in seen[rank] and sorted(seen[rank][name]) != sorted(mine):
                bad.setdefault(name, []).append(rank)
    return bad


def megatron_groups(ctx, payload: list[dict]) -> list[dict]:
    """Pool task: for each ``{"order": ..., "tp": .., "pp": .., "cp": .., "ep": .., "etp": ..}`` run
    Megatron-Core's ``initialize_model_parallel`` over the whole pool and report this rank's groups
    (the ranks torch gives for each group, and Megatron's own rank lists where it keeps them)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.distributed.distributed_c10d import _world

    out = []
    for item in payload:
        sizes = {k: v for k, v in item.items() if k != "order"}
        before = set(_world.pg_map)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=sizes.get("tp", 1), pipeline_model_parallel_size=sizes.get("pp", 1),
            context_parallel_size=sizes.get("cp", 1), expert_model_parallel_size=sizes.get("ep", 1),
            expert_tensor_parallel_size=sizes.get("etp"), order=item["order"], create_gloo_process_groups=False)
        try:
            groups = {}
            for name, (getter, kwargs, _, _) in MEGATRON_GROUPS.items():
                groups[name] = dist.get_process_group_ranks(getattr(ps, getter)(**kwargs))
            # Megatron's own ordered lists (stage order for pp)
            lists = {"pp": list(ps._PIPELINE_GLOBAL_RANKS), "tp": list(ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS),
                     "dp": list(ps._DATA_PARALLEL_GLOBAL_RANKS), "dp-cp": list(ps._DATA_PARALLEL_GLOBAL_RANKS_WITH_CP),
                     "cp": list(ps._CONTEXT_PARALLEL_GLOBAL_RANKS)}
        finally:
            ps.destroy_model_parallel()
            for pg in [pg for pg in _world.pg_map if pg not in before]:
                dist.destroy_process_group(pg)
        out.append({"groups": groups, "lists": lists})
    return out


# torchtitan's one-dimensional meshes, by its names; "dp" (spmd_types backend) is our batch
TORCHTITAN_NAMES = ("pp", "batch", "loss", "dp_replicate", "fsdp", "dp", "dp_shard", "cp", "tp", "ep", "efsdp")
TORCHTITAN_TO_OURS = {**ELSEWHERE, "dp": "batch"}


def torchtitan_groups(ctx, payload: list[dict]) -> list[dict]:
    """Pool task: for each ``{"dp_replicate": .., "dp_shard": .., "cp": .., "tp": .., "pp": .., "ep": ..,
    "spmd_backend": ..}`` build torchtitan's ``ParallelDims`` meshes over the whole pool and report this
    rank's group of each one-dimensional mesh it defines (size-1 ones included)."""
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401  torchtitan 0.3.0 needs it imported first
    from torch.distributed.distributed_c10d import _world
    from torchtitan.distributed import parallel_dims as pd

    pd.device_type = "cpu"
    out = []
    for item in payload:
        before = set(_world.pg_map)
        dims = pd.ParallelDims(world_size=ctx.layout.world, **item)
        dims.build_mesh()
        groups = {}
        for name in TORCHTITAN_NAMES:
            try:
                mesh = dims.get_optional_mesh(name, include_singleton_axes=True)
            except ValueError:  # not a mesh of this backend
                continue
            groups[name] = dist.get_process_group_ranks(mesh.get_group())
        del dims
        for pg in [pg for pg in _world.pg_map if pg not in before]:
            dist.destroy_process_group(pg)
        out.append({"groups": groups})
    return out
