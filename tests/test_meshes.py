"""The pure-Python model of mesh layouts, and bad input rejected with the rule it breaks."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.config import ConfigError
from harness.layout import MeshLayout
from harness.meshes.device_mesh import MeshSpec
from harness.names import DENSE, GROUPS


@st.composite
def specs(draw):
    """Any valid layout of up to 32 ranks: degrees of 1..4, ep a divisor of what it borrows."""
    degrees, room = {}, 32
    for name in draw(st.permutations(DENSE)):  # no dim favoured by the budget
        degrees[name] = draw(st.integers(1, max(1, min(4, room))))
        room //= degrees[name]
    etp = draw(st.sampled_from([1, degrees["tp"]]))
    lender = degrees["dp"] * degrees["cp"] * (1 if etp == degrees["tp"] else degrees["tp"])
    ep = draw(st.sampled_from([d for d in range(1, lender + 1) if lender % d == 0]))
    return MeshSpec.of(math.prod(degrees.values()), **degrees, ep=ep, etp=etp)


@given(specs())
def test_groups_of_one_name_partition_the_world_into_groups_of_its_degree(spec):
    for name in GROUPS:
        groups = spec.groups(name)
        assert sorted(r for g in groups for r in g) == list(range(spec.world))
        size = {"batch": spec.rep * spec.dp, "loss": spec.rep * spec.dp * spec.cp,
                "fsdp": spec.dp * spec.cp, "efsdp": spec.efsdp}.get(name) or getattr(spec, name)
        assert {len(g) for g in groups} == {size}


@settings(max_examples=40)
@given(specs())
def test_a_flattened_group_is_the_product_of_its_dims_and_ep_stays_in_its_lender(spec):
    for rank in range(spec.world):
        dense = spec.dense().coords(rank)
        for name, dims in (("batch", ("rep", "dp")), ("fsdp", ("dp", "cp"))):
            keep = [i for i, n in enumerate(DENSE) if n not in dims]
            same = [r for r in range(spec.world) if all(spec.dense().coords(r)[i] == dense[i] for i in keep)]
            assert spec.group_of(rank, name) == same
        lender, _ = spec.lender()
        block = set(spec.group_of(rank, "fsdp")) if lender == ("dp", "cp") else \
            {r for f in spec.group_of(rank, "fsdp") for r in spec.group_of(f, "tp")}
        assert set(spec.group_of(rank, "ep")) <= block


def test_flat_groups_follow_torch_flatten_order():
    layout = MeshLayout.of((("dp", 2), ("cp", 2), ("tp", 2)))
    # DeviceMesh docstring: mesh_3d["dp", "cp"]._flatten() is [0, 2, 4, 6] on ranks 0, 2, 4, 6
    assert layout.flat_groups(("dp", "cp")) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.flat_groups(("cp", "dp")) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_an_order_string_is_fastest_first():
    layout = MeshLayout.from_order("tp-cp-ep-dp-pp", {"tp": 2, "dp": 2, "pp": 2})
    assert layout.names == ("pp", "dp", "ep", "cp", "tp")
    assert layout.groups("tp")[0] == [0, 1] and layout.groups("pp")[0] == [0, 4]


def test_spec_round_trips_through_its_id():
    spec = MeshSpec.of(16, pp=2, dp=2, cp=2, tp=2, ep=4)
    assert MeshSpec.parse(spec.id) == spec
    assert MeshSpec.from_mesh((("pp", 2), ("dp", 2), ("cp", 2), ("tp", 2)), ep=4) == spec


@pytest.mark.parametrize("build, message", [
    (lambda: MeshSpec.of(16, dp=2, tp=4),
     "degrees pp·rep·dp·cp·tp = 1·1·2·1·4 = 8 do not multiply to the world of 16 ranks: "
     "change a degree (dp usually) so that the product is 16"),
    (lambda: MeshSpec.of(8, dp=4, tp=2, ep=8, etp=2),
     "ep=8 does not divide dp·cp = 4, the dims it borrows from when etp=2: choose an ep that divides 4, "
     "or etp=1 to borrow tp as well"),
    (lambda: MeshSpec.of(12, dp=2, tp=6, ep=8),
     "ep=8 does not divide dp·cp·tp = 12, the dims it borrows from when etp=1: choose an ep that divides 12"),
    (lambda: MeshSpec.of(8, dp_shard=8),
     "unknown mesh dim 'dp_shard': the dims are pp, rep, dp, cp, tp, ep, etp; torchtitan's 'dp_shard' is 'dp' "
     "here (harness.names); efsdp is derived: dp·cp·tp / (ep·etp)"),
    (lambda: MeshSpec.from_mesh((("dp", 2), ("sp", 4))),
     "unknown mesh dim 'sp': the dims are pp, rep, dp, cp, tp; did you mean 'tp'? (harness.names), in the layout (('dp', 2), ('sp', 4))"),
    (lambda: MeshSpec.of(8, dp=2, tp=4, etp=2),
     "etp=2 must be 1 or tp=4: experts either reuse the dense tp ranks (etp=tp) or are not tensor-parallel (etp=1)"),
    (lambda: MeshSpec.of(8, dp=8, cp=0), "cp=0 must be at least 1: a degree of 1 turns the dim off"),
    (lambda: MeshSpec.parse("dp=8"), "mesh spec 'dp=8' has no world=N: start it with the world size, "
                                           "e.g. world=8,tp=2"),
    (lambda: MeshSpec.of(8, dp=8).groups("dp_replicate"),
     "unknown mesh dim 'dp_replicate': the dims are pp, rep, dp, cp, tp, batch, loss, fsdp, efsdp, ep, etp; "
     "torchtitan's 'dp_replicate' is 'rep' here (harness.names)"),
])
def test_bad_input_is_rejected_with_the_rule_and_the_fix(build, message):
    with pytest.raises(ConfigError) as err:
        build()
    assert str(err.value) == message
