"""A temporary project with one planted bug, run by pytest with junit XML: the input of the report
tests. The bug lives in a user-registered implementation (the forgotten all-reduce of the
row-parallel linear), not in this project's code: cells where the row-parallel layer is sharded
(op mlp at tp > 1) must go red, the same op at tp=1 and the column-parallel op must stay green.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = '''
import pytest
from harness.matrix import cells
from reference.tp import SIZES

CELLS = cells("tp", impls=["ours", "buggy"], meshes=["tp=1", "tp=2", "dp=2,tp=2"], dtypes=["fp32", "bf16"],
              sizes=SIZES, switches={"op": ["colshard", "mlp"]})


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_tp(cfg, parity):
    parity(cfg)
'''

BUGGY = '''
import harness.parallel.tp as tp


def run(ctx, cfg):
    kept = tp.row_parallel
    tp.row_parallel = lambda x, w, b, group: tp.F.linear(x, w) + b   # the all-reduce forgotten
    try:
        return tp.run(ctx, cfg)
    finally:  # the rank process runs other implementations' cells next
        tp.row_parallel = kept
'''

CONFTEST = '''
from harness.registry import register_implementation

register_implementation("tp", "buggy", "buggy:run")
'''


def expected_red(cell: str) -> bool:
    """Which cells of CASES the planted bug turns red."""
    return "-buggy-" in cell and "op_mlp" in cell and "-tp1-" not in cell


def make_project(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "test_cells.py").write_text(CASES)
    (path / "buggy.py").write_text(BUGGY)
    (path / "conftest.py").write_text(CONFTEST)
    (path / "pytest.ini").write_text("[pytest]\n")
    return path


def run_project(path: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest in the project, with this checkout importable (its cases' modules, its plugin)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + str(path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pool-size", "4", *args],
                          cwd=path, env=env, capture_output=True, text=True)
