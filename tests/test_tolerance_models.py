"""The tolerance holds real models: tiny GLM-4 and OLMo-2 (tests/model_rounding.py) with transformers'
own TP plan at tp=2, and the same models alone on a one-rank mesh, are green in fp32, where the
analytic policy alone put them at err/tol 1.1 to 3.8 from fp32 rounding; the same GLM-4 with one
planted TP bug (each layer's o_proj weight gradient halved) stays red by orders of magnitude.

A user's project in tmp_path, run with ``python -m pytest`` in a subprocess (as tests/test_users_cases.py).
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from harness.compare.tolerance import ROUNDING
from tests.conftest import flat
from tests.project import Run, UserProject

CONFTEST = textwrap.dedent('''\
    from harness.model import register_model

    register_model("glm4", "tests.model_rounding:GLM4")
    register_model("olmo2", "tests.model_rounding:OLMO2")
    register_model("halfgrad", "tests.model_rounding:HALFGRAD")
    ''')
TEST = textwrap.dedent('''\
    import pytest

    from harness.model import model_cells

    CELLS = (model_cells("glm4", meshes=["tp=2", "tp=1"]) + model_cells("olmo2", meshes=["tp=2", "tp=1"])
             + model_cells("halfgrad", meshes=["tp=2"]))


    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_rounding(cfg, parity):
        parity(cfg)
    ''')
RIGHT = [f"{model}-tp-tp{tp}-fp32-plain-steps3-seed0" for model in ("glm4", "olmo2") for tp in (2, 1)]
BUG = "halfgrad-halfgrad-tp2-fp32-plain-steps3-seed0"


def parity_run(project: Path, conftest: str, test: str, *args: str) -> tuple[Run, dict]:
    """``python -m pytest`` in a project of ``conftest`` and ``test_rounding.py`` (``test``), with
    ``args``: the run and each cell's parity record (its junit property), by cell id."""
    files = {"conftest.py": conftest, "test_rounding.py": test}
    done = UserProject(project, files).pytest("-p", "no:randomly", *args, "-rA")
    return done, {cell: c.record for cell, c in done.cells.items()}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Run, dict]:
    pytest.importorskip("transformers")
    return parity_run(tmp_path_factory.mktemp("rounding") / "project", CONFTEST, TEST,
                      "--pool-size", "2", "--case-deadline", "120")


@pytest.mark.parametrize("cell", RIGHT)
def test_right_code_on_a_real_model_is_green_in_fp32(run, cell):
    done, cells = run
    assert cells[cell]["status"] == "passed", done.tail
    assert cells[cell]["ratio"] < 1


def test_a_halved_gradient_on_the_same_model_stays_red_by_orders_of_magnitude(run):
    done, cells = run
    assert cells[BUG]["status"] == "failed" and cells[BUG]["ratio"] > 1e3, done.tail
    assert "model.layers.1.self_attn.o_proj.weight (module model.layers.1.self_attn.o_proj: mismatch, " \
           "norm ratio 0.5" in flat(done.stdout), done.tail
    # the header says how much one process amplified rounding, the widening the policy allowed
    assert f"per tensor x (1 + {ROUNDING:g} x one process's fp32 err/tol there), the most" in flat(done.stdout)
