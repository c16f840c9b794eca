"""DeviceMesh groups on real ranks against the pure-Python model of the layout."""
import pytest

from harness.layout import MeshLayout
from harness.matrix import mesh

MESHES = ["tp=1", "tp=4", "dp=2,tp=2", "dp=4,tp=2", "dp=2,tp=4", "pp=2,dp=2,tp=2", "dp=2,cp=2,tp=2"]


@pytest.mark.parametrize("text", MESHES)
def test_device_mesh_matches_the_row_major_model(text, rank_pool):
    dims = mesh(text)
    layout = MeshLayout.of(dims)
    seen = rank_pool.run("harness.pool.tasks:describe_mesh", None, dims)
    assert sorted(seen) == list(range(layout.world))
    for rank, got in seen.items():
        assert got["coords"] == layout.coords(rank)
        for name in layout.names:
            (mine,) = [g for g in layout.groups(name) if rank in g]
            assert got["groups"][name] == mine


@pytest.mark.parametrize("text", ["dp=2,tp=4", "dp=4,tp=2"])
@pytest.mark.parametrize("dim", ["dp", "tp"])
def test_each_dim_group_carries_its_own_traffic(text, dim, rank_pool):
    dims = mesh(text)
    layout = MeshLayout.of(dims)
    sums = rank_pool.run("harness.pool.tasks:all_reduce_rank", dim, dims)
    for rank, total in sums.items():
        (group,) = [g for g in layout.groups(dim) if rank in g]
        assert total == sum(group)


@pytest.mark.parametrize("cell, extra", [("dp=4", "edp=2,ep=2"), ("dp=2,tp=2", "ep=4"), ("dp=8", "tp=2,dp=2")])
def test_extra_meshes_over_one_world_match_the_model(cell, extra, rank_pool):
    """A sparse (expert) mesh beside the dense one, or a smaller mesh a checkpoint loads under."""
    dims, other = mesh(cell), mesh(extra)
    layout = MeshLayout.of(other)
    seen = rank_pool.run("harness.pool.tasks:describe_mesh", other, dims, extra_meshes=[other])
    for rank, got in seen.items():
        if rank >= layout.world:
            assert got is None
            continue
        assert got["coords"] == layout.coords(rank)
        for name in layout.names:
            (mine,) = [g for g in layout.groups(name) if rank in g]
            assert got["groups"][name] == mine
