"""One kind of mesh declaration (:class:`harness.layout.MeshDeclaration`): what a component's
``meshes(cfg)`` returns (a dims tuple, a ``MeshLayout`` or a ``MeshSpec``) is made one in the registry,
and the pool, torchrun and the ranks build and look it up without asking which kind it is; a value
that is no mesh is one line on its cell, not an INTERNALERROR of the whole session."""
import os

import pytest

from harness.layout import MeshLayout, declared
from harness.meshes import MeshSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# tp's code under four names, each declaring one further mesh its own way; the ranks hold each at its
# size before running tp (a mesh declared but not built is a KeyError there: red)
DECLARING = '''
from harness.layout import MeshLayout
from harness.meshes import MeshSpec
from harness.paths import load
from harness.registry import get

SPEC = MeshSpec.of(2, dp=2)


def as_tuple(cfg):
    return [(("w", 2),)]


def as_layout(cfg):
    return [MeshLayout(("w",), (2,))]


def as_spec(cfg):
    return [SPEC]


def as_text(cfg):
    return ["w=2"]


def run(ctx, cfg):
    if cfg.component == "declspec":
        assert ctx.meshes_for(SPEC).dense["dp"].size() == 2
    else:
        assert ctx.mesh("w=2").size() == 2 and ctx.mesh((("w", 2),)).get_group("w").size() == 2
    return load(get("tp").implementations["ours"].run)(ctx, cfg)
'''
CONFTEST = '''
from harness.registry import Component, Implementation, get, register_component

tp = get("tp")
for how in ("tuple", "layout", "spec", "text"):
    register_component(Component(f"decl{how}", tp.reference, tp.validate, tp.reduction, meshes=f"declaring:as_{how}",
                                 calibration=tp.calibration,
                                 implementations={"ours": Implementation("ours", "declaring:run")}))
'''
CASES = '''
import pytest
from harness.config import Config
from reference.tp import SIZES

CELLS = [Config(f"decl{how}", "ours", {"tp": 2}, "fp32", SIZES, {"op": "mlp"})
         for how in ("tuple", "layout", "spec", "text")]

@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_declared(cfg, parity):
    parity(cfg)
'''


def test_every_kind_of_declaration_is_built_and_a_string_is_one_line_on_its_cell(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makepyfile(declaring=DECLARING, test_cells=CASES)
    pytester.makeconftest(CONFTEST)
    result = pytester.runpytest_subprocess("--pool-size", "2", "-p", "no:cacheprovider")
    text = result.stdout.str()
    assert "INTERNALERROR" not in text  # the tree before MeshDeclaration ended the session here
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines([
        "invalid config: declaring:as_text returned, for decltext-ours-tp2-*, 'w=2' is not a mesh: declare a mesh "
        "as its dims, ((name, degree), ...) such as (('w', 4),), or as a harness.meshes.MeshSpec"])
    assert "Traceback" not in text and "registry.py" not in text


def test_declared_takes_dims_layouts_and_specs_as_one_kind():
    spec = MeshSpec.of(4, dp=2, tp=2)
    assert declared((("w", 4),)) == declared([["w", 4]]) == MeshLayout(("w",), (4,))
    assert declared(MeshLayout(("dp", "tp"), (2, 2))).id == "dp=2,tp=2"
    assert declared(spec) is spec
    for kind in (declared((("w", 4),)), spec):  # what the pool and the ranks ask of either
        assert (kind.world, callable(kind.build), isinstance(kind.id, str)) == (4, True, True)


@pytest.mark.parametrize("bad", ["w=4", None, (("w", 0),), (), (("w",),), 4])
def test_a_value_that_is_no_mesh_says_what_a_mesh_may_be(bad):
    with pytest.raises(TypeError, match=r"is not a mesh: declare a mesh as its dims, \(\(name, degree\), \.\.\.\)"):
        declared(bad)
