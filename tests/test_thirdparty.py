"""Known divergences as data (strict xfail), and the skips of the third-party tp implementations."""
import os
import subprocess
import sys

import pytest

from harness.config import Config
from harness.registry import get, preload_modules, register_implementation, unresolved
from harness.resolve import resolve
from harness.parallel import thirdparty, thirdparty_moe
from reference.tp import SIZES
from tests.project import imported_modules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tp_cell(impl: str, mesh=(("tp", 3),), dtype="fp32", **switches) -> Config:
    return Config("tp", impl, mesh, dtype, SIZES, switches or {"op": "mlp"})


def test_an_implementation_declares_its_known_divergences_by_path():
    assert get("tp").implementations["megatron"].xfail == "harness.parallel.thirdparty:megatron_xfail"
    assert "in place" in thirdparty.megatron_xfail(tp_cell("megatron", op="xent"))
    assert thirdparty.megatron_xfail(tp_cell("megatron", dtype="bf16", op="xent")) is None
    # the cell's disposition says it, where megatron-core is installed (else the cell is skipped)
    xent = resolve(tp_cell("megatron", op="xent")).disposition
    assert xent.kind == "skip" or (xent.kind == "xfail" and "in place" in xent.reason and xent.strict), xent
    assert resolve(tp_cell("megatron", dtype="bf16", op="xent")).disposition.kind in ("run", "skip")


def test_the_thirdparty_implementations_are_registered_with_paths_that_resolve():
    tp = get("tp")
    assert {"hf", "megatron"} <= set(tp.implementations)
    for name in ("hf", "megatron"):
        impl = tp.implementations[name]
        assert impl.xfail and impl.skip
        assert "harness.parallel.thirdparty" in preload_modules([tp_cell(name)])  # preloaded like skip paths


def test_an_unresolvable_xfail_path_is_named(monkeypatch):
    monkeypatch.setattr(get("tp"), "implementations", dict(get("tp").implementations))
    monkeypatch.setattr("harness.registry._REGISTERED", [])
    register_implementation("tp", "mine", "harness.parallel.tp:run", xfail="nowhere.at_all:reason")
    (problem,) = unresolved()
    assert "implementation tp/mine: xfail path 'nowhere.at_all:reason' does not resolve" in problem


def test_skip_functions_import_and_answer_without_the_libraries():
    """The parent resolves skip paths, and the zygote preloads the run modules, with neither
    library importable: both must import, and every cell skips with the install command."""
    code = """
import sys
sys.modules["transformers"] = None   # import transformers now raises ImportError; find_spec says None
sys.modules["megatron"] = None
import harness.parallel.tp_hf, harness.parallel.tp_megatron
from harness.config import Config
from harness.parallel.thirdparty import hf_skip, megatron_skip
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

CELLS = cells("tp", impls=["buggy", "held", "another", "fixed"], meshes=["tp=2"], dtypes=["fp32"], sizes=SIZES,
              switches={"op": ["mlp"]})

@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_tp(cfg, parity):
    parity(cfg)
"""


def test_declared_divergences_run_as_strict_xfail_held_to_their_first_line_and_an_upstream_fix_says_remove_the_entry(
        pytester, monkeypatch):
    """One bug (the column-parallel input gradient left unreduced) declared three ways: a plain reason (any
    failure), a ``Known`` whose ``shows`` is where it starts (xfail), and a ``Known`` whose ``shows``
    is another bug's (a failure naming both); and the right code declared (XPASS, strict)."""
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makepyfile(test_cells=CASES)
    pytester.makepyfile(impls='''
from harness.known import Known

def declared(cfg):
    return "the column-parallel input gradient is never all-reduced"

def held(cfg):
    return Known("the column-parallel input gradient is never all-reduced", shows=r"^first diverging event: bwd fc1 ")

def another(cfg):
    return Known("the row-parallel output is never all-reduced", shows=r"^first diverging event: fwd fc2 ")
''')
    buggy = "tests.planted:tp_column_backward_unreduced"
    pytester.makeconftest(f'''
from harness.registry import register_implementation
register_implementation("tp", "buggy", "{buggy}", xfail="impls:declared")
register_implementation("tp", "held", "{buggy}", xfail="impls:held")
register_implementation("tp", "another", "{buggy}", xfail="impls:another")
register_implementation("tp", "fixed", "harness.parallel.tp:run", xfail="impls:declared")   # "fixed upstream"
''')
    result = pytester.runpytest_subprocess("--pool-size", "2", "-p", "no:cacheprovider", "-rxXf")
    result.assert_outcomes(xfailed=2, failed=2)
    result.stdout.fnmatch_lines(["XFAIL*buggy*known divergence of buggy: the column-parallel input gradient*"])
    result.stdout.fnmatch_lines(["XFAIL*held*known divergence of held: the column-parallel input gradient*"])
    result.stdout.fnmatch_lines(["*XPASS(strict)*known divergence of fixed*remove its entry from impls:declared*"])
    result.stdout.fnmatch_lines(["*not the declared divergence: it was declared to fail showing "
                                 "'^first diverging event: fwd fc2 ', which this failure does not; its first line is "
                                 "'first diverging event: bwd fc1 *The declared reason: the row-parallel output is never "
                                 "all-reduced"])
    assert "FAILED test_cells.py::test_tp[tp-another-" in result.stdout.str()
    assert not list((pytester.path / "golden").rglob("*buggy*"))  # a divergent cell writes no golden


# ---- hf of the moe component ----------------------------------------------------------------------
def moe_cell(mesh="ep=2", emesh="dense", dtype="fp32", impl="hf", **switches) -> Config:
    from harness.matrix import mesh as parse
    from reference.moe import SIZES as MOE_SIZES

    k = int(switches.pop("k", 2))
    base = dict(emesh=emesh, cap="none", score="softmax", norm="off", route="rand", epimpl="alltoall")
    return Config("moe", impl, parse(mesh), dtype, dict(MOE_SIZES, e=8, k=k), base | switches)


def test_moe_hf_is_registered_dropless_with_its_skips_and_divergences():
    impl = get("moe").implementations["hf"]
    assert impl.skip and impl.xfail and impl.omits == ("dropped",)
    assert "harness.parallel.thirdparty_moe" in preload_modules([moe_cell()])


def test_moe_hf_imports_and_skips_without_transformers():
    code = """
import sys
sys.modules["transformers"] = None
import harness.parallel.moe_hf
from harness.config import Config
from harness.parallel.thirdparty_moe import hf_moe_skip
from reference.moe import SIZES
print(hf_moe_skip(Config("moe", "hf", (("ep", 2),), "fp32", dict(SIZES, e=8, k=2),
      dict(emesh="dense", cap="none", score="softmax", norm="off", route="rand", epimpl="alltoall"))))
"""
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["transformers is not installed: pip install -e '.[thirdparty]'"]


@pytest.mark.parametrize("switches, says", [
    (dict(cap="125"), "dropless"),
    (dict(score="sigmoid"), "sigmoid routers"),
    (dict(mesh="ep=2,etp=2"), "no expert tensor parallelism"),
    (dict(mesh="dp=4,tp=2", emesh="ep2etp2"), "no expert tensor parallelism"),
    (dict(mesh="dp=2,tp=2", emesh="ep4", epimpl="allreduce"), "`ep_size == tp_size`"),
    (dict(epimpl="auto"), "switch epimpl one of"),
    (dict(mesh="dp=2,tp=2", emesh="ep2", epimpl="allreduce", route="skew"), "never reaches _AllReduceBackward"),
    (dict(mesh="dp=2,tp=2", emesh="ep2", epimpl="allreduce", route="one", k=1), "starves the last ep rank"),
])
def test_moe_hf_skips_what_transformers_cannot_express(switches, says):
    pytest.importorskip("transformers")
    assert says in thirdparty_moe.hf_moe_skip(moe_cell(**switches))


def test_moe_hf_ep_tp_rule_quotes_transformers_own_message():
    configuration = pytest.importorskip("transformers.distributed.configuration_utils")
    with pytest.raises(ValueError) as refused:
        configuration.DistributedConfig(tp_size=4, fsdp_size=2, ep_size=2)
    # ep=2 inside a tp line of 4: harness/parallel/moe.py runs it, transformers refuses it
    assert str(refused.value) in thirdparty_moe.hf_moe_skip(moe_cell(mesh="dp=2,tp=4", emesh="ep2"))


@pytest.mark.parametrize("switches", [
    dict(), dict(mesh="ep=1", k=1), dict(mesh="dp=4", emesh="ep2"), dict(mesh="dp=2,tp=2", emesh="ep4"),
    dict(mesh="dp=2,tp=2", emesh="ep2", epimpl="allreduce", route="one", k=2),
])
def test_moe_hf_runs_the_layouts_transformers_has(switches):
    pytest.importorskip("transformers")
    assert thirdparty_moe.hf_moe_skip(moe_cell(**switches)) is None


def test_moe_meshes_add_transformers_one_rank_tp_dim_for_hf_only():
    from harness.parallel.moe import meshes

    for mesh, emesh in (("ep=2", "dense"), ("dp=4", "ep2"), ("dp=2,tp=2", "ep4")):
        ours = moe_cell(mesh, emesh, impl="ours")
        assert thirdparty_moe.moe_meshes(ours) == meshes(ours)
    assert thirdparty_moe.moe_meshes(moe_cell("ep=2")) == [(("fsdp", 2), ("tp", 1))]
    assert thirdparty_moe.moe_meshes(moe_cell("dp=4", "ep2")) == [(("edp", 2), ("ep", 2)), (("fsdp", 4), ("tp", 1))]
    assert thirdparty_moe.moe_meshes(moe_cell("dp=2,tp=2", "ep4")) == [(("ep", 4),)]  # the cell's tp is transformers'


def test_moe_hf_declared_divergences_are_cells_the_cases_run():
    from cases.test_moe import CELLS

    ids = {cfg.id for cfg in CELLS}
    assert thirdparty_moe.HF_MOE_KNOWN and set(thirdparty_moe.HF_MOE_KNOWN) <= ids


def test_moe_hf_experts_kernels_keep_a_starved_rank_in_the_backward():
    """The AllReduceEP hang is the eager experts' (no expert hit: no grad_fn); the grouped_mm and
    batched_mm kernels run the masked rows, so those cells run."""
    pytest.importorskip("transformers")
    starved = dict(mesh="dp=2,tp=2", emesh="ep2", epimpl="allreduce", route="skew", k=1)
    assert "hang" in thirdparty_moe.hf_moe_skip(moe_cell(**starved))
    assert "hang" in thirdparty_moe.hf_moe_skip(moe_cell(**starved, experts="eager"))
    for kernel in ("groupedmm", "batchedmm"):
        assert thirdparty_moe.hf_moe_skip(moe_cell(**starved, experts=kernel)) is None
    assert "switch experts one of" in thirdparty_moe.hf_moe_skip(moe_cell(experts="sonicmoe"))


def test_a_transformers_model_cell_runs_without_the_pytest_process_importing_transformers(tmp_path):
    """The models' skip finds transformers without importing it, their reduction (which builds the
    model) is computed beside the pool, and the pools import it before they fork (the models'
    ``preload``): the user's pytest process, which collects and resolves every cell, never pays its
    seconds. Seen from a project of its own, by the parent's ``-X importtime`` lines (the pools'
    processes are started without the flag)."""
    pytest.importorskip("transformers")
    (tmp_path / "test_llama.py").write_text(
        "import pytest\n\nfrom harness.model import model_cells\n\n\n"
        "@pytest.mark.parametrize('cfg', model_cells('llama', impls=['tp'], meshes=['tp=2']), ids=str)\n"
        "def test_llama(cfg, parity):\n    parity(cfg)\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider",
                           "-p", "no:randomly", "--pool-size", "2"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    imported = imported_modules(done.stderr)
    assert "torch" in imported  # the lines are there to read
    assert not {m for m in imported if m == "transformers" or m.startswith("transformers.")}, \
        sorted(m for m in imported if m.startswith("transformers"))[:5]
