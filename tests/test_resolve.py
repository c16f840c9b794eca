"""A cell is resolved once (:mod:`harness.resolve`): its rules, meshes, skip, declared divergence and
reduction are asked of the registry one time per cell, whoever decides about it; what each decides
(fixture, harness.golden, bisect, exploration) is the one disposition; the old Component methods
still work, with a DeprecationWarning naming the new spelling."""
import os
import warnings

import pytest
import torch

from harness.compare.diff import compare
from harness.config import Config, ConfigError
from harness.explore.strategies import runnable
from harness.registry import COMPONENTS, Component, Implementation, get, register_component, space_of
from harness.resolve import check_config, resolve
from reference.tp import SIZES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a component that is tp under another name, each of whose paths logs who called it and when
COUNTED = '''
import os

from harness.parallel import tp as parallel
from reference import tp as reference


def _log(what, cfg):
    with open(os.environ["COUNTED_LOG"], "a") as out:
        out.write(f"{what} {os.getpid()} {cfg.id} {os.environ.get('PYTEST_CURRENT_TEST', '')}\\n")


def validate(cfg):
    _log("validate", cfg)
    parallel.validate(cfg)


def impl_validate(cfg):
    _log("impl_validate", cfg)


def reduction(cfg):
    _log("reduction", cfg)
    return reference.reduction_size(cfg)


def meshes(cfg):
    _log("meshes", cfg)
    return ()


def skip(cfg):
    _log("skip", cfg)
    return None


def xfail(cfg):
    _log("xfail", cfg)
    return None
'''
CONFTEST = '''
import os

from harness.registry import Component, Implementation, get, register_component

with open(os.environ["COUNTED_LOG"], "a") as out:
    out.write(f"pytest {os.getpid()}\\n")
tp = get("tp")
register_component(Component(
    "counted", tp.reference, "counted:validate", "counted:reduction", meshes="counted:meshes",
    calibration=tp.calibration,
    implementations={"ours": Implementation("ours", tp.implementations["ours"].run, skip="counted:skip",
                                            xfail="counted:xfail", validate="counted:impl_validate")}))
'''
CASES = '''
import pytest
from harness.config import Config
from reference.tp import SIZES

CELLS = [Config("counted", "ours", {"tp": 2}, "fp32", SIZES, {"op": op}) for op in ("mlp", "colgather")]

@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_counted(cfg, parity):
    parity(cfg)
'''
PATHS = ("validate", "impl_validate", "meshes", "skip", "xfail", "reduction")


def test_a_cell_run_by_pytest_asks_each_of_its_paths_once(pytester, monkeypatch):
    log = pytester.path / "calls.log"
    monkeypatch.setenv("COUNTED_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makepyfile(counted=COUNTED, test_cells=CASES)
    pytester.makeconftest(CONFTEST)
    result = pytester.runpytest_subprocess("--pool-size", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    lines = [line.split(" ", 3) for line in log.read_text().splitlines()]
    pytest_pid = next(fields[1] for fields in lines if fields[0] == "pytest")
    for cell in ("op_mlp", "op_colgather"):
        # while the cell runs (its call phase), in pytest's process: the ranks ask nothing
        asked = [f[0] for f in lines if f[0] in PATHS and f[1] == pytest_pid and cell in f[2]
                 and f[3] == f"test_cells.py::test_counted[{f[2]}] (call)"]
        assert sorted(asked) == sorted(PATHS), (cell, asked)


def tp_cell(mesh=None, impl="ours", dtype="fp32", **switches) -> Config:
    return Config("tp", impl, mesh or {"tp": 2}, dtype, SIZES, switches or {"op": "mlp"})


@pytest.fixture
def declared():
    """``tp``/``declared``: tp's own code, declaring every bf16 cell a divergence, strict on tp=2 only,
    and skipping tp=3."""
    tp = get("tp")
    register_component(Component("declaring", tp.reference, tp.validate, tp.reduction, implementations={
        "ours": Implementation("ours", tp.implementations["ours"].run, skip="tests.test_resolve:skip_three",
                               xfail="tests.test_resolve:declared_bf16")}))
    yield
    COMPONENTS.pop("declaring")


def skip_three(cfg):
    return "no tp=3 here" if cfg.degree("tp") == 3 else None


def declared_bf16(cfg):
    from harness.versions import declared

    if cfg.dtype == "bf16":
        return declared("torch", "bf16 rounding, planted for this test", strict=cfg.degree("tp") == 2)
    return None


def test_the_disposition_names_run_invalid_skip_and_xfail_with_their_reasons(declared):
    def of(cfg, pool_size=None, job_size=None):
        return resolve(cfg.replace(component="declaring"), pool_size, job_size).disposition

    assert of(tp_cell()).kind == "run"
    broken = of(tp_cell({"tp": 5}))  # h=16 over 5 ranks leaves one empty
    assert broken.kind == "invalid" and broken.reason.startswith("tp=5 leaves a rank an empty chunk"), broken
    small = of(tp_cell({"tp": 4}), pool_size=2)
    assert (small.kind, small.reason.split(": ", 1)[1]) == ("invalid", "needs 4 ranks but the pool has 2; pass --pool-size 4")
    assert of(tp_cell({"tp": 4}), job_size=2).reason.startswith("needs 4 ranks and this torchrun job has 2: launch at least 4")
    assert of(tp_cell({"tp": 4}), job_size=2).kind == "skip"
    assert of(tp_cell({"tp": 3})) == of(tp_cell({"tp": 3}), job_size=2)  # its own skip is said first
    assert of(tp_cell({"tp": 3})).reason == "no tp=3 here"
    strict, loose = of(tp_cell(dtype="bf16")), of(tp_cell({"tp": 4}, dtype="bf16"))
    assert (strict.kind, strict.strict, loose.kind, loose.strict) == ("xfail", True, "xfail", False)
    assert "bf16 rounding, planted for this test" in strict.reason
    assert of(tp_cell({"tp": 4}, dtype="bf16"), pool_size=2).kind == "invalid"  # too big beats declared
    assert of(tp_cell({"tp": 4}, dtype="bf16"), job_size=2).kind == "skip"


def test_exploration_and_check_config_read_the_same_disposition(declared):
    assert runnable(tp_cell({"tp": 2}).replace(component="declaring"), 4) is None
    assert runnable(tp_cell({"tp": 3}).replace(component="declaring"), 4) == "no tp=3 here"
    assert runnable(tp_cell(dtype="bf16").replace(component="declaring"), 4).startswith("declared divergence: ")
    assert "pass --pool-size 4" in runnable(tp_cell({"tp": 4}).replace(component="declaring"), 2)
    with pytest.raises(ConfigError, match="pass --pool-size 4"):
        check_config(tp_cell({"tp": 4}), pool_size=2)
    check_config(tp_cell({"tp": 3}).replace(component="declaring"))  # skipped is not invalid


def test_the_old_component_methods_warn_and_agree_with_the_resolved_cell():
    torch.set_num_threads(1)
    cfg = tp_cell()
    cell, tp = resolve(cfg), get("tp")
    old = {
        "reference_result": (lambda: tp.reference_result(cfg), lambda: cell.reference()),
        "calibration_result": (lambda: tp.calibration_result(cfg), lambda: cell.calibration()),
        "reduction_size": (lambda: tp.reduction_size(cfg), lambda: cell.reduction),
        "extra_meshes": (lambda: tp.extra_meshes(cfg), lambda: cell.meshes),
        "exploration_space": (lambda: tp.exploration_space(), lambda: space_of(tp)),
        "check": (lambda: tp.check(cfg), lambda: None),
        "skip_reason": (lambda: tp.implementations["ours"].skip_reason(cfg), lambda: None),
        "xfail_reason": (lambda: tp.implementations["ours"].xfail_reason(cfg), lambda: None),
    }
    for name, (before, now) in old.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = before()
        assert [w.category for w in caught] == [DeprecationWarning], name
        assert "goes in the next release: use " in str(caught[0].message), name
        assert caught[0].filename == __file__, (name, caught[0].filename)  # the warning points at the caller
        want = now()
        if isinstance(want, dict) and name != "reduction_size":
            assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name
        else:
            assert got == want, name
    report = compare(cell.reference(), cell.reference(), cell.tolerances())
    with pytest.warns(DeprecationWarning, match=r"resolve\(cfg\)\.diagnose\(pool, report, rerun\)"):
        assert tp.diagnosis(cfg, None, report, rerun=False) == cell.diagnose(None, report, rerun=False)


def test_a_declared_divergence_that_matches_here_writes_no_golden_file(pytester, monkeypatch):
    """A non-strict declared divergence (rounding that shows on some machines' kernels) passes here:
    XPASS, and no golden file records numbers another machine's run of it does not reach."""
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makepyfile(loose='''
from harness.versions import declared

def xfail(cfg):
    return declared("torch", "kernels that round differently by CPU", strict=False)
''', test_cells=CASES.replace('"counted", "ours"', '"tp", "loose"'))
    pytester.makeconftest('''
from harness.registry import register_implementation
register_implementation("tp", "loose", "harness.parallel.tp:run", xfail="loose:xfail")
''')
    result = pytester.runpytest_subprocess("--pool-size", "2", "-p", "no:cacheprovider", "-rX")
    result.assert_outcomes(xpassed=2)
    result.stdout.fnmatch_lines(["*known divergence of loose: torch * kernels that round differently by CPU. "
                                 "Whether it shows depends on this machine's kernels*"])
    assert not (pytester.path / "golden").exists()
