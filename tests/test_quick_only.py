"""A ``quick_only`` cell, from a user's own project (a temporary directory, pytest in a subprocess): a
shorter twin of a matrix cell (here smaller sizes) that ``--quick`` runs in its place, that the whole
matrix leaves out, and that runs when named by its node id; and under ``-n``, cells handed to the
workers one at a time unless the user chose a chunk."""
import textwrap

import pytest

from tests.project import Run, UserProject

CASES = textwrap.dedent('''\
    import pytest
    from harness.config import Config

    FULL = {"b": 4, "f": 32, "h": 16, "s": 8, "v": 40}
    SHORT = {"b": 2, "f": 8, "h": 8, "s": 4, "v": 8}
    CELLS = ([Config("tp", "ours", {"tp": 2}, "fp32", FULL, {"op": op}) for op in ("mlp", "colgather")]
             + [pytest.param(Config("tp", "ours", {"tp": 2}, "fp32", SHORT, {"op": "mlp"}), marks=pytest.mark.quick_only)])

    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_tp(cfg, parity):
        parity(cfg)
    ''')
SHORT_MLP = "test_cells.py::test_tp[tp-ours-tp2-fp32-op_mlp-b2.f8.h8.s4.v8-seed0]"
FULL_MLP = "test_cells.py::test_tp[tp-ours-tp2-fp32-op_mlp-b4.f32.h16.s8.v40-seed0]"
FULL_COLGATHER = "test_cells.py::test_tp[tp-ours-tp2-fp32-op_colgather-b4.f32.h16.s8.v40-seed0]"


@pytest.fixture
def project(tmp_path) -> UserProject:
    return UserProject(tmp_path / "project", {"test_cells.py": CASES}, ini=False)


def pytest_in(project: UserProject, *args) -> Run:
    return project.pytest("--pool-size", "2", "--golden-dir", str(project.path / "golden"), "-rA", *args, timeout=300)


def passed(run: Run) -> set[str]:
    return {line.split(" ", 1)[1] for line in run.stdout.splitlines() if line.startswith("PASSED ")}


def test_quick_runs_the_twin_in_place_of_its_cell_and_the_matrix_runs_the_cell(project):
    quick = pytest_in(project, "--quick")
    assert quick.returncode == 0, quick.stdout[-3000:]
    # the twin stands in for the mlp cell; colgather, which has no twin, still runs
    assert passed(quick) == {SHORT_MLP, FULL_COLGATHER}, quick.stdout[-3000:]
    matrix = pytest_in(project)
    assert matrix.returncode == 0, matrix.stdout[-3000:]
    assert passed(matrix) == {FULL_MLP, FULL_COLGATHER}, matrix.stdout[-3000:]
    assert "1 deselected" in matrix.stdout
    named = pytest_in(project, SHORT_MLP)
    assert named.returncode == 0 and passed(named) == {SHORT_MLP}, named.stdout[-3000:]


@pytest.mark.parametrize("given, chunk", [((), "1"), (("--maxschedchunk", "3"), "3")])
def test_workers_get_one_cell_at_a_time_unless_the_user_chose(project, given, chunk):
    project.write({"conftest.py": '''\
        def pytest_sessionfinish(session):
            if not hasattr(session.config, "workerinput"):  # xdist's controller, which schedules
                print(f"\\nmaxschedchunk={session.config.option.maxschedchunk}")
        '''})
    run = pytest_in(project, "-n", "2", "--collect-only", *given)  # and -q, as UserProject.pytest runs it
    assert f"maxschedchunk={chunk}" in run.stdout, run.stdout[-2000:]
