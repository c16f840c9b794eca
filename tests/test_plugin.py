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
