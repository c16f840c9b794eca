"""harness.explore: valid configs drawn from what components declare, the command a user runs (from a
project of their own), planted bugs that the fixed matrix misses and exploration finds, the replay of
a stored failure, the pytest entry and the nightly workflow."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from harness.bisect.runner import Trials
from harness.config import Config
from harness.explore.__main__ import targets
from harness.explore.strategies import configs, runnable
from harness.registry import COMPONENTS, Component, Space, get, register_component, register_implementation
from harness.parallel.moe import layout as moe_layout
from harness.parallel.pipeline_schedule import rounds

from .test_workflow import lint, load

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "explore.yml"
# planted bugs (tests/planted_explore.py): target -> (base implementation, cases module, the shape of
# config that shows the bug: what every shrunk failure must have)
PLANTED = {
    # what it cuts on dim 1 at array_split's offsets: the row weights' f, and under op=sp the sequence s
    # of the input and the output (an unseeded search found it there: tp4 f12 s10 sp)
    "tp:rowsplit": ("tp_row_offsets_array_split", "ours", "cases.test_tp",
                    lambda c: c.degree("tp") >= 3 and any(
                        c.size(d) % c.degree("tp") not in (0, c.degree("tp") - 1)
                        for d in (("f", "s") if c.switch("op") == "sp" else ("f",)))),
    # dropless over two or more ep ranks, routing that can pass ep rank 0 by (route one feeds it every
    # first choice; skew at ep >= 3 can leave it idle: found at ep7 e14 k1 t14); a found failure
    # without these is not the planted bug (a bf16 grad/w_up at ep=1 passed as it)
    "moe:idlefirst": ("moe_first_rank_idle_counts_aux_twice", "ours", "cases.test_moe",
                      lambda c: c.switch("cap") == "none" and c.switch("route") != "one" and moe_layout(c).ep > 1),
    "pp:oddrounds": ("pp_interleaved_odd_rounds_last_twice", "ours", "cases.test_pipeline",
                     lambda c: c.switch("sched") == "interleaved" and c.size("m") % 2 == 1
                     and rounds(c.degree("pp"), c.size("m")) > 1),
    "ringattn:oddhalves": ("ring_odd_chunk_diagonal_halves", "ours", "cases.test_ring_attention",
                           lambda c: c.degree("cp") > 1 and c.switch("layout") == "contig"
                           and c.switch("mask") == "causal" and (c.size("s") // c.degree("cp")) % 2 == 1),
}
# the tolerance policy's declared limits (README, Exploration) that exploration otherwise meets
# before the planted bug: the probe loss; ring attention's fp32 input gradients (err/tol 1.0-3.4);
# a router gradient that balanced routing makes analytically zero (grad/router only: param/router
# is the parameter plus a step); the MoE expert gradients in bf16 (err/tol 1.06-1.2). The planted
# MoE bug shows in aux and grad/x, which stay compared.
IGNORE = {"tp:rowsplit": ["--ignore", "loss"], "pp:oddrounds": ["--ignore", "loss"],
          "moe:idlefirst": [a for t in ("loss", "grad/router", "grad/w_gate", "grad/w_up", "grad/w_down")
                            for a in ("--ignore", t)],
          "ringattn:oddhalves": ["--ignore", "loss"] + [a for t in ("q", "k", "v", "x", "wq", "wk", "wv", "wo")
                                                         for a in ("--ignore", t)]}
CONFTEST = "from harness.registry import register_implementation\n" + "".join(
    f'register_implementation("{t.split(":")[0]}", "{t.split(":")[1]}", "tests.planted_explore:{fn}")\n'
    for t, (fn, *_) in PLANTED.items())
for target, (function, *_) in PLANTED.items():  # for the in-process matrix check below
    register_implementation(*target.split(":"), f"tests.planted_explore:{function}")


def explore(project: Path, *args, timeout=900, conftest: str = CONFTEST) -> subprocess.CompletedProcess:
    """``python -m harness.explore`` as a user runs it, from ``project`` (its conftest registers the
    planted implementations), with this checkout importable as an installed harness would be."""
    project.mkdir(exist_ok=True)
    (project / "conftest.py").write_text(conftest)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(project), str(ROOT)]))
    return subprocess.run([sys.executable, "-m", "harness.explore", *args], cwd=project, env=env,
                          capture_output=True, text=True, timeout=timeout)


def results(project: Path) -> list[dict]:
    return json.loads((project / "explore-out" / "result.json").read_text())


# ---- strategies: only valid configs, from declarations alone ------------------------------------------
BUILT_IN = [("tp", "ours"), ("tp", "dtensor"), ("ringattn", "ours"), ("moe", "ours"), ("pp", "ours"),
            ("pp", "torch"), ("fsdp", "ours"), ("fsdp", "fsdp2"), ("ckpt", "dcp")]


@pytest.mark.parametrize("component,impl", BUILT_IN)
def test_drawn_configs_pass_the_rules_fit_the_pool_and_vary(component, impl):
    drawn = []

    @settings(max_examples=40, database=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(configs(component, impl, 4))
    def check(cfg):
        assert runnable(cfg, 4) is None, cfg.id  # the rules accept it, the pool holds it, no skip
        assert (cfg.component, cfg.impl) == (component, impl)
        drawn.append(cfg)

    check()
    assert len({c.mesh for c in drawn}) >= 3 and len({c.sizes for c in drawn}) > 10  # ckpt has w1..w4 at 4 ranks
    assert {c.dtype for c in drawn} == set(get(component).space.dtypes)


def test_a_component_registered_later_and_a_users_implementation_are_explored_without_new_code():
    tp = get("tp")
    toy = Component("toytp", tp.reference, tp.validate, tp.reduction, dict(tp.implementations),
                    space=Space(dims=("tp",), sizes=dict(b=(1, 2), s=(1, 4), h=(2, 4), f=(1, 6), v=(1, 6)),
                                switches={"op": ("mlp", "sp")}, dtypes=("fp32",)))
    register_component(toy)
    register_implementation("tp", "mine", "harness.parallel.tp:run")
    try:
        seen = []

        @settings(max_examples=25, database=None, suppress_health_check=list(HealthCheck))
        @given(configs("toytp", "ours", 3), configs("tp", "mine", 3))
        def check(cfg, mine):
            assert cfg.component == "toytp" and cfg.dims.keys() == {"tp"} and cfg.switch("op") in ("mlp", "sp")
            assert cfg.world <= 3 and cfg.size("f") <= 6 and runnable(cfg, 3) is None
            assert mine.impl == "mine" and runnable(mine, 3) is None
            seen.append(cfg)

        check()
        assert ("toytp", "ours") in targets(["toytp"]) and ("tp", "mine") in targets(["tp"])
        assert {c.switch("op") for c in seen} == {"mlp", "sp"}
    finally:
        COMPONENTS.pop("toytp")
        tp.implementations.pop("mine")


def test_a_component_without_a_space_names_the_fix():
    tp = get("tp")
    register_component(Component("nospace", tp.reference, tp.validate, tp.reduction, dict(tp.implementations)))
    try:
        with pytest.raises(ValueError, match=r"declares no exploration space: add space=Space"):
            targets(["nospace"])
    finally:
        COMPONENTS.pop("nospace")


@pytest.mark.parametrize("args,message", [
    (["nosuch"], "unknown component 'nosuch'"),
    (["tp:nosuch"], "no implementation 'nosuch' of tp"),
    (["tp", "--max-examples", "0"], "--max-examples needs at least 1"),
])
def test_usage_errors_exit_2_with_one_line(tmp_path, args, message):
    done = explore(tmp_path / "project", *args, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("python -m harness.explore: error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr
    assert "Traceback" not in done.stderr


# ---- the fixed matrix misses every planted bug ----------------------------------------------------------
@pytest.mark.slow  # every matrix cell of four components, about 500 cells
@pytest.mark.parametrize("target", list(PLANTED))
def test_the_fixed_matrix_misses_the_planted_bug(target, rank_pool):
    import importlib

    _, base, module, _ = PLANTED[target]
    component, impl = target.split(":")
    cases = importlib.import_module(module)
    cells = [c.replace(impl=impl) for c in getattr(cases, "FULL", cases.CELLS)  # the full product, not the gate's design
             if c.component == component and c.impl == base]
    trials = Trials(rank_pool, max_trials=len(cells) + 1, max_seconds=3600, quiet=True)
    failed = [cfg.id for cfg in cells if trials.run(cfg).signature.failed]
    assert len(cells) > 50 and not failed, failed


# ---- exploration finds each, from a project of the user's own ---------------------------------------------
# How many new configs a search meets before each planted bug, unseeded (python -m harness.explore
# <target> --database none; 10 runs of tp, 4 of the others): tp:rowsplit 15-220 (mean 124),
# moe:idlefirst 11-105 (58), pp:oddrounds 12-74 (45), ringattn:oddhalves 27-485 (219). A seeded
# search is one such draw, fixed until the strategies or hypothesis change (not with edits elsewhere:
# test_a_seeded_search_draws_the_same_configs...), so the examples are sized for any draw: 3000 are
# about 1950 new configs (tp), spent only when nothing is found. 500 missed tp's bug 1 run in 16 (once
# in CI), and 600 left seed 0 of ring attention finding its bug at trial 329.
EXAMPLES = "3000"
# the seed of each target's search: 0, but for moe, whose seed 0 meets the bug only at trial 240 (175 s
# of a 2-core machine) where seed 1 meets it at trial 15 (9 s); the examples cover a change of draw
SEEDS = {"moe:idlefirst": "1"}


@pytest.mark.slow  # each runs until it finds and shrinks the bug: a minute or a few
@pytest.mark.parametrize("target", list(PLANTED))
def test_exploration_finds_and_shrinks_the_planted_bug(tmp_path, target):
    project = tmp_path / "project"
    # seeded: the same draws in every run, so whether the bug is found within the examples does not
    # hang on luck or on the machine's load (the seconds only bound a stuck run)
    done = explore(project, target, *IGNORE[target], "--seed", SEEDS.get(target, "0"), "--max-examples", EXAMPLES,
                   # 5 s of shrinking, both halves (hypothesis's, then bisect's search) run: what a shrunk
                   # config must be (the bug's shape) holds for any failure the search meets, so the shape
                   # is the check, not how far it shrank (a whole shrink takes 25-36 s here)
                   "--max-seconds", "1500", "--shrink-seconds", "5", timeout=2400)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    (found,) = results(project)
    minimal, first = Config.parse(found["minimal"]), Config.parse(found["first"])
    shape = PLANTED[target][3]
    assert shape(minimal) and shape(first), (minimal.id, first.id)
    assert f'CELLS.append(Config.parse("{minimal.id}"))' in done.stdout
    assert f"-m harness.bisect check {minimal.id}" in done.stdout
    assert "[explore " in done.stderr  # the progress lines
    print(f"{target}: found at trial {found['found at trial']} after {found['found after seconds']} s; "
          f"shrunk to {minimal.id} in {found['trials']} trials, {found['seconds']} s")


@pytest.mark.slow
def test_a_seeded_search_draws_the_same_configs_whatever_literals_the_projects_modules_hold_and_finding_nothing_exits_0(
        tmp_path):
    # hypothesis mixes the literals of the local modules it finds loaded into its integer draws; a
    # seeded search must stay the same search when a module of the project (or of the harness) is edited
    def drawn(project: Path, conftest: str = CONFTEST) -> list[str]:
        # 150 examples, about 90 new configs: with seeds drawn up to 999, the literals' 1 integer in 20
        # makes two such searches differ in all but 1 run in 100 (0.95 ** 90)
        done = explore(project, "tp:ours", "--ignore", "loss", "--seed", "0", "--max-examples", "150",
                       "--database", "none", conftest=conftest)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # nothing found: exit 0
        (found,) = results(project)
        assert found["verdict"] == "no divergence" and 1 <= found["trials"] <= 150, found
        assert "tp:ours: nothing found in" in done.stderr
        return [line.split()[-1] for line in done.stderr.splitlines() if " search trial " in line]

    plain = drawn(tmp_path / "plain")
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "literals.py").write_text("LIMITS = (100, 127, 1009, 4099, 20011, 65000)\n")
    assert len(plain) > 60 and drawn(edited, CONFTEST + "import literals  # noqa: F401\n") == plain


def replays(project: Path, budget: tuple[str, ...]) -> dict:
    """A second search of tp:rowsplit in ``project``, whose database holds the failure a first one
    stored: it replays it first and reports it in seconds. Its result."""
    again = explore(project, "tp:rowsplit", *budget)
    assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-3000:]
    (two,) = results(project)
    assert two["stored examples"] == 1 and two["replayed from the database"] and two["found at trial"] == 1, two
    assert two["found after seconds"] < 10, two
    assert "[explore tp:rowsplit] replay" in again.stderr
    assert "replayed from the example database" in again.stdout
    assert PLANTED["tp:rowsplit"][3](Config.parse(two["minimal"])), two["minimal"]
    return two


@pytest.mark.slow
def test_a_second_run_replays_a_failure_whose_shrinking_was_cut_short(tmp_path):
    """0.2 s: hypothesis's shrinking is cut short (by an exception through hypothesis); the config it
    was trying then passes, and it must not reach the database (it did, and a loaded CI run replayed
    it first). The replay of a fully shrunk failure: the pytest entry's test below."""
    project = tmp_path / "project"
    # unseeded, the only kind of search that stores its failure in the database
    budget = ("--ignore", "loss", "--max-examples", EXAMPLES, "--max-seconds", "400", "--shrink-seconds", "0.2")
    first = explore(project, "tp:rowsplit", *budget)
    assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]
    assert list((project / ".hypothesis" / "explore").iterdir())  # the database is in the project
    (one,) = results(project)
    two = replays(project, budget)
    assert two["minimal"] == one["minimal"] or two["trials"] <= one["trials"]


# ---- the pytest entry ------------------------------------------------------------------------------------
TEST_MODULE = '''
import pytest
from harness.matrix import cells
from reference.tp import SIZES

CELLS = cells("tp", impls=["rowsplit"], meshes=["tp=2"], dtypes=["fp32"], sizes=SIZES, switches={"op": ["mlp"]})


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_mine(cfg, parity):
    parity(cfg)
'''


@pytest.mark.slow
def test_pytest_explore_fails_the_target_whose_cells_it_selected_and_the_command_line_replays_its_failure(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_mine.py").write_text(TEST_MODULE)
    (project / "conftest.py").write_text(CONFTEST)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(project), str(ROOT)]))
    matrix = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_mine.py"], cwd=project,
                            env=env, capture_output=True, text=True, timeout=600)
    assert matrix.returncode == 0, matrix.stdout[-3000:]  # its one cell passes
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_mine.py", "--explore", EXAMPLES,
                           # the declared loss limit (README, Exploration); unseeded, so the database is used;
                           # shrunk 5 s, as the command line's searches above (the shape is the check)
                           "--explore-ignore", "loss", "--explore-shrink-seconds", "5"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "FAILED ::explore[tp:rowsplit] - Failed: tp:rowsplit: found tp-rowsplit-tp" in done.stdout, done.stdout[-3000:]
    assert "1 failed, 1 deselected" in done.stdout  # the cell it selected is explored, not run
    assert "[explore tp:rowsplit] search" in done.stdout  # progress lines reach the terminal
    assert 'add it to the matrix in test_mine.py: CELLS.append(Config.parse("tp-rowsplit-' in done.stdout
    assert list((project / ".hypothesis" / "explore").iterdir())
    # the same project's database, under the same key: the command line replays what the gate found
    replays(project, ("--ignore", "loss", "--max-examples", EXAMPLES, "--max-seconds", "400", "--shrink-seconds", "5"))


# ---- the nightly workflow ---------------------------------------------------------------------------------
def test_actionlint_accepts_the_explore_workflow():
    """Linted as tests/test_workflow.py lints the gate (skips, saying so, without actionlint)."""
    done = lint(WORKFLOW)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_explore_workflow_runs_nightly_on_every_component_and_uploads_the_report():
    import yaml

    flow = yaml.safe_load(WORKFLOW.read_text())
    triggers = flow[True]  # YAML 1.1 reads the key "on" as True
    assert triggers["schedule"][0]["cron"] and "workflow_dispatch" in triggers and "pull_request" not in triggers
    steps = flow["jobs"]["explore"]["steps"]
    run = next(s["run"] for s in steps if "harness.explore" in s.get("run", ""))
    assert "$EXPLORE_TARGETS" in run and flow["env"]["EXPLORE_TARGETS"].endswith("'all' }}")
    assert any(s.get("uses", "").startswith("actions/upload-artifact") for s in steps)
    assert any(s.get("with", {}).get("path") == ".hypothesis/explore" for s in steps)  # the database, night to night
    assert "parity" in load(ROOT / ".github" / "workflows" / "parity.yml")["name"]  # the gate is a separate workflow


@pytest.mark.slow
def test_the_explore_step_runs_here(tmp_path):
    import yaml

    step = next(s for s in yaml.safe_load(WORKFLOW.read_text())["jobs"]["explore"]["steps"] if s.get("id") == "explore")
    output, reports = tmp_path / "output", tmp_path / "reports"
    env = dict(os.environ, EXPLORE_TARGETS="tp:ours", EXPLORE_SECONDS="20", EXPLORE_EXAMPLES="3",
               REPORTS=str(reports), GITHUB_OUTPUT=str(output))
    command = step["run"].replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
    done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", command], cwd=tmp_path,
                          env=dict(env, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert output.read_text().strip() == "status=0"
    assert json.loads((reports / "explore" / "result.json").read_text())[0]["target"] == "tp:ours"
    assert "explored 1 target(s): 0 diverged" in (reports / "explore" / "summary.txt").read_text()


def test_explores_pool_imports_the_targets_modules_not_every_registered_ones():
    """The zygotes of ``python -m harness.explore tp:ours`` import what tp's component and our
    implementation need, not transformers and Megatron-Core (seconds, each explore run)."""
    from harness.pool.parent import preloads

    options = preloads(targets(["tp:ours"]))
    assert "harness.parallel.tp" in options["preload"] and "reference.tp" in options["alone_preload"]
    heavy = {"harness.parallel.tp_megatron", "harness.parallel.tp_hf", "harness.examples.hf"}
    assert not heavy & (set(options["preload"]) | set(options["alone_preload"])), options
    assert "harness.parallel.tp_hf" in preloads(targets(["tp"]))["preload"]  # every implementation of tp
