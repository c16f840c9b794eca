"""Config ids round-trip, and invalid configs are rejected with the rule they break."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.config import DTYPES, Config, ConfigError
from harness.resolve import check_config

names = st.text("abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=6)
values = st.text("abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=8)
configs = st.builds(
    Config,
    component=values,
    impl=values,
    mesh=st.dictionaries(names, st.integers(1, 64), min_size=1, max_size=4).map(lambda d: tuple(d.items())),
    dtype=st.sampled_from(DTYPES),
    sizes=st.dictionaries(names, st.integers(1, 10**6), max_size=6),
    switches=st.dictionaries(names, values, max_size=4),
    seed=st.integers(0, 2**31),
)


@given(configs)
def test_id_round_trips(cfg):
    assert Config.parse(cfg.id) == cfg
    assert Config.parse(cfg.id).id == cfg.id


@given(configs)
def test_id_is_a_pytest_k_identifier(cfg):
    from _pytest.mark.expression import Expression

    # -k evaluates the id as one identifier: it must compile and match itself
    assert Expression.compile(cfg.id).evaluate(lambda ident: ident == cfg.id)


def test_mesh_order_is_kept_sizes_and_switches_are_canonical():
    a = Config("tp", "ours", {"dp": 2, "tp": 4}, "fp32", {"h": 16, "b": 4}, {"op": "mlp"})
    b = Config("tp", "ours", {"dp": 2, "tp": 4}, "fp32", {"b": 4, "h": 16}, {"op": "mlp"})
    c = Config("tp", "ours", {"tp": 4, "dp": 2}, "fp32", {"b": 4, "h": 16}, {"op": "mlp"})
    assert a == b and a.id == b.id
    assert a != c and "dp2.tp4" in a.id and "tp4.dp2" in c.id
    assert a.world == 8 and a.degree("cp") == 1


@pytest.mark.parametrize("text, message", [
    ("tp-ours-tp2-fp32", "expected 7"),
    ("tp-ours-tp2-fp33-op_mlp-b4-seed0", "dtype 'fp33'"),
    ("tp-ours-tpx-fp32-op_mlp-b4-seed0", "mesh item 'tpx'"),
    ("tp-ours-tp2-fp32-opmlp-b4-seed0", "switch 'opmlp'"),
    ("tp-ours-tp2-fp32-op_mlp-b4-s0", "seed<N>"),
    ("tp-ours-tp0-fp32-op_mlp-b4-seed0", "at least 1"),
])
def test_bad_ids_name_the_problem(text, message):
    with pytest.raises(ConfigError, match=message):
        Config.parse(text)


SIZES = dict(b=4, s=8, h=16, f=32, v=40)


@pytest.mark.parametrize("mesh, sizes, switches, message", [
    ({"dp": 3, "tp": 1}, SIZES, {"op": "mlp"}, r"dp=3 does not divide batch b=4"),
    ({"tp": 32}, SIZES, {"op": "mlp"}, r"tp=32 leaves a rank an empty chunk of h=16"),
    ({"tp": 16}, SIZES, {"op": "mlp"}, r"tp=16 leaves a rank an empty chunk of v=40"),
    ({"tp": 4}, dict(SIZES, h=5), {"op": "mlp"}, r"empty chunk of h=5"),
    ({"tp": 2}, SIZES, {"op": "conv"}, r"unknown tp op 'conv'"),
    ({"cp": 2}, SIZES, {"op": "mlp"}, r"tp cells take mesh dims dp and tp"),
])
def test_invalid_tp_configs_are_rejected_before_any_rank_runs(mesh, sizes, switches, message):
    with pytest.raises(ConfigError, match=message):
        check_config(Config("tp", "ours", mesh, "fp32", sizes, switches))


RING = dict(b=2, s=24, h=16, q=4, d=4)
RING_SWITCHES = {"mask": "causal", "layout": "zigzag", "gqa": "on"}


@pytest.mark.parametrize("mesh, sizes, switches, message", [
    ({"cp": 8}, RING, RING_SWITCHES, r"sequence s=24 does not split into 2·cp=16 zigzag chunks: choose s a multiple of 16"),
    ({"cp": 5}, RING, dict(RING_SWITCHES, layout="contig"), r"sequence s=24 does not split into cp=5 chunks"),
    ({"cp": 2, "tp": 3}, RING, dict(RING_SWITCHES, gqa="off"), r"tp=3 does not divide query heads q=4"),
    ({"cp": 2, "tp": 2}, dict(RING, q=2), RING_SWITCHES, r"tp=2 does not divide query heads q=2|tp=2 does not divide the K/V heads \(1\)"),
    ({"cp": 2}, dict(RING, q=3), RING_SWITCHES, r"query heads q=3 must be even"),
    ({"cp": 2, "pp": 2}, RING, RING_SWITCHES, r"ringattn cells take mesh dims dp, cp and tp"),
    ({"cp": 2}, RING, dict(RING_SWITCHES, layout="striped"), r"layout in \('contig', 'zigzag'\)"),
])
def test_invalid_ring_attention_configs_name_the_rule(mesh, sizes, switches, message):
    with pytest.raises(ConfigError, match=message):
        check_config(Config("ringattn", "ours", mesh, "fp32", sizes, switches))


def test_unknown_component_and_implementation():
    with pytest.raises(ConfigError, match="unknown component 'nope'"):
        check_config(Config("nope", "ours", {"tp": 1}, "fp32"))
    with pytest.raises(ConfigError, match="no implementation 'mine' of tp"):
        check_config(Config("tp", "mine", {"tp": 1}, "fp32", SIZES, {"op": "mlp"}))


def test_mesh_larger_than_pool_names_the_option():
    with pytest.raises(ConfigError, match="--pool-size 16"):
        check_config(Config("tp", "ours", {"dp": 2, "tp": 8}, "fp32", SIZES, {"op": "mlp"}), pool_size=8)
