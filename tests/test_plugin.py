"""The pytest plugin end to end, in real pytest subprocesses."""
import fnmatch
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from harness.config import Config
from harness.matrix import cells
from harness.commands import rerun_command
from harness.selection import quick_selection
from harness.report.junit import read
from reference.tp import SIZES

from .checkout import copy_checkout
from .project import imported_modules

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
import harness.parallel.tp as tp
from harness.parallel.collectives import reduce_from_group

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
register_implementation("tp", "mine", "harness.parallel.tp:run", skip="skipper:skip_reason")
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
    (["--explore-shrink-seconds", "0"], "ERROR: --explore-shrink-seconds 0.0: must be a positive number of seconds*"),
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


def test_a_project_whose_tests_use_no_cell_does_not_import_torch(user_project):
    """Installed, the plugin loads in every pytest run of the environment: one whose tests run no cell
    (a project's other tests, ``--help``, a bad option) must not pay torch's import (1.4 s of 2 s)."""
    user_project.write({"test_plain.py": "def test_plain():\n    assert True\n"})
    for args in ([], ["--help"], ["--backend", "mpi"]):
        done = user_project.run("python", "-X", "importtime", "-m", "pytest", "-p", "no:cacheprovider", *args)
        assert done.returncode in (0, 4), done.tail
        imported = imported_modules(done.stderr)
        # harness.options: the plugin loaded (pytest's assertion rewriter imports the plugin module itself unlogged)
        assert "harness.options" in imported and "torch" not in imported, (args, sorted(m for m in imported if "harness" in m))


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
    monkeypatch.chdir(tmp_path)
    assert rerun_command(tmp_path, "cases/t.py::t[a]") == f"{shlex.quote(sys.executable)} -m pytest 'cases/t.py::t[a]'"
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert rerun_command(tmp_path, "cases/t.py::t[a]").startswith(f"cd {shlex.quote(str(tmp_path))} && ")
    # a project's own interpreter is named as typed where the command runs: from the rootdir it cds to
    monkeypatch.setattr(sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    assert rerun_command(tmp_path, "t.py::t") == f"cd {shlex.quote(str(tmp_path))} && .venv/bin/python -m pytest t.py::t"
    monkeypatch.chdir(tmp_path)
    assert rerun_command(tmp_path, "t.py::t") == ".venv/bin/python -m pytest t.py::t"


def test_a_hung_cell_fails_with_every_rank_stack_and_the_next_cell_passes(project):
    project.makepyfile(hang='''
import time
import harness.parallel.tp as tp

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
        "*rank 0: hung: in all_reduce* at harness/parallel/collectives.py:* in _all_reduce",
        "*rank 1: hung: at hang.py:* in run",
        # the same line a mismatch has, after every rank's stack
        f"reproduce: {shlex.quote(sys.executable)} -m pytest 'test_cells.py::test_tp?tp-hang-tp2-fp32-op_mlp-*?'",
    ])


def test_quick_covers_every_component_impl_dim_dtype_and_switch_with_few_cells():
    sizes = {"b": 4}
    cfgs = (cells("tp", impls=["ours", "dtensor"], meshes=["tp=1", "tp=2", "dp=2,tp=2", "tp=4", "pp=2,dp=2,tp=2"],
                  dtypes=["fp32", "bf16"], sizes=sizes, switches={"op": ["mlp", "sp", "xent"]})
            + cells("ringattn", impls=["ours"], meshes=["cp=1"], dtypes=["fp32"], sizes=sizes,
                    switches={"mask": ["causal"]}))
    kept = quick_selection(cfgs)
    assert {(c.component, c.impl) for c in kept} == {("tp", "ours"), ("tp", "dtensor"), ("ringattn", "ours")}
    for impl in ("ours", "dtensor"):
        mine = [c for c in kept if c.component == "tp" and c.impl == impl]
        assert {name for c in mine for name, degree in c.mesh if degree > 1} == {"pp", "dp", "tp"}
        assert {c.dtype for c in mine} == {"fp32", "bf16"} and {c.switch("op") for c in mine} == {"mlp", "sp", "xent"}
        # pp comes only with 8 ranks: one such cell, no 4-rank dp2.tp2 (its dims come with it), no tp=1
        # (it splits nothing) or tp=4 (nothing new); two cells of tp=2 for the rest, not the product
        assert sorted(c.world for c in mine) == [2, 2, 8], sorted(map(str, mine))
    assert {c.mesh for c in kept if c.component == "ringattn"} == {(("cp", 1),)}  # the only world there is


def test_quick_shows_two_new_layouts_in_one_resharding_cell():
    """Checkpoint cells are (save, load) pairs of layouts, most of whose values exist only in worlds
    above the smallest: each value runs, two new ones to a cell where it can, and a save and a load
    under one layout (no reshard) only where no other cell shows the value."""
    layouts = {"fsdp1": 1, "fsdp2": 2, "fsdp4": 4, "hsdp2x2": 4, "fsdptp2x2": 4, "fsdp8": 8, "hsdp2x4": 8,
               "fsdptp4x2": 8}
    cfgs = [Config("ckpt", "dcp", (("w", max(layouts[s], layouts[l])),), "fp32", (), {"save": s, "load": l})
            for s in layouts for l in layouts]
    kept = quick_selection(cfgs)
    assert {c.switch("save") for c in kept} == {c.switch("load") for c in kept} == set(layouts)
    assert all(c.switch("save") != c.switch("load") for c in kept), sorted(map(str, kept))
    # worlds 4 and 8 each have three new layouts a side: three cells each, every cell two new values
    # (a greedy cover took three or four), not one for each (six); fsdp1 and fsdp2 two cells of 2
    assert sorted(c.world for c in kept) == [2, 2, 4, 4, 4, 8, 8, 8], sorted(map(str, kept))


def scale_golden(path, factor: float) -> None:
    """Multiply the ``out`` tensor of a golden file by ``factor``, its metadata kept: a change the
    harness did not make."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    tensors["out"] = (tensors["out"].double() * factor).to(tensors["out"].dtype)
    save_file(tensors, path, metadata=meta)


def test_the_summary_counts_goldens_within_tolerance_calls_drift_drift_and_lists_the_slowest_cells(project):
    run(project).assert_outcomes(passed=4)
    golden = project.path / "golden" / "tp"
    (near,) = golden.glob("*-tp2-fp32-*")
    (far,) = golden.glob("*-tp1-fp32-*")
    scale_golden(near, 1 + 1e-7)  # within the fp32 tolerance, not bit-identical
    scale_golden(far, 1.01)  # beyond it: drift, while the reference still agrees with the cell
    result = run(project, "-k", "fp32", "--junitxml", "junit.xml")
    result.assert_outcomes(failed=1, passed=1, deselected=2)
    result.stdout.fnmatch_lines([f"{far.stem} has drifted from its golden file*"])
    lines = result.stdout.str().split("parity summary")[1].splitlines()
    header = " ".join(next(line for line in lines if "passed" in line).split())
    assert "failed as golden identical golden within tol golden written seconds" in header  # the report's columns
    row = next(line for line in lines if line.startswith("tp ")).split()
    assert row[1:5] == ["1", "1", "0", "0"] and row[6:11] == ["drift", "1", "0", "1", "0"], row

    records = {c.cell: c.record for c in read([project.path / "junit.xml"]).cells}
    assert records[far.stem]["kind"] == "drift" and records[near.stem]["golden"] == "within tolerance"
    report = subprocess.run([sys.executable, "-m", "harness.report", "--junit", "junit.xml", "--out", "reports"],
                            cwd=project.path, capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    assert re.search(rf"^\| `{re.escape(far.stem)}` \| drift \|", report.stdout, re.M), report.stdout
    assert re.search(r"^\| `tp` \| 1 \| 1 \| 0 \| [^|]+ \| drift 1 \| 0 \| 1 \| 0 \|", report.stdout, re.M)

    # the slowest cells, as --durations lists them: the seconds the junit records hold, slowest first
    slowest = lines[next(i for i, line in enumerate(lines) if line.startswith("slowest cells")) + 1:][:2]
    listed = [(float(line.split()[0].rstrip("s")), line.split()[1]) for line in slowest]
    # ordered by the seconds as recorded, shown to two decimals (two cells can show the same 0.27)
    expected = [(round(seconds, 2), nodeid) for seconds, nodeid in sorted(
        ((r["seconds"], f"test_cells.py::test_tp[{cell}]") for cell, r in records.items()), reverse=True)]
    assert listed == expected


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_a_k_that_matches_no_cell_says_so_with_the_shape_of_a_real_id(project, workers):
    result = run(project, "-k", "tp8 and fp32", *workers)
    # pytest's status for an empty selection, kept: CI scripts tell it from a usage error (4) by it
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    (line,) = [line for line in result.stdout.lines if "no cell matched" in line]
    assert line.startswith("no cell matched -k 'tp8 and fp32'; an id looks like "
                           "<component>-<impl>-<mesh>-<dtype>-<switches>-<sizes>-seed<N>, e.g. "), line
    example = line.split("e.g. ")[1].split()[0]
    assert example in {cfg.id for cfg in cells("tp", impls=["ours"], meshes=["tp=1", "tp=2"], dtypes=["fp32", "bf16"],
                                               sizes=SIZES, switches={"op": ["mlp"]})}

    project.makepyfile(test_other="def test_helper():\n    pass\n")  # -k meant a test that is not a cell
    result = run(project, "-k", "tp8 or helper", *workers)
    result.assert_outcomes(passed=1)
    assert "no cell matched" not in result.stdout.str()


@pytest.mark.parametrize("installed", [True, False], ids=["installed", "not installed"])
def test_the_checkout_runs_its_cells_with_the_plugin_installed_or_not(tmp_path, installed):
    """The root conftest.py loads the plugin when no entry point did, and only then."""
    checkout = copy_checkout(tmp_path / "checkout")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cell = "cases/test_tp.py::test_tp[tp-ours-tp2-fp32-op_mlp-b4.f32.h16.s8.v40-seed0]"
    args = [cell, cell.replace("tp2-fp32", "tp2-bf16")]
    if installed:  # as README's command runs it: through the entry point, under xdist
        args += ["-n", "2"]
    else:  # no entry point loads it, as in an environment where the checkout is not installed
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pool-size", "2", *args],
                          cwd=checkout, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 passed" in done.stdout and "parity summary" in done.stdout
    assert len(list((checkout / "golden" / "tp").glob("*.safetensors"))) == 2  # the checkout's own plugin wrote them
