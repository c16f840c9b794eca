"""harness.report on a real run with one planted bug: the summary, the annotations and the heatmap
must all point at the failing cells, and at no other."""
import math
import re
import subprocess
import sys

import matplotlib.image
import pytest

from harness.report.heatmap import FAIL, grid, render
from harness.report.junit import read
from harness.compare.diff import Report, Row
from harness.report.markdown import annotations, table_rows

from tests.project import UserProject

from .ci_project import BUGGY, CASES, CONFTEST, ROOT, expected_red


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    """The planted-bug project, run once under xdist with junit XML (as the workflow runs the matrix):
    its directory and the run."""
    project = UserProject(tmp_path_factory.mktemp("planted") / "project",
                          {"test_cells.py": CASES, "buggy.py": BUGGY, "conftest.py": CONFTEST})
    done = project.run("python", "-m", "pytest", "-p", "no:cacheprovider", "--pool-size", "4", "-n", "2",
                       "--junitxml", "junit.xml")
    assert done.returncode == 1, done.tail
    return project.path, done


@pytest.fixture(scope="module")
def planted(planted_run):
    return planted_run[0]


@pytest.fixture(scope="module")
def reported(planted):
    summary = planted / "step-summary.md"
    summary.write_text("earlier step's summary\n")  # appended to, as $GITHUB_STEP_SUMMARY is
    done = subprocess.run([sys.executable, "-m", "harness.report", "--junit", str(planted / "junit.xml"),
                           "--out", str(planted / "reports"), "--annotate", "--root", str(planted),
                           "--step-summary", str(summary)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return planted, summary.read_text(), done.stdout


def test_the_junit_records_hold_every_cell_and_the_bug_turns_exactly_the_expected_cells_red(planted):
    results = read([planted / "junit.xml"])
    red = {c.cell for c in results.cells if c.record["status"] == "failed"}
    everything = {c.cell for c in results.cells}
    assert len(everything) == 24
    assert red == {c for c in everything if expected_red(c)} and len(red) == 4


def test_each_failing_cell_is_said_the_moment_it_fails_amid_the_progress_dots(planted_run):
    project, done = planted_run
    before = done.stdout.split("= FAILURES =")[0]  # what the run printed while its cells ran
    said = re.findall(r"^FAILED (\S+): (.+)$", before, re.M)
    records = {c.cell: c.record for c in read([project / "junit.xml"]).cells}
    red = {cell for cell in records if expected_red(cell)}
    assert sorted(cell for cell, _ in said) == sorted(red) and len(red) == 4, before
    for cell, where in said:  # where its diagnosis says it starts, within 120 columns
        assert len(f"FAILED {cell}: {where}") <= 120
        assert records[cell]["where"].startswith(where.removesuffix("...")), (where, records[cell])


def test_the_summary_leads_with_the_failures_and_names_each_failing_cell_with_table_and_reproduce(reported):
    project, summary, _ = reported
    assert summary.startswith("earlier step's summary\n## ❌ Parity: 4 of 24 cells failed")
    row = next(line for line in summary.splitlines() if line.startswith("| `tp` |"))
    assert [c.strip() for c in row.split("|")[2:5]] == ["20", "4", "0"]
    assert float(row.split("|")[5]) > 100  # worst err/tol: the failed cells' real ratio
    failing = re.findall(r"^\| `(tp-[^`]+)` \| mismatch \|", summary, re.M)
    assert sorted(failing) == sorted(c for c in failing if expected_red(c)) and len(failing) == 4
    for cell in failing:
        section = summary.split(f"#### `{cell}`")[1].split("####")[0]
        assert f"{cell} diverges from the reference" in section
        assert re.search(r"^\s+out mismatch", section, re.M)  # the divergence table
        assert f"-m pytest 'test_cells.py::test_tp[{cell}]'" in section  # its reproduce command
    # the fp32 cells' err/tol (1e5 and beyond) and out's norm ratio, not a replica row's 1
    assert re.search(r"fp32-[^`]+` \| mismatch \| `out` \| \d\.\d\de\+0[5-9] \| 0\.7\d+ \(`out`\) \|$", summary, re.M)
    assert "tp-buggy-tp1-" not in summary and "tp-ours-tp2-fp32-op_mlp" not in summary


def test_annotations_name_the_failing_cells_at_their_test_function(reported):
    project, _, stdout = reported
    lines = [line for line in stdout.splitlines() if line.startswith("::error ")]
    test_line = next(n for n, text in enumerate(CASES.splitlines(), 1) if text.startswith("def test_tp("))
    cells = []
    for line in lines:
        assert line.startswith(f"::error file=test_cells.py,line={test_line},title=parity mismatch%3A tp-buggy-")
        cells.append(re.search(r"title=parity mismatch%3A (\S+)::", line).group(1))
        assert "reproduce: " in line and "%0A" in line  # the message's newline escaped
    assert len(lines) == 4 and all(expected_red(c) for c in cells)
    # the same list from the library, as the workflow's report step prints it
    assert annotations(read([project / "junit.xml"]), project) == lines


def test_the_heatmap_is_red_exactly_where_cells_failed(reported):
    project, _, _ = reported
    results = read([project / "junit.xml"])
    g = grid("tp", [c.record for c in results.cells])
    assert {(impl, mesh, g.columns[col][0]) for impl, mesh, col in g.failed()} == {
        ("buggy", mesh, dtype) for mesh in ("tp2", "dp2.tp2") for dtype in ("fp32", "bf16")}
    assert all(dict(g.columns[col][1])["op"] == "mlp" for _, _, col in g.failed())
    png = project / "check.png"
    centres = render(g, png)
    pixels = matplotlib.image.imread(png)
    red = tuple(int(FAIL[i:i + 2], 16) / 255 for i in (1, 3, 5))

    def is_red(xy):  # a few pixels off the centre: the centre holds the ✗ and ratio text
        x, y = int(xy[0]) - 30, int(xy[1])
        return all(abs(float(pixels[y, x][i]) - red[i]) < 0.02 for i in range(3))

    assert {key for key, xy in centres.items() if is_red(xy)} == set(g.failed())
    # the report wrote the same picture, and the HTML page embeds it
    assert (project / "reports" / "heatmap-tp.png").stat().st_size > 10_000
    page = (project / "reports" / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 1 and all(c in page for c in
                                                             {c.cell for c in results.cells if expected_red(c.cell)})


def test_sizes_fold_into_their_worst_and_a_square_is_as_bad_as_its_worst_cell():
    def record(cell, status, ratio, impl="ours", mesh="tp2", size=8):
        return {"cell": f"{cell}-{size}", "component": "tp", "impl": impl, "mesh": mesh, "dtype": "fp32",
                "switches": {"op": "mlp"}, "status": status, "ratio": ratio}

    g = grid("tp", [record("a", "passed", 0.1, size=8), record("a", "passed", 0.3, size=16),
                    record("b", "skipped", 0.0, mesh="tp4"), record("c", "failed", 50.0, mesh="tp1"),
                    record("c", "passed", 0.2, mesh="tp1", size=16)])
    assert g.meshes == ["tp1", "tp2", "tp4"]  # by world size
    assert g.ratio[("ours", "tp2", 0)] == 0.3 and g.status[("ours", "tp2", 0)] == "passed"
    assert g.status[("ours", "tp4", 0)] == "skipped" and ("ours", "tp4", 0) not in g.ratio
    assert g.status[("ours", "tp1", 0)] == "failed" and g.ratio[("ours", "tp1", 0)] == 50.0
    assert g.failed() == [("ours", "tp1", 0)]


def test_the_divergence_table_reads_back_column_by_column_empty_cells_included():
    report = Report([Row("loss", False, "mismatch", (), actual=-0.066, expected=0.36, abs_err=0.43, rel_err=1.18,
                         tol=2.5e-5, ratio=1.7e4, norm_ratio=0.1839, bad="1/1", ranks="0,1"),
                     Row("out", False, "replicas", abs_err=2.8, tol=4.4e-6, ratio=6.3e5,
                         bad="copies differ", ranks="0,1"),
                     Row("grad.w", False, "nan/inf", (2, 5, 13), actual=math.nan, expected=0.25, abs_err=math.inf,
                         rel_err=math.inf, tol=6e-6, ratio=math.inf, norm_ratio=0.7699, bad="512/512",
                         ranks="0,1,2,3")])
    rows = table_rows(f"cell diverges:\n{report.table()}\nreproduce: x")
    assert [(r["tensor"], r["problem"], r["worst index"], r["norm ratio"], r["bad ranks"]) for r in rows] == [
        ("loss", "mismatch", "", "0.1839", "0,1"), ("out", "replicas", "", "1", "0,1"),
        ("grad.w", "nan/inf", "(2,5,13)", "0.7699", "0,1,2,3")]
    assert rows[1]["bad"] == "copies differ" and rows[0]["err/tol"] == "1.7e+04"


def test_a_narrow_table_on_screen_and_the_whole_one_in_the_report():
    from harness.compare import diff
    from harness.report import markdown
    from harness.report.junit import TestCase
    from harness.report.markdown import _failure_text

    assert (markdown.TABLE_COLUMNS, markdown.WHOLE_TABLE) == (diff.COLUMNS, diff.WHOLE_TABLE)
    names = [f"opt/exp_avg_sq/model.layers.{i}.self_attn.q_norm.weight" for i in range(5)]
    report = Report([Row(name, False, "mismatch", (i, 3), actual=1.5, expected=0.25, abs_err=1.25, rel_err=5.0,
                         tol=1e-6, ratio=1.25e6, norm_ratio=0.5, bad="32/32", ranks="0,1")
                     for i, name in enumerate(names)])
    whole = report.table()
    assert max(map(len, whole.splitlines())) > 100
    for width in (110, 96):
        shown = report.table(most=3, width=width)
        lines = shown.splitlines()
        assert max(map(len, lines[:-1])) <= width, shown
        assert lines[-1].startswith("... 2 more rows, rel err, abs err, tol"), shown
        assert lines[-1].endswith(": in its junit record (python -m harness.report)") and len(lines[-1]) <= 120
        case = TestCase("c", "n", "failed", 1.0, text=f"cell diverges:\n{shown}\nreproduce: x", record={"table": whole})
        rows = table_rows(_failure_text(case))
        assert [r["tensor"] for r in rows] == names and rows[4]["worst index"] == "(4,3)"
    # names shortened last, from the start of the parameter's path: what tells them apart stays
    assert report.table(width=110).splitlines()[1].startswith("opt/exp_avg_sq/...rs.0.self_attn.q_norm.weight ")
