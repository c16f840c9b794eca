"""Mesh layouts at scale, in one process, on PyTorch's ``fake`` process-group backend.

``python -m harness.meshes.fake '<json>'`` checks each layout of ``{"specs": [...], "real_ranks": k,
"real_ranks_of": {spec: k}, "every_rank_upto": 1024, "sample": s, "seed": n}`` and prints one JSON
line per layout. For each
layout the process joins a fake world as one rank at a time (re-initialising the default group,
which is process-global: hence a process of its own, not pytest's):

* as its first rank it builds the meshes (real ``DeviceMesh._unflatten``/``_flatten``, a ``new_group``
  per group) and reads back every group of every named group as the meshes enumerate them (the
  lists each rank passes to ``new_group``): they must be the model's, and partition the world; each
  rank's coordinates come from the meshes' full rank tensors; every rank up to ``every_rank_upto``,
  a seeded sample of ``sample`` ranks beyond, is checked for coordinates, for its group of every
  name, and for the borrowing rules;
* as each of ``real_ranks`` ranks (the first, the last, seeded random ones) it builds the meshes
  again and checks the process groups it holds and its coordinates, as torch reports them.
"""
from __future__ import annotations

import json
import random
import sys
import time


def _coords_of(mesh_tensor, ranks):
    """rank -> coordinates in a full mesh rank tensor, for ``ranks``."""
    import torch

    flat = mesh_tensor.flatten()
    where = torch.empty(int(flat.max()) + 1, dtype=torch.long)
    where[flat] = torch.arange(flat.numel())
    out = {}
    for rank in ranks:
        pos, coords = int(where[rank]), []
        for size in reversed(mesh_tensor.shape):
            coords.append(pos % size)
            pos //= size
        out[rank] = tuple(reversed(coords))
    return out


def check_layout(text: str, real_ranks: int, every_rank_upto: int, sample: int, seed: int) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .check import check_all_groups, check_borrowing, check_rank
    from ..names import GROUPS
    from .device_mesh import MeshSpec, build

    spec = MeshSpec.parse(text)
    world = spec.world
    rng = random.Random(f"{seed}:{spec.id}")
    if world <= every_rank_upto:
        checked = list(range(world))
    else:
        checked = sorted({0, world - 1, *rng.sample(range(world), sample)})
    real = [0, world - 1, *rng.sample(range(1, world - 1), min(world - 2, max(0, real_ranks - 2)))][:real_ranks]
    errors: list[str] = []
    start = time.perf_counter()
    builds = []
    for i, rank in enumerate(real):
        t0 = time.perf_counter()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            meshes = build(spec)
            builds.append(time.perf_counter() - t0)
            seen = meshes.describe()
            errors += check_rank(spec, rank, seen)
            if i == 0:
                partitions = meshes.all_groups()
                errors += check_all_groups(spec, partitions)
                for name, groups in partitions.items():
                    members = sorted(r for g in groups for r in g)
                    if members != list(range(world)):
                        errors.append(f"{spec.id}: the {name} groups do not partition the world of {world}")
                by_rank = {r: {} for r in range(world)}
                for name, groups in partitions.items():
                    for g in groups:
                        for r in g:
                            by_rank[r][name] = g
                coords = {which: _coords_of(t, checked) for which, t in meshes.full_coords().items()}
                for r in checked:
                    errors += check_rank(spec, r, {"dense": coords["dense"][r], "sparse": coords["sparse"][r],
                                                   "groups": {n: by_rank[r][n] for n in GROUPS}})
                errors += check_borrowing(spec, by_rank, checked)
        finally:
            dist.destroy_process_group()
    return {"spec": spec.id, "world": world, "ranks_checked": len(checked), "real_ranks": real,
            "build_s": builds, "seconds": time.perf_counter() - start, "errors": errors[:20]}


def main(argv: list[str]) -> None:
    job = json.loads(argv[0])
    for text in job["specs"]:
        real = job.get("real_ranks_of", {}).get(text, job.get("real_ranks", 3))
        result = check_layout(text, real, job.get("every_rank_upto", 1024), job.get("sample", 64), job.get("seed", 0))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
