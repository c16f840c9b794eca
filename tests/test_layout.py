"""The pure-Python mesh model and shard assembly (no ranks needed)."""
import itertools

import pytest
import torch

from harness.layout import AssemblyError, MeshLayout, Piece, Shard, assemble, chunk_bounds, piece_index, take

LAYOUTS = [(("tp",), (1,)), (("tp",), (3,)), (("dp", "tp"), (2, 4)), (("dp", "tp"), (4, 2)), (("a", "b", "c"), (2, 3, 2))]


@pytest.mark.parametrize("names, shape", LAYOUTS)
def test_coords_are_row_major_and_groups_partition_the_ranks(names, shape):
    layout = MeshLayout(names, shape)
    expected = list(itertools.product(*(range(d) for d in shape)))  # row-major by definition
    assert [layout.coords(r) for r in range(layout.world)] == expected
    for r in range(layout.world):
        assert layout.rank_of(layout.coords(r)) == r
    for axis, name in enumerate(names):
        groups = layout.groups(name)
        assert sorted(r for g in groups for r in g) == list(range(layout.world))
        for group in groups:
            coords = [layout.coords(r) for r in group]
            assert [c[axis] for c in coords] == list(range(shape[axis]))
            assert len({c[:axis] + c[axis + 1:] for c in coords}) == 1


@pytest.mark.parametrize("size, n", [(32, 3), (16, 3), (5, 4), (8, 8), (7, 2)])
def test_chunk_bounds_match_torch_chunk(size, n):
    chunks = torch.arange(size).chunk(n)
    for i in range(n):
        lo, hi = chunk_bounds(size, n, i)
        want = chunks[i].tolist() if i < len(chunks) else []
        assert list(range(lo, hi)) == want


@pytest.mark.parametrize("placements", [
    {"tp": Shard(0)}, {"tp": Shard(1)}, {"dp": Shard(0), "tp": Shard(1)}, {"dp": Shard(0), "tp": Shard(0)},
    {"tp": Shard(0, packs=2)}, {"tp": Shard(1, zigzag=True)}, {},
])
@pytest.mark.parametrize("mesh", [(("tp",), (3,)), (("dp", "tp"), (2, 3)), (("dp", "tp"), (2, 4))])
def test_take_then_assemble_restores_the_tensor(placements, mesh):
    layout = MeshLayout(*mesh)
    if "dp" in placements and "dp" not in layout.names:
        pytest.skip("placement names a dim this mesh lacks")
    full = torch.randn(12, 18)
    pieces = {}
    for r in range(layout.world):
        local = full
        for name, n, c in zip(layout.names, layout.shape, layout.coords(r)):
            local = take(local, placements.get(name), n, c)
        pieces[r] = Piece(local, tuple(full.shape), placements)
    out = assemble("x", pieces, layout)
    assert torch.equal(out.tensor, full) and out.replica_gap == 0.0


def test_a_shard_cut_within_another_applies_after_it_whatever_the_mesh_order():
    """FSDP2 over TP (torch's _StridedShard): tp cuts the rows first, dp cuts each tp shard; on
    dp=2, tp=2 coordinate (dp i, tp j) holds rows 4j+2i and 4j+2i+1 of 8."""
    layout = MeshLayout(("dp", "tp"), (2, 2))
    placements = {"dp": Shard(0, within="tp"), "tp": Shard(0)}
    full = torch.arange(8)
    rows = {r: piece_index(Piece(full, (8,), placements), layout, r)[0] for r in range(4)}
    assert {r: full[i].tolist() for r, i in rows.items()} == {0: [0, 1], 1: [4, 5], 2: [2, 3], 3: [6, 7]}  # rank 2i+j
    out = assemble("w", {r: Piece(full[i], (8,), placements) for r, i in rows.items()}, layout)
    assert torch.equal(out.tensor, full)
    with pytest.raises(ValueError, match="within='cp'"):
        piece_index(Piece(full, (8,), {"dp": Shard(0, within="cp")}), layout, 0)


def test_packed_shard_holds_a_chunk_of_each_half():
    full = torch.arange(12)  # halves [0..5] and [6..11]
    assert take(full, Shard(0, packs=2), 3, 1).tolist() == [2, 3, 8, 9]


def test_zigzag_shard_holds_chunks_r_and_2n_minus_1_minus_r():
    full = torch.arange(8)
    assert take(full, Shard(0, zigzag=True), 2, 0).tolist() == [0, 1, 6, 7]
    assert take(full, Shard(0, zigzag=True), 2, 1).tolist() == [2, 3, 4, 5]


def test_disagreeing_replicas_are_measured():
    layout = MeshLayout(("tp",), (2,))
    out = assemble("w", {0: Piece(torch.ones(3), (3,)), 1: Piece(torch.tensor([1.0, 1.5, 1.0]), (3,))}, layout)
    assert out.replica_gap == 0.5 and out.replica_gap_ranks == (0, 1)


def test_wrong_piece_shape_is_an_assembly_error():
    layout = MeshLayout(("tp",), (2,))
    pieces = {r: Piece(torch.ones(3), (8,), {"tp": Shard(0)}) for r in range(2)}
    with pytest.raises(AssemblyError, match="rank 0 holds a piece of shape"):
        assemble("w", pieces, layout)
