"""A failure on one screen: 120 columns, and cells that fail alike printed once (from a user's
project, as pytest prints it)."""
import sys

import pytest

from harness.report.markdown import _failure_text, table_rows
from harness.screen import first_line, fitted
from tests.conftest import flat
from tests.project import UserProject

CONFTEST = '''
from harness.registry import register_implementation
register_implementation("tp", "spunreduced", "tests.planted:tp_sp_replicated_grads_unreduced")
register_implementation("tp", "overtp", "tests.planted:tp_grads_over_tp")
'''
ALIKE = ["tp-spunreduced-tp2-fp32-op_sp-b4.f32.h16.s8.v40-seed0", "tp-spunreduced-tp4-fp32-op_sp-b4.f32.h16.s8.v40-seed0",
         "tp-spunreduced-dp2.tp2-fp32-op_sp-b4.f32.h16.s8.v40-seed0"]
SCALED = "tp-overtp-tp2-fp32-op_mlp-b4.f32.h16.s8.v40-seed0"
TESTS = f'''
import pytest
from harness.config import Config


@pytest.mark.parametrize("cfg", [Config.parse(c) for c in {ALIKE + [SCALED]!r}], ids=str)
def test_mine(cfg, parity):
    parity(cfg)
'''


def test_fitted_wraps_sentences_and_leaves_tables_and_commands_whole():
    sentence = "first diverging module: " + " ".join(["layers.1.attn.q_norm"] * 12)
    command = "reproduce: python -m pytest " + "x" * 150
    row = "   grad/w1 mismatch" + " " * 130 + "0,1"
    text = fitted("\n".join([sentence, command, row]), 60)
    assert all(len(line) <= 60 for line in text.splitlines()[:-2]), text
    assert text.splitlines()[-2:] == [command, row]
    assert first_line(text) == sentence


@pytest.mark.slow
def test_cells_failing_alike_print_once_and_every_line_fits_120_columns(tmp_path):
    project = UserProject(tmp_path / "project", {"conftest.py": CONFTEST, "test_mine.py": TESTS}, ini=False)
    ran = project.pytest()
    out = ran.stdout
    failures = out[out.index("= FAILURES ="):out.index("= parity summary =")]
    # (counted in the failures section: pytest's short summary repeats each first line, whole on CI)
    assert ran.returncode == 1 and failures.count(" diverges from the reference (") == 2, out
    assert all(len(line) <= 120 for line in failures.splitlines() if not line.startswith("reproduce:")), failures
    # the partial sums print once, with the ids of the cells that fail alike; each of those in its lines
    where = ("all 2 compared events match; grad/b2, grad/ln_b, grad/ln_w are per-rank partial sums over tp "
             "(summed they match the reference): their all-reduce over tp is missing")
    assert flat(failures).count(where) == 3, failures
    first = next(cell for cell in ALIKE if f"{cell} diverges from the reference" in out)
    others = [cell for cell in ALIKE if cell != first]
    assert "2 more cells fail alike (printed once, here): " + ", ".join(sorted(others, key=out.index)) in flat(out)
    for cell in others:
        assert f"{cell} fails as {first} does (printed in full): {where}" in flat(failures), failures
        assert f"reproduce: {sys.executable} -m pytest 'test_mine.py::test_mine[{cell}]'" in out
    # a scale of another implementation is its own way of failing, named with its group
    assert (f"{SCALED} diverges" in out and "grad/b1, grad/b2, grad/w1, grad/w2 are the reference x 1/2 = 1/tp"
            in flat(failures)), failures
    # the junit record keeps every cell's whole failure, and the report reads its whole table back
    cells = list(ran.cells.values())
    assert len(cells) == 4 and all("diverges from the reference" in case.text for case in cells)
    for case in cells:
        rows = table_rows(_failure_text(case))
        assert rows and all(row["rel err"] for row in rows if row["problem"] == "mismatch"), case.text
