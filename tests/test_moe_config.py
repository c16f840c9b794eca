"""MoE: bad configs are rejected with the rule they break, before any rank runs; the edge-case
problems really are the edge cases they claim; the dp2ep expert placement assembles."""
import pytest
import torch

from harness.config import Config, ConfigError
from harness.layout import MeshLayout, Piece, Shard, assemble, take
from harness.resolve import check_config
from reference.moe import SIZES, capacity, keep_mask, make_problem, moe

OK = dict(emesh="dense", cap="100", score="softmax", norm="off", route="rand")


def cfg(mesh, e=8, k=2, **switches):
    return Config("moe", "ours", mesh, "fp32", dict(SIZES, e=e, k=k), dict(OK, **switches))


@pytest.mark.parametrize("config, message", [
    (cfg({"ep": 4}, e=6), r"e=6 experts do not split over ep=4: each ep rank holds whole experts, choose e a multiple of 4"),
    (cfg({"dp": 4}, e=6, emesh="ep4"), r"e=6 experts do not split over ep=4"),
    (cfg({"ep": 2}, e=4, k=5), r"top-k k=5 is larger than the number of experts e=4: choose k <= e"),
    (cfg({"ep": 2}, cap="0"), r"capacity factor cap_0 must be > 0: give it in percent"),
    (cfg({"ep": 2}, cap="full"), r"capacity factor cap_full must be > 0"),
    (cfg({"dp": 4}, emesh="ep3"), r"ep=3 does not fit the data-parallel ranks it borrows from \(dp=4 x tp=1 = 4, row-major\)"),
    (cfg({"dp": 4}, emesh="ep8"), r"ep=8 does not fit the data-parallel ranks it borrows from"),
    (cfg({"dp": 2, "tp": 2}, emesh="ep3"), r"ep=3 does not fit the data-parallel ranks it borrows from \(dp=2 x tp=2"),
    (cfg({"dp": 3, "tp": 2}, emesh="ep2etp2"), r"ep=2 does not fit the data-parallel dim it borrows from: dp=3 is not a multiple of ep=2"),
    (cfg({"dp": 2, "tp": 2}, emesh="ep2etp4"), r"etp=4 must equal the dense tp=2"),
    (cfg({"ep": 2, "dp": 2}), r"moe cells with emesh_dense take mesh dims ep and etp, not \['dp'\]"),
    (cfg({"ep": 2}, emesh="ep2"), r"moe cells with emesh_ep2 take mesh dims dp and tp, not \['ep'\]"),
    (cfg({"ep": 2}, emesh="experts"), r"switch emesh='experts': use 'dense'"),
    (cfg({"ep": 5}, e=10), r"t=24 tokens do not split over the 5 ranks that hold distinct tokens"),
    (cfg({"ep": 2, "etp": 3}, e=8), r"etp=3 does not divide the expert FFN dim f=16"),
    (cfg({"ep": 2}, e=4, k=3, route="skew"), r"route_skew starves the last half of the experts: k=3 must be at most e/2=2"),
    (cfg({"ep": 2}, score="relu"), r"score in \('softmax', 'sigmoid'\)"),
])
def test_invalid_moe_configs_name_the_rule(config, message):
    with pytest.raises(ConfigError, match=message):
        check_config(config)


def test_matrix_cells_are_valid_and_many():
    from cases.test_moe import CELLS

    assert len(CELLS) >= 80 and len({c.id for c in CELLS}) == len(CELLS)
    for c in CELLS:
        check_config(c, pool_size=8)


def _routing(config):
    problem = make_problem(config)
    params = {k: t.double() for k, t in problem.params.items()}
    return moe(config, problem.x.double(), params)


def test_edge_problems_route_as_they_claim():
    """The edge cells test what they say: route_one sends every token's first choice to expert 0,
    route_skew leaves the last half of the experts (so the last ep rank) without a token."""
    from cases.test_moe import CELLS

    edges = [c for c in CELLS if c.switch("route") != "rand"]
    assert {c.switch("route") for c in edges} == {"one", "skew"}
    for c in edges:
        route = _routing(c)["route"]
        if c.switch("route") == "one":
            assert (route[:, 0] == 0).all(), c.id
        else:
            assert (route < c.size("e") // 2).all(), c.id


def test_capacity_cells_drop_tokens_and_dropless_cells_do_not():
    from cases.test_moe import CELLS

    dropping = 0
    for c in CELLS:
        dropped = _routing(c)["dropped"]
        if capacity(c) is None:
            assert dropped.sum() == 0, c.id
        dropping += bool(dropped.sum() > 0)
    assert dropping >= 30  # the capacity rule is exercised, not only declared


def test_keep_mask_is_first_come_first_served_over_the_batch():
    route = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1]])
    kept = keep_mask(route, experts=3, cap=2)
    assert kept.tolist() == [[True, True], [True, True], [True, False], [False, False]]


@pytest.mark.parametrize("dense, inner", [(("dp", 4), 2), (("dp", 8), 4), (("dp", 4), 4)])
def test_inner_shard_is_split_over_the_inner_factor_and_replicated_over_the_outer(dense, inner):
    """Experts over ep borrowed from dp (edp x ep, row-major): rank r holds chunk r % ep."""
    layout = MeshLayout((dense[0],), (dense[1],))
    full = torch.arange(8 * 3.0).view(8, 3)
    shard = Shard(0, inner=inner)
    pieces = {r: Piece(take(full, shard, dense[1], r), (8, 3), {dense[0]: shard}) for r in range(layout.world)}
    for r in range(layout.world):
        assert torch.equal(pieces[r].tensor, full.chunk(inner)[r % inner])
    out = assemble("w", pieces, layout)
    assert torch.equal(out.tensor, full) and out.replica_gap == 0.0
