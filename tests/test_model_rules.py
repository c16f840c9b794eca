"""Model cells' rules, ids and piece placements, without ranks."""
import pytest
import torch
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor import Shard as DShard

from harness.config import Config, ConfigError
from harness.layout import Shard
from harness.model import ModelCase, model_cells, register_model
from harness.model.placement import placements_of, plain_activation
from harness.model.train import aliases
from harness.registry import register_implementation
from harness.resolve import check_config

register_model("rules", "tests.model_handwritten:CASE")


def test_ids_name_model_impl_mesh_dtype_steps_and_parse_back():
    cells = model_cells("rules", impls=["megatron"], meshes=["dp=2,tp=2"], dtypes=["bf16"], steps=2)
    assert [c.id for c in cells] == ["rules-megatron-dp2.tp2-bf16-plain-steps2-seed0"]
    assert Config.parse(cells[0].id) == cells[0]
    assert model_cells("rules", meshes=["tp=2"])[0].size("steps") == 3  # the case's default


@pytest.mark.parametrize("mesh, switches, message", [
    ({"dp": 2, "xp": 2}, {}, "mesh dim 'xp' is not a model mesh dim"),
    ({"tp": 2, "dp": 2}, {}, "out of order: write them as dp,tp"),
    ({"cp": 2}, {}, "the case declares no seq_dim"),
    ({"dp": 3}, {}, "does not split on dim 0 over the 3 data-parallel ranks"),
    ({"dp": 2}, {"ep": "3"}, "ep=3 does not divide"),
    ({"dp": 2}, {"emesh": "dense"}, "switch 'emesh' is not a model switch"),
])
def test_invalid_model_cells_name_the_rule(mesh, switches, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_config(Config("rules", "megatron", mesh, "fp32", {"steps": 1}, switches))


def test_an_implementation_declares_the_meshes_it_supports():
    case = ModelCase(build=torch.nn.Linear, batch=None, loss=None, parallelize={"tponly": None},
                     supports={"tponly": lambda spec: "a TP-only plan" if spec.dp > 1 else None})
    from harness.model.plan import check_impl

    with pytest.raises(ConfigError, match="does not support this mesh: a TP-only plan"):
        check_impl(case, Config("rules", "tponly", {"dp": 2}, "fp32", {"steps": 1}))
    check_impl(case, Config("rules", "tponly", {"tp": 2}, "fp32", {"steps": 1}))


def test_a_component_implementation_may_declare_its_own_rules():
    register_implementation("tp", "picky", "harness.parallel.tp:run", validate="tests.test_model_rules:only_tp2")
    cfg = Config("tp", "picky", {"tp": 4}, "fp32", dict(b=4, s=8, h=16, f=32, v=40), {"op": "mlp"})
    with pytest.raises(ConfigError, match="picky runs tp=2 only"):
        check_config(cfg)
    check_config(cfg.replace(mesh={"tp": 2}))


def only_tp2(cfg):
    if cfg.degree("tp") != 2:
        raise ConfigError(f"{cfg.id}: picky runs tp=2 only")


def test_bad_cases_and_registrations_say_what_to_fix():
    with pytest.raises(ValueError, match="lowercase letters and digits"):
        ModelCase(build=None, batch=None, loss=None, parallelize={"My-Plan": None})
    with pytest.raises(ValueError, match="choose one of"):
        ModelCase(build=None, batch=None, loss=None, parallelize={"a": None}, mixed_precision="fp8")
    with pytest.raises(TypeError, match="not a harness.model.ModelCase"):
        register_model("nope", "tests.model_handwritten:build")
    with pytest.raises(ValueError, match=r"preload=\('transformers', 3\) must name modules, e.g. preload=\('transformers',\)"):
        register_model("heavy", "tests.model_handwritten:CASE", preload=("transformers", 3))
    assert register_model("light", "tests.model_handwritten:CASE", preload="json").preload == ("json",)
    # two test modules once registered different cases under one name: the later silently replaced
    # the earlier's implementations, and its cells failed with "no implementation"
    register_model("rules", "tests.model_handwritten:CASE")  # the same case again: a re-import, fine
    with pytest.raises(ValueError, match="'rules' is already registered for tests.model_handwritten:CASE"):
        register_model("rules", "tests.model_handtp:HANDTP")
    with pytest.raises(ValueError, match="already registered for a component"):
        register_model("tp", "tests.model_handwritten:CASE")


def test_dtensor_placements_map_to_the_cells_dims():
    degrees = {"dp": 2, "cp": 1, "tp": 2}
    assert placements_of(("dp", "tp"), (DShard(0), DShard(1)), degrees) == {"dp": Shard(0), "tp": Shard(1)}
    assert placements_of(("fsdp",), (DShard(0),), degrees) == {"dp": Shard(0)}  # dp·cp, cp of 1
    assert placements_of(("fsdp",), (DShard(0),), {"dp": 2, "cp": 2}) is None  # two dims: not a Piece
    assert placements_of(("tp",), (Partial(),), degrees) is None
    assert placements_of(("rep", "dp"), (Replicate(), DShard(0)), degrees) == {"dp": Shard(0)}
    assert placements_of(("ep",), (DShard(0),), {"dp": 2, "ep": 2}) is None  # the expert mesh: gathered
    # ModelCase.placements may name harness.layout's Shard as well as torch's
    assert placements_of(("tp",), (Shard(1),), degrees) == placements_of(("tp",), (DShard(1),), degrees)


def test_a_plain_activation_is_placed_by_its_logical_shape():
    local = torch.zeros(4, 8, 16)  # rows over dp=2, last dim a tp=2 shard of 32
    piece = plain_activation(local, {"dp": 2, "tp": 2}, {"dp": Shard(0)}, (8, 8, 32))
    assert piece.shape == (8, 8, 32) and piece.placements == {"dp": Shard(0), "tp": Shard(2)}
    assert plain_activation(local, {"dp": 2, "tp": 2}, {"dp": Shard(0)}, (8, 8, 48)) is None


def test_tied_parameters_are_reported_under_their_first_name():
    from harness.examples.titan import Transformer

    names = aliases(Transformer(tied=True))
    assert names["output.weight"] == "tok_embeddings.weight" and names["norm.weight"] == "norm.weight"
