"""The pytest plugin end to end, in real pytest subprocesses."""
import os

import pytest

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
    pytester.makeconftest('pytest_plugins = ["harness.plugin"]')
    pytester.makepyfile(test_cells=CASES)
    return pytester


def run(project, *args):
    return project.runpytest_subprocess("--pool-size", "2", "-p", "no:cacheprovider", *args)


def test_goldens_are_created_checked_and_selected_by_id_pieces(project):
    result = run(project)
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines(["*is missing: create it with*", "*--update-golden*"])

    result = run(project, "--update-golden")
    result.assert_outcomes(passed=4)
    assert len(list((project.path / "golden" / "tp").iterdir())) == 4
    result.stdout.fnmatch_lines(["*parity summary*", "*component*", "tp*4*0*0*"])

    result = run(project, "-k", "tp2 and bf16")
    result.assert_outcomes(passed=1, deselected=3)

    (golden,) = (project.path / "golden" / "tp").glob("*tp2-fp32*")
    golden.write_bytes(golden.read_bytes()[:40])
    result = run(project, "-k", "tp2 and fp32")
    result.assert_outcomes(failed=1, deselected=3)
    result.stdout.fnmatch_lines([f"*golden file*{golden.name} is corrupt or truncated*"])


def test_a_divergence_prints_the_table_and_the_line_that_reproduces_it(project):
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
pytest_plugins = ["harness.plugin"]
from harness.registry import register_implementation
register_implementation("tp", "buggy", "buggy:run")
''')
    project.makepyfile(test_cells=CASES.replace('impls=["ours"]', 'impls=["ours", "buggy"]'))
    result = run(project, "-k", "buggy and tp2 and fp32", "--update-golden")
    result.assert_outcomes(failed=1, deselected=7)
    result.stdout.fnmatch_lines([
        "*tp-buggy-tp2-fp32-op_mlp-* diverges from the reference*",
        "*tensor*worst index*actual*expected*abs err*rel err*tol*norm ratio*",
        "*out*mismatch*",
        "reproduce: pytest 'test_cells.py::test_tp?tp-buggy-tp2-fp32-op_mlp-*?'",  # ? for [ ]: fnmatch
    ])
    assert not list((project.path / "golden" / "tp").glob("*buggy*"))  # a diverging cell writes no golden


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
pytest_plugins = ["harness.plugin"]
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
