"""Mesh layouts with real ranks: every named group of every rank against the model.

The matrix: every way to factor 8 ranks into the five dense degrees (pp, rep, dp,
cp, tp: 35 layouts), each given a sparse layout that alternates between the two ways ep borrows
ranks (etp = tp: ep from dp·cp; etp = 1: ep from dp·cp·tp) and between the largest ep
the lender allows and the smallest, plus a few layouts of 2 and 4 ranks (built as side-by-side copies
over the pool). Each layout is built on real gloo ranks by ``harness.meshes.device_mesh.build``; each rank's
coordinates and groups are held to ``MeshSpec``, an all-reduce over each group must sum the model's
ranks, groups of one name must partition the pool, and the sparse groups must sit inside the dense
ones they borrow from.

Also here: the hand-written ``comm_map`` of the 3D implementation against the layout it claims, and
the groups Megatron-Core (and torchtitan, when installed) build, against the model built with the
library's own rank order.
"""
import contextlib
import importlib.util
import itertools

import pytest

from harness.layout import MeshLayout
from harness.meshes.check import check_borrowing, check_comm_map, check_partition, check_rank
from harness.meshes.device_mesh import MeshSpec
from harness.names import GROUPS
from harness.meshes.thirdparty import (DEFAULT_ORDER, MEGATRON_INSTALL, MEGATRON_TO_OURS, TORCHTITAN_INSTALL,
                                       TORCHTITAN_TO_OURS, compare, megatron_as_spec, megatron_model)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts() -> list[str]:
    out = []
    factorizations = [f for f in itertools.product(_divisors(8), repeat=5) if f[0] * f[1] * f[2] * f[3] * f[4] == 8]
    for i, (pp, dr, ds, cp, tp) in enumerate(factorizations):
        etp = tp if i % 2 == 0 else 1
        lender = ds * cp * (1 if etp == tp else tp)
        ep = lender if i % 4 < 2 else min(_divisors(lender)[1:] or [1])
        out.append(MeshSpec.of(8, pp=pp, rep=dr, dp=ds, cp=cp, tp=tp, ep=ep, etp=etp).id)
    for text in ("world=2,dp=2,ep=2", "world=2,tp=2,ep=2", "world=4,dp=2,tp=2,ep=2,etp=2",
                 "world=4,dp=2,tp=2,ep=4", "world=4,pp=2,cp=2,ep=2", "world=4,rep=2,dp=2,ep=2"):
        out.append(MeshSpec.parse(text).id)
    return out


LAYOUTS = layouts()


def test_the_matrix_has_at_least_thirty_layouts():
    assert len(set(LAYOUTS)) == len(LAYOUTS) >= 30


def _whole_pool(pool):
    return (("world", pool.size),)


@pytest.mark.parametrize("text", LAYOUTS)
def test_every_named_group_of_every_rank_matches_the_model(text, rank_pool):
    spec = MeshSpec.parse(text)
    if rank_pool.size % spec.world:
        pytest.skip(f"world {spec.world} does not divide the pool of {rank_pool.size}")
    seen = rank_pool.run("harness.meshes.device_mesh:describe_layouts", [spec.id], _whole_pool(rank_pool))
    assert sorted(seen) == list(range(rank_pool.size))
    errors, copies = [], {}
    for rank, result in seen.items():
        got = result[spec.id]
        offset = rank - rank % spec.world  # this rank's copy of the layout starts there
        local = {n: [r - offset for r in g] for n, g in got["groups"].items()}
        errors += check_rank(spec, rank - offset, {**got, "groups": local})
        for name in GROUPS:
            want = sum(spec.group_of(rank - offset, name)) + offset * len(local[name])
            if got["sums"][name] != want:
                errors.append(f"rank {rank}: all-reduce over its {name} group gave {got['sums'][name]}, "
                              f"the model's ranks sum to {want}")
        copies.setdefault(offset, {})[rank - offset] = local
    errors += check_partition(rank_pool.size, {r: seen[r][spec.id]["groups"] for r in seen}, spec.id)
    for by_rank in copies.values():
        errors += check_borrowing(spec, by_rank)
    assert not errors, "\n".join(errors[:20])


RENAMED = ("world=4,rep=2,dp=2", "world=4,dp=2,cp=2", "world=4,dp=2,tp=2,ep=2", "world=4,pp=2,tp=2")


def test_meshes_renamed_to_torchtitans_names_hold_the_same_ranks(rank_pool):
    """ModelCase(mesh_names="torchtitan"): every named group, by torchtitan's name, is ours."""
    if rank_pool.size < 4:
        pytest.skip("these layouts take 4 ranks")
    seen = rank_pool.run("harness.meshes.device_mesh:renamed_groups", list(RENAMED), (("world", 4),))
    assert sorted(seen) == [0, 1, 2, 3]
    for rank, by_layout in seen.items():
        for text, got in by_layout.items():
            assert got["torchtitan"] == got["ours"], (rank, text)
            assert got["dense"] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]


# ---- the hand-written map of the 3D implementation ---------------------------------------------------
# As the 3D implementation this project started from wrote it for 8 ranks, claiming (dp, pp, tp) = (2, 2, 2).
COMM_MAP = {
    "pp": [(0, 2), (1, 3), (4, 6), (5, 7)],  # stage 0 sends to stage 1
    "tp": [(0, 1), (2, 3), (4, 5), (6, 7)],
    "dp": [(0, 4), (1, 5), (2, 6), (3, 7)],
}
CLAIM = (("dp", 2), ("pp", 2), ("tp", 2))


def _claimed_groups(rank_pool):
    seen = rank_pool.run("harness.pool.tasks:describe_mesh", None, CLAIM)
    return {rank: got["groups"] for rank, got in seen.items()}


def test_the_hand_written_comm_map_is_the_layout_it_claims(rank_pool):
    groups = _claimed_groups(rank_pool)
    model = MeshLayout.of(CLAIM)
    assert groups == {r: {n: next(g for g in model.groups(n) if r in g) for n in model.names} for r in range(8)}
    assert check_comm_map(COMM_MAP, groups, "(dp, pp, tp) = (2, 2, 2)") == []


def test_a_mutated_comm_map_is_caught_naming_rank_and_group(rank_pool):
    mutated = {**COMM_MAP, "pp": [(0, 2), (1, 3), (4, 7), (5, 6)]}  # one pair crossed
    errors = check_comm_map(mutated, _claimed_groups(rank_pool), "(dp, pp, tp) = (2, 2, 2)")
    print("\n" + "\n".join(errors))
    assert "rank 4: the map pairs it with rank 7 along pp, but its pp group in the layout " \
           "(dp, pp, tp) = (2, 2, 2) is [4, 6]" in errors
    assert {int(e.split(":")[0].split()[1]) for e in errors} == {4, 5, 6, 7}


def test_the_comm_map_is_not_another_order_of_the_same_dims(rank_pool):
    """The claim matters: the same map read as (pp, dp, tp) is wrong for pp and dp."""
    seen = rank_pool.run("harness.pool.tasks:describe_mesh", None, (("pp", 2), ("dp", 2), ("tp", 2)))
    errors = check_comm_map(COMM_MAP, {r: g["groups"] for r, g in seen.items()}, "(pp, dp, tp) = (2, 2, 2)")
    assert {e.split(" along ")[1].split(",")[0] for e in errors if " along " in e} == {"pp", "dp"}


# ---- third-party layouts ------------------------------------------------------------------------------
# world 8, Megatron's sizes and order string (fastest first)
MEGATRON = [
    {"order": DEFAULT_ORDER, "tp": 2, "pp": 2, "ep": 2, "etp": 1},
    {"order": DEFAULT_ORDER, "tp": 2, "cp": 2, "ep": 2},
    {"order": DEFAULT_ORDER, "ep": 4},
    {"order": DEFAULT_ORDER, "tp": 2, "pp": 2, "cp": 2},
    {"order": DEFAULT_ORDER, "tp": 4, "ep": 2, "etp": 1},
    {"order": "tp-dp-pp", "tp": 2, "pp": 2},
    {"order": "tp-pp-dp", "tp": 2, "pp": 2},
    {"order": "tp-cp-ep-pp-dp", "tp": 2, "pp": 2, "ep": 2, "etp": 1},
    {"order": "tp-dp-cp-pp", "tp": 2, "cp": 2},
    {"order": "dp-tp-pp", "tp": 2, "pp": 2},
]


def _sizes(item):
    return {k: v for k, v in item.items() if k != "order"}


def _label(item):
    return item["order"] + ":" + ",".join(f"{k}={v}" for k, v in _sizes(item).items())


# generous: a library's import and ~30 new_group calls per config crawl on a loaded 2-core machine
LIBRARY_DEADLINE = 120.0


@contextlib.contextmanager
def eight_ranks(rank_pool, *imports):
    """The session's pool when it has 8 ranks (whose ranks then import ``imports`` on first use,
    rather than a second pool of 8 importing torch beside it); else a pool of 8 of its own whose
    zygote imports them, closed after."""
    if rank_pool.size >= 8:
        yield rank_pool
        return
    from harness.pool.parent import Pool, default_preload

    pool = Pool(size=8, preload=default_preload() + imports, deadline=LIBRARY_DEADLINE, start_timeout=600.0)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def megatron_pool(rank_pool):
    """8 ranks that import Megatron-Core."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        pytest.skip(f"megatron-core is not installed: {MEGATRON_INSTALL}")
    with eight_ranks(rank_pool, "megatron.core.parallel_state") as pool:
        yield pool


@pytest.fixture(scope="module")
def megatron_seen(megatron_pool):
    """Every rank's groups for a Megatron config (index into MEGATRON), one task per config, cached."""
    cache = {}

    def seen(i):
        if i not in cache:
            got = megatron_pool.run("harness.meshes.thirdparty:megatron_groups", [MEGATRON[i]], (("world", 8),),
                                    deadline=LIBRARY_DEADLINE)
            cache[i] = {rank: results[0] for rank, results in got.items()}
        return cache[i]

    return seen


@pytest.mark.parametrize("item", MEGATRON, ids=_label)
def test_megatron_groups_match_the_model_of_its_order(item, megatron_seen):
    by_rank = megatron_seen(MEGATRON.index(item))
    seen = {rank: got["groups"] for rank, got in by_rank.items()}
    want = megatron_model(8, item["order"], **_sizes(item))
    assert compare(8, seen, want) == {}
    # Megatron's own ordered lists: pp in stage order, tp/dp/cp in coordinate order
    for rank, got in by_rank.items():
        for name, ranks in got["lists"].items():
            (mine,) = [g for g in want[name] if rank in g]
            assert ranks == mine, f"rank {rank}: Megatron's {name} list {ranks}, the model {mine}"


@pytest.mark.parametrize("item", MEGATRON, ids=_label)
def test_megatron_against_our_mesh_spec(item, megatron_seen):
    """Megatron's groups against our named groups (Megatron's dp is ours): with the default order
    they must agree; with another order they differ exactly where the two models say they do."""
    by_rank = megatron_seen(MEGATRON.index(item))
    spec = megatron_as_spec(8, **_sizes(item))
    ours = {theirs: spec.groups(name) for theirs, name in MEGATRON_TO_OURS.items()}
    seen = {rank: {n: got["groups"][n] for n in MEGATRON_TO_OURS} for rank, got in by_rank.items()}
    differ = compare(8, seen, ours)
    predicted = compare(8, {r: {n: next(g for g in groups if r in g) for n, groups in
                                megatron_model(8, item["order"], **_sizes(item)).items() if n in ours}
                            for r in range(8)}, ours)
    print(f"\n{_label(item)}: disagrees with MeshSpec({spec.id}) on " +
          (", ".join(f"{n} (ranks {r})" for n, r in sorted(differ.items())) or "nothing"))
    assert differ == predicted
    if item["order"] == DEFAULT_ORDER:
        assert differ == {}


# torchtitan 0.3.0 has no etp: its experts are our etp = 1
TORCHTITAN = [
    {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2, "pp": 1, "ep": 4, "spmd_backend": "spmd_types"},
    {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2, "pp": 1, "ep": 4, "spmd_backend": "spmd_types"},
    {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2, "pp": 2, "ep": 2, "spmd_backend": "partial_dtensor"},
    {"dp_replicate": 2, "dp_shard": 1, "cp": 2, "tp": 2, "pp": 1, "ep": 4, "spmd_backend": "partial_dtensor"},
]


@pytest.fixture(scope="module")
def torchtitan_seen(rank_pool):
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip(f"torchtitan is not installed: {TORCHTITAN_INSTALL}")
    with eight_ranks(rank_pool, "torch.distributed.fsdp", "torchtitan.distributed.parallel_dims") as pool:
        # one task per config: each gets the whole deadline on a loaded machine
        per = [pool.run("harness.meshes.thirdparty:torchtitan_groups", [item], (("world", 8),),
                        deadline=LIBRARY_DEADLINE) for item in TORCHTITAN]
    return {rank: [p[rank][0] for p in per] for rank in per[0]}


@pytest.mark.parametrize("item", TORCHTITAN, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items() if v != 1))
def test_torchtitan_groups_match_our_model(item, torchtitan_seen):
    i = TORCHTITAN.index(item)
    spec = MeshSpec.of(8, **{TORCHTITAN_TO_OURS.get(k, k): v for k, v in item.items() if k != "spmd_backend"}, etp=1)
    seen = {rank: got[i]["groups"] for rank, got in torchtitan_seen.items()}
    names = sorted(seen[0])
    print(f"\ntorchtitan {item['spmd_backend']} {spec.id}: groups {names}")
    assert {"pp", "batch", "loss", "dp_replicate", "cp", "tp", "ep", "efsdp"} <= set(names)
    want = {n: spec.groups(TORCHTITAN_TO_OURS.get(n, n)) for n in names}
    assert compare(8, seen, want) == {}
