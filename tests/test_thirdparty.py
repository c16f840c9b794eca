"""Known divergences as data (strict xfail), and the skips of the third-party tp implementations."""
import os
import subprocess
import sys

import pytest

from harness.config import Config
from harness.registry import Implementation, get, modules, register_implementation, unresolved
from parallel import thirdparty
from reference.tp import SIZES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tp_cell(impl: str, mesh=(("tp", 3),), dtype="fp32", **switches) -> Config:
    return Config("tp", impl, mesh, dtype, SIZES, switches or {"op": "mlp"})


def test_an_implementation_declares_its_known_divergences_by_path():
    impl = Implementation("x", "parallel.tp:run", xfail="parallel.thirdparty:megatron_xfail")
    assert "in place" in impl.xfail_reason(tp_cell("megatron", op="xent"))
    assert impl.xfail_reason(tp_cell("megatron", dtype="bf16", op="xent")) is None
    assert Implementation("x", "parallel.tp:run").xfail_reason(tp_cell("x")) is None


def test_the_thirdparty_implementations_are_registered_with_paths_that_resolve():
    tp = get("tp")
    assert {"hf", "megatron"} <= set(tp.implementations)
    for name in ("hf", "megatron"):
        impl = tp.implementations[name]
        assert impl.xfail and impl.skip
        assert "parallel.thirdparty" in modules([tp_cell(name)])  # preloaded like skip paths


def test_an_unresolvable_xfail_path_is_named(monkeypatch):
    monkeypatch.setattr(get("tp"), "implementations", dict(get("tp").implementations))
    monkeypatch.setattr("harness.registry._REGISTERED", [])
    register_implementation("tp", "mine", "parallel.tp:run", xfail="nowhere.at_all:reason")
    (problem,) = unresolved()
    assert "implementation tp/mine: xfail path 'nowhere.at_all:reason' does not resolve" in problem


def test_skip_functions_import_and_answer_without_the_libraries():
    """The parent resolves skip paths, and the zygote preloads the run modules, with neither
    library importable: both must import, and every cell skips with the install command."""
    code = """
import sys
sys.modules["transformers"] = None   # import transformers now raises ImportError; find_spec says None
sys.modules["megatron"] = None
import parallel.tp_hf, parallel.tp_megatron
from harness.config import Config
from parallel.thirdparty import hf_skip, megatron_skip
from reference.tp import SIZES
cfg = Config("tp", "hf", (("tp", 2),), "fp32", SIZES, {"op": "mlp", "style": "colrow"})
print(hf_skip(cfg))
print(megatron_skip(cfg.replace(impl="megatron", switches={"op": "mlp"})))
"""
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "transformers is not installed: pip install -e '.[thirdparty]'",
        "megatron-core is not installed: pip install -e '.[thirdparty]'",
    ]


def test_megatron_even_division_skip_quotes_megatrons_own_message():
    utils = pytest.importorskip("megatron.core.utils")
    reason = thirdparty.megatron_skip(tp_cell("megatron", op="mlp"))  # f=32 over tp=3
    with pytest.raises(AssertionError) as refused:
        utils.divide(32, 3)
    assert str(refused.value) in reason
    assert thirdparty.megatron_skip(tp_cell("megatron", mesh=(("tp", 4),), op="mlp")) is None


def test_hf_runs_only_the_styles_it_names_for_an_op():
    pytest.importorskip("transformers")
    assert thirdparty.hf_skip(tp_cell("hf", op="mlp", style="colrow")) is None
    assert "style one of" in thirdparty.hf_skip(tp_cell("hf", op="mlp", style="embedrow"))


CASES = """
import pytest
from harness.matrix import cells
from reference.tp import SIZES

CELLS = cells("tp", impls=["buggy", "fixed"], meshes=["tp=2"], dtypes=["fp32"], sizes=SIZES,
              switches={"op": ["mlp"]})

@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_tp(cfg, parity):
    parity(cfg)
"""


def test_declared_divergences_run_as_strict_xfail_and_an_upstream_fix_says_remove_the_entry(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makepyfile(test_cells=CASES)
    pytester.makepyfile(impls='''
import parallel.tp as tp

def buggy(ctx, cfg):
    right, tp.row_parallel = tp.row_parallel, lambda x, w, b, group: tp.F.linear(x, w) + b  # all-reduce forgotten
    try:
        return tp.run(ctx, cfg)
    finally:  # the rank serves later cells too
        tp.row_parallel = right

def declared(cfg):
    return "drops the row-parallel all-reduce"
''')
    pytester.makeconftest('''
from harness.registry import register_implementation
register_implementation("tp", "buggy", "impls:buggy", xfail="impls:declared")
register_implementation("tp", "fixed", "parallel.tp:run", xfail="impls:declared")   # "fixed upstream"
''')
    result = pytester.runpytest_subprocess("--pool-size", "2", "-p", "no:cacheprovider", "-rxX")
    result.assert_outcomes(xfailed=1, failed=1)
    result.stdout.fnmatch_lines(["XFAIL*buggy*known divergence of buggy: drops the row-parallel all-reduce*"])
    result.stdout.fnmatch_lines(["*XPASS(strict)*known divergence of fixed*remove its entry from impls:declared*"])
    assert not list((pytester.path / "golden").rglob("*buggy*"))  # a divergent cell writes no golden
