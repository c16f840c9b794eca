"""The pytest plugin end to end, in real pytest subprocesses."""
import fnmatch
import os
import shlex
import sys
import types

import pytest
import torch

from harness.matrix import cells
from harness.plugin import quick_selection, rerun_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = """
import pytest
from harness.matrix import cells
from reference.tp import SIZES

CELLS = cells("tp", impls=["ours"], meshes=["tp=1", "tp=2"], dtypes=["fp32", "bf16"], sizes=SIZES,
              switches={"op": ["mlp"]})

@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_tp(cfg, parity):
    parity(cfg)
"""


@pytest.fixture
def project(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makepyfile(test_cells=CASES)
    return pytester


def run(project, *args):
    return project.runpytest_subprocess("--pool-size", "2", "-p", "no:cacheprovider", *args)


def test_goldens_are_created_checked_and_selected_by_id_pieces(project):
    result = run(project, "--strict-golden")  # CI: a cell without a golden file fails
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines(["*is missing: create it with*", "*--update-golden*"])
    assert not (project.path / "golden").exists()

    result = run(project)  # locally: a cell that matches the reference records its missing golden
    result.assert_outcomes(passed=4)
    assert len(list((project.path / "golden" / "tp").iterdir())) == 4
    result.stdout.fnmatch_lines(["*parity summary*", "*component*", "tp*4*0*0*",
                                 "golden files written for 4 cells that had none: review and commit them*"])

    result = run(project, "-k", "tp2 and bf16", "--strict-golden")
    result.assert_outcomes(passed=1, deselected=3)

    (golden,) = (project.path / "golden" / "tp").glob("*tp2-fp32*")
    golden.write_bytes(golden.read_bytes()[:40])
    result = run(project, "-k", "tp2 and fp32")
    result.assert_outcomes(failed=1, deselected=3)
    result.stdout.fnmatch_lines([f"*golden file*{golden.name} is corrupt or truncated*"])


def test_a_divergence_prints_the_table_the_line_that_reproduces_it_and_counts_in_the_summary(project):
    run(project, "--update-golden").assert_outcomes(passed=4)
    # a user-registered implementation with a planted bug, added without editing the project
    project.makepyfile(buggy='''
import parallel.tp as tp
from parallel.collectives import reduce_from_group

def run(ctx, cfg):
    tp.row_parallel = lambda x, w, b, group: tp.F.linear(x, w) + b   # the all-reduce forgotten
    return tp.run(ctx, cfg)
''')
    project.makeconftest('''
from harness.registry import register_implementation
register_implementation("tp", "buggy", "buggy:run")
''')
    project.makepyfile(test_cells=CASES.replace('impls=["ours"]', 'impls=["ours", "buggy"]'))
    result = run(project, "-k", "tp2 and fp32", "--update-golden")
    result.assert_outcomes(failed=1, passed=1, deselected=6)
    python = shlex.quote(sys.executable)
    result.stdout.fnmatch_lines([
        "*tp-buggy-tp2-fp32-op_mlp-* diverges from the reference*",
        "*tensor*worst index*actual*expected*abs err*rel err*tol*norm ratio*",
        "*out*mismatch*",
        # this interpreter, not whichever pytest is first on PATH (? stands for [ and ]: fnmatch)
        f"reproduce: {python} -m pytest 'test_cells.py::test_tp?tp-buggy-tp2-fp32-op_mlp-*?'",
    ])
    assert not list((project.path / "golden" / "tp").glob("*buggy*"))  # a diverging cell writes no golden
    summary = result.stdout.str().split("parity summary")[1]
    lines = summary.splitlines()
    header = next(line for line in lines if "passed" in line and "failed" in line)
    row = next(line for line in lines if line.startswith("tp "))
    columns = dict(zip(["passed", "failed", "skipped", "xfailed", "worst"], row.split()[1:6]))
    assert header.split()[:5] == ["passed", "failed", "skipped", "xfailed", "worst"]
    assert (columns["passed"], columns["failed"], columns["skipped"]) == ("1", "1", "0")
    assert float(columns["worst"]) > 100  # the failed cell's real ratio, not 0
    assert "mismatch 1" in row


def test_skips_are_counted_with_their_most_common_reasons(project):
    project.makepyfile(skipper='''
def skip_reason(cfg):
    return f"needs a GPU for {cfg.dtype}" if cfg.dtype == "bf16" else None
''')
    project.makeconftest('''
from harness.registry import register_implementation
register_implementation("tp", "mine", "parallel.tp:run", skip="skipper:skip_reason")
''')
    project.makepyfile(test_cells=CASES.replace('impls=["ours"]', 'impls=["mine"]'))
    result = run(project)
    result.assert_outcomes(passed=2, skipped=2)
    result.stdout.fnmatch_lines(["tp*2*0*2*", "skipped tp x2: needs a GPU for bf16"])


@pytest.mark.parametrize("args, message", [
    (["--pool-size", "0"], "ERROR: --pool-size 0: must be at least 1*"),
    (["--case-deadline", "-1"], "ERROR: --case-deadline -1.0: must be a positive number of seconds*"),
    (["--case-deadline", "0"], "ERROR: --case-deadline 0.0: must be a positive number of seconds*"),
    (["--backend", "mpi"], "ERROR: --backend mpi: backend 'mpi' is not one of auto, gloo, nccl"),
    pytest.param(["--backend", "nccl"], "ERROR: --backend nccl: backend nccl needs CUDA*use --backend gloo",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")),
])
def test_a_bad_option_value_is_one_line_and_a_usage_error(project, args, message):
    result = run(project, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    lines = [line for line in result.stderr.lines if line.strip()]
    assert len(lines) == 1, result.stderr.str()
    assert fnmatch.fnmatch(lines[0], message), lines[0]
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_an_implementation_that_does_not_import_fails_once_at_collection_naming_the_path(project):
    project.makeconftest('''
from harness.registry import register_implementation
register_implementation("tp", "typo", "mypkg.tp_impll:run")
''')
    project.makepyfile(test_cells=CASES.replace('impls=["ours"]', 'impls=["typo"]'))
    result = run(project)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    (line,) = [line for line in result.stderr.lines if line.strip()]
    assert "implementation tp/typo: run path 'mypkg.tp_impll:run' does not resolve (ModuleNotFoundError" in line
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_the_rerun_command_uses_this_interpreter_and_the_rootdir(tmp_path, monkeypatch):
    config = types.SimpleNamespace(rootpath=tmp_path)
    monkeypatch.chdir(tmp_path)
    assert rerun_command(config, "cases/t.py::t[a]") == f"{shlex.quote(sys.executable)} -m pytest 'cases/t.py::t[a]'"
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert rerun_command(config, "cases/t.py::t[a]").startswith(f"cd {shlex.quote(str(tmp_path))} && ")


def test_a_hung_cell_fails_with_every_rank_stack_and_the_next_cell_passes(project):
    project.makepyfile(hang='''
import time
import parallel.tp as tp

def run(ctx, cfg):
    if ctx.rank == 1:
        while True:
            time.sleep(0.05)
    return tp.run(ctx, cfg)
''')
    project.makeconftest('''
from harness.registry import register_implementation
register_implementation("tp", "hang", "hang:run")
''')
    project.makepyfile(test_cells=CASES.replace('impls=["ours"]', 'impls=["hang", "ours"]'))
    result = run(project, "-k", "tp2 and fp32", "--case-deadline", "3", "--update-golden")
    result.assert_outcomes(failed=1, passed=1, deselected=6)  # the hung cell runs first
    result.stdout.fnmatch_lines([
        "*case tp-hang-tp2-fp32-* passed its deadline of 3.0 s: ranks ?0, 1? still running",
        "*rank 0: hung: in all_reduce* at parallel/collectives.py:* in _all_reduce",
        "*rank 1: hung: at hang.py:* in run",
    ])


def test_quick_covers_every_component_impl_dtype_and_switch_on_the_smallest_multi_rank_mesh():
    sizes = {"b": 4}
    cfgs = (cells("tp", impls=["ours", "dtensor"], meshes=["tp=1", "tp=2", "dp=2,tp=2", "tp=4"],
                  dtypes=["fp32", "bf16"], sizes=sizes, switches={"op": ["mlp", "sp", "xent"]})
            + cells("ringattn", impls=["ours"], meshes=["cp=1"], dtypes=["fp32"], sizes=sizes,
                    switches={"mask": ["causal"]}))
    kept = quick_selection(cfgs)
    assert {(c.component, c.impl) for c in kept} == {("tp", "ours"), ("tp", "dtensor"), ("ringattn", "ours")}
    assert {c.mesh for c in kept if c.component == "tp"} == {(("tp", 2),)}
    ours = [c for c in kept if c.impl == "ours" and c.component == "tp"]
    assert {c.dtype for c in ours} == {"fp32", "bf16"} and {c.switch("op") for c in ours} == {"mlp", "sp", "xent"}
    assert len(ours) < 6  # each value at least once, not the product of dtypes and ops
    assert {c.mesh for c in kept if c.component == "ringattn"} == {(("cp", 1),)}  # the only world there is
