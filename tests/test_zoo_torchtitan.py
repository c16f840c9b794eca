"""``python -m harness.zoo torchtitan`` as a user runs it, from a directory of their own, with torchtitan
installed as docs/zoo.md says (the extra, then torchtitan without its dependencies) into an environment
of the test's over this one: qwen3 through torchtitan's own ``parallelize_fn`` green on both DTensor
backends with sequence parallel on and off; bugs planted in torchtitan (in a copy of the installed
package: FSDP's gradient division left on; the expert-parallel combine's routing scores detached; a
policy computing in fp32 in a bf16 cell) red where they act and green where they do not; the known
crash shown with torch and torchtitan alone; the release before (0.2.2) through its own glue, a plant
in it red where it acts; without torchtitan, or with a series the zoo has no glue for, one line that
says what to install."""
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from harness.zoo.torchtitan import VERSION
from harness.zoo.torchtitan_0_2 import VERSION as RELEASE_BEFORE
from tests.checkout import venv_over_this_one, venv_with_release
from tests.project import junit_texts
from tests.test_torchrun import env_for, private_tmpdir  # noqa: F401  (autouse fixture)

ROOT = Path(__file__).resolve().parent.parent
# pyproject's torchtitan extra, which this run's install (README's: thirdparty, ci) lacks
EXTRA = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["torchtitan"]


def planted_copy(python: Path, tmp_path: Path, cwd: Path | None = None) -> tuple[Path, dict[str, str]]:
    """A copy of ``python``'s installed torchtitan package to plant bugs in (found, not imported: 0.2's
    package imports triton), and the environment of a run from ``cwd`` (``tmp_path``) that imports it first."""
    installed = subprocess.run([str(python), "-c", "import importlib.util as u; "
                                "print(u.find_spec('torchtitan').submodule_search_locations[0])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    planted = tmp_path / "planted"
    shutil.copytree(installed, planted / "torchtitan")
    env = env_for(cwd or tmp_path)
    return planted / "torchtitan", dict(env, PYTHONPATH=os.pathsep.join([str(planted), env["PYTHONPATH"]]))


def titan_venv(dest: Path, release: str) -> Path:
    """An environment over this one with torchtitan ``release`` installed as docs/zoo.md installs it."""
    python = venv_over_this_one(dest)
    for args in (EXTRA, ["--no-deps", f"torchtitan=={release}"]):
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", *args],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return python


@pytest.fixture(scope="module")
def titan_python(tmp_path_factory) -> Path:
    return titan_venv(tmp_path_factory.mktemp("titan") / "venv", VERSION)


def zoo(python, cwd: Path, *args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "harness.zoo", "torchtitan", *args], cwd=cwd,
                          env=env or env_for(cwd), capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # runs a zoo: a pytest process of its own and its pool
def test_qwen3_untied_and_tied_under_its_own_parallelize_are_green_on_both_backends_with_sp_on_and_off(
        titan_python, tmp_path):
    # the whole zoo (every model, mesh, backend and sp: 140 cells, about 10 minutes here) is the nightly's;
    # the tied one in the trainer's order (parallelized on meta, init_weights re-ties, the start loaded by
    # name): parallelizing the built model instead leaves the two apart, red on tp=2 at tok_embeddings.
    # dp=2,tp=2 is a BF16_MESHES mesh: each cell in fp32 and in the trainer's bf16 mixed precision too
    done = zoo(titan_python, tmp_path, "--only", "qwen3,qwen3_tied", "--meshes", "dp=2,tp=2", "-n", "0",
               "--out", "out")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads((tmp_path / "out" / "zoo.json").read_text())
    assert found["library"] == "torchtitan" and found["torchtitan"] == VERSION, found
    verdicts = {r["cell"]: r["verdict"] for r in found["cells"]}
    assert verdicts == {f"tt{model}-{impl}-dp2.tp2-{dtype}-sched_1f1b.sp_{sp}-steps3-seed0": "pass"
                        for model in ("qwen3", "qwen3tied") for impl in ("partial", "full") for sp in ("on", "off")
                        for dtype in ("fp32", "bf16")}, found["cells"]
    table = (tmp_path / "out" / "zoo.md").read_text()
    assert table.startswith(f"# torchtitan zoo (torchtitan {VERSION}, torch "), table[:300]
    # what it cannot run here and what it changed for a CPU, each with why, in the report itself
    not_run, shims = table.split("## Not run here")[-1].split("## CPU shims, none touching the parallel math")
    assert "| context parallel | its SDPA on a CPU has no DTensor sharding rule |" in not_run, table
    assert "| FSDP's PREMUL_SUM | a plain SUM (gloo has no PREMUL_SUM; the factor is 1) |" in shims, table
    assert found["not_run"]["the spmd_types backend"] and found["shims"]["FlexAttention"], found


TEST = '''
import pytest
from harness.model import model_cells
from harness.zoo.torchtitan import zoo_cells

CELLS = zoo_cells(only=["llama3"], plans=("partial",), meshes=("dp=2", "tp=2", "pp=2")) + model_cells(
    "ttllama3", impls=["partial"], meshes=["tp=2"], dtypes=["bf16"], switches={"sp": ["off"], "sched": ["1f1b"]})


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_zoo(cfg, parity):
    parity(cfg)
'''


@pytest.mark.slow  # runs a zoo: a pytest process of its own and its pool
def test_bugs_planted_in_torchtitan_are_red_where_fsdp_reduces_and_where_1f1b_pipelines(titan_python, tmp_path):
    # a copy of the installed torchtitan, first on the path, with FSDP's division left on (gradients 1/dp),
    # and the single-stage schedules (1F1B) dividing the gradients by the microbatches again, though each
    # microbatch's loss is already its share of the global mean (the looped ones, Interleaved1F1B, right)
    project = tmp_path / "project"
    package, env = planted_copy(titan_python, tmp_path, cwd=project)
    fsdp = package / "distributed" / "fsdp.py"
    text = fsdp.read_text()
    assert "module.set_gradient_divide_factor(1.0)" in text
    fsdp.write_text(text.replace("module.set_gradient_divide_factor(1.0)", "pass  # planted", 1))
    pipeline = package / "distributed" / "pipeline_parallel.py"
    text = pipeline.read_text()
    single = text.index("schedule = schedule_class(\n            stages[0],")
    at = text.index("scale_grads=False", single)
    pipeline.write_text(text[:at] + "scale_grads=True" + text[at + len("scale_grads=False"):])
    # and llama3's FSDP2 policy computing in fp32 whatever mixed_precision_param says: its bf16 cell ran fp32
    policy = package / "models" / "llama3" / "parallelize.py"
    text = policy.read_text()
    assert text.count("param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param]") == 1
    policy.write_text(text.replace("param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param]",
                                          "param_dtype=TORCH_DTYPE_MAP[\"float32\"]"))
    project.mkdir()
    (project / "test_zoo.py").write_text(TEST)
    (project / "pytest.ini").write_text("[pytest]\n")
    done = subprocess.run([str(titan_python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf"], cwd=project,
                          env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout
    # dp=2 runs sp_off alone (SP acts with tp only), tp=2 both, pp=2 each schedule; tp=2 in bf16 too
    assert done.returncode == 1 and "3 failed, 3 passed" in out, out[-5000:] + done.stderr[-2000:]
    # the FAILED lines' node ids (a line may repeat its id in its message: CI's terminal is wider)
    failed = sorted(line.split()[1] for line in out.split("short test summary")[1].splitlines() if line.startswith("FAILED"))
    assert len(failed) == 3 and "ttllama3-partial-dp2-fp32-sched_1f1b.sp_off-" in failed[0], failed
    assert "ttllama3-partial-pp2-fp32-sched_1f1b.sp_off-" in failed[1], failed
    assert "ttllama3-partial-tp2-bf16-sched_1f1b.sp_off-" in failed[2], failed
    assert "first diverging module: lm_head (parameter gradients, step 1)" in out and "1/dp" in out, out[-5000:]
    assert "bf16 ran in fp32: no module of parallelize 'partial' computed in bf16 on any rank" in " ".join(out.split()), \
        out[-5000:]


@pytest.mark.slow  # runs a zoo: a pytest process of its own and its pool
def test_a_bug_planted_in_torchtitans_expert_parallel_combine_is_red_on_the_ep_cells_alone(titan_python, tmp_path):
    # the all-to-all dispatcher's combine with the routing scores detached: the forward is unchanged, the
    # router's gradient is lost, on cells whose tokens cross ranks (ep > 1, borrowed from dp or from tp)
    package, env = planted_copy(titan_python, tmp_path)
    dispatcher = package / "models" / "common" / "token_dispatcher.py"
    text = dispatcher.read_text()
    scores = "* metadata.topk_scores_experts_sorted_N.reshape(-1, 1)"
    at = text.index(scores, text.index("class AllToAllTokenDispatcher"))
    dispatcher.write_text(text[:at] + scores.replace("N.reshape", "N.detach().reshape") + text[at + len(scores):])
    # qwen3 MoE, and deepseek_v3 (multi-head latent attention, a dense first layer, a shared expert)
    done = zoo(titan_python, tmp_path, "--only", "qwen3_moe,deepseek_v3", "--plans", "partial", "--meshes",
               "dp=2;dp=2,tp=2", "-n", "0", "--out", "out", env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = {r["cell"]: r for r in json.loads((tmp_path / "out" / "zoo.json").read_text())["cells"]}
    verdicts = {}
    for model in ("qwen3moe", "deepseekv3"):
        cell = f"tt{model}-partial-{{}}-{{}}-ep_{{}}.sp_{{}}-steps3-seed0".format
        verdicts |= {cell("dp2", "fp32", 2, "off"): "red", cell("dp2.tp2", "fp32", 2, "on"): "red",  # the plant
                     cell("dp2", "bf16", 2, "off"): "red",  # in the trainer's bf16 mixed precision too (BF16_MOE_MESHES)
                     cell("dp2.tp2", "fp32", 1, "on"): "pass", cell("dp2.tp2", "fp32", 1, "off"): "pass",  # no all-to-all
                     cell("dp2.tp2", "fp32", 2, "off"): "known"}  # torchtitan 0.3.0's own crash (KNOWN_EP_TP_SP_OFF)
    assert {c: r["verdict"] for c, r in found.items()} == verdicts, found
    for red in (c for c, v in verdicts.items() if v == "red" and "-fp32-" in c):
        assert found[red]["why"].startswith("first diverging module: layers.1.moe.router.gate (input gradient, "
                                            "step 1, microbatch 0), in the backward pass: every judged forward "
                                            "output matches"), found[red]
    # the known crash's reproduction: the zoo's command, then the torch-and-torchtitan-only script
    assert found["ttdeepseekv3-partial-dp2.tp2-fp32-ep_2.sp_off-steps3-seed0"]["reproduce"] == (
        "python -m harness.zoo torchtitan --only deepseek_v3 --plans partial --meshes 'dp=2,tp=2'; "
        "torchrun --nproc-per-node 2 docs/torchtitan_repro.py --sp off"), found
    # in bf16 the gate's gradient is named: at step 1 (qwen3), or at step 2 where deepseek_v3's step 1 keeps
    # within the bf16 tolerance
    texts = junit_texts(tmp_path / "out" / "junit.xml")
    assert found["ttqwen3moe-partial-dp2-bf16-ep_2.sp_off-steps3-seed0"]["why"].startswith(
        "first diverging module: layers.1.moe.router.gate (parameter gradients, step 1), in the backward pass: every "
        "judged forward output matches"), found
    deepseek = " ".join(texts["ttdeepseekv3-partial-dp2-bf16-ep_2.sp_off-steps3-seed0"].split())
    assert ("first diverging module: none in step 1: every judged module's outputs and gradients match the reference "
            "there, and the gradients first diverge in step 2 (below)") in deepseek and (
            "first diverging parameter gradients (step 2, in backward order): layers.1.moe.router.gate.weight") \
        in deepseek, deepseek


@pytest.mark.slow  # two torchrun jobs in the module's virtual environment
def test_the_known_crash_is_shown_with_torch_and_torchtitan_alone(titan_python, tmp_path):
    """docs/torchtitan_repro.py, the maintainers' reproduction of KNOWN_EP_TP_SP_OFF (qwen3 MoE, ep
    borrowed from tp, torchtitan's own parallelize_fn): each rank raises the crash with SP off; with SP
    on both run forward and backward to the same loss."""
    def repro(sp: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(titan_python), "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               str(ROOT / "docs" / "torchtitan_repro.py"), "--sp", sp], cwd=tmp_path,
                              env=env_for(tmp_path), capture_output=True, text=True, timeout=300)

    off, on = repro("off"), repro("on")
    said = sorted(line for line in off.stdout.splitlines() if line.startswith("rank "))
    assert off.returncode == 1 and said == [
        f"rank {r}: partial_dtensor, tp=2, ep=2 (borrowed from tp), sequence parallel off: RuntimeError: Can not "
        "redistribute from S(1) to P(sum), redistributing to Partial is for internal use only!" for r in (0, 1)], \
        off.stdout[-3000:] + off.stderr[-3000:]
    ran = sorted(line for line in on.stdout.splitlines() if line.startswith("rank "))
    assert on.returncode == 0 and len(ran) == 2 and all("forward and backward ran, loss" in line for line in ran), \
        on.stdout[-3000:] + on.stderr[-3000:]
    assert ran[0].rsplit(" ", 1)[1] == ran[1].rsplit(" ", 1)[1], ran  # one loss: tp's ranks see one batch


def test_meshes_the_zoo_does_not_run_are_one_line_and_a_repeated_option_adds(titan_python, tmp_path):
    done = zoo(titan_python, tmp_path, "--only", "qwen3_moe", "--meshes", "dp=8", "--meshes", "dp=3;tp=8")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == ("python -m harness.zoo torchtitan: no cell of qwen3_moe on dp=8; dp=3; tp=8: the "
                                   "MoE models run dp=2; dp=2,tp=2; dp=4; pp=2,dp=2; rep=2,dp=2; rep=2,dp=2,tp=2; tp=2"), done.stderr
    assert not (tmp_path / "zoo-out").exists()


def test_without_torchtitan_the_zoo_says_how_to_install_it(tmp_path):
    if subprocess.run([sys.executable, "-c", "import torchtitan"], capture_output=True).returncode == 0:
        pytest.skip("torchtitan is installed here")
    done = zoo(sys.executable, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"pip install -e '.[torchtitan]' && pip install --no-deps torchtitan=={VERSION}" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # runs a zoo: a pytest process of its own and its pool
def test_the_release_before_runs_through_its_own_glue_red_where_a_plant_acts(tmp_path):
    """torchtitan 0.2.2 installed as docs/zoo.md installs 0.3.0: the zoo runs it through its 0.2 glue
    (TrainSpec, JobConfig, explicit ParallelDims), with the same cell ids, so that diff compares the
    two releases. Planted in a copy of 0.2.2: llama3's FSDP division left on (gradients 1/dp); red on
    llama3's dp=2 cell, green on its tp=2 cell and on qwen3's and deepseek_v3's dp=2 cells, whose FSDP
    is llama4's: deepseek_v3's expert parallel on torchtitan's own CPU permutation, in fp32 and bf16,
    and its ep borrowed from tp=2 the known crash of 0.2.2, held to its line."""
    python = titan_venv(tmp_path / "venv", RELEASE_BEFORE)
    package, env = planted_copy(python, tmp_path)
    fsdp = package / "models" / "llama3" / "infra" / "parallelize.py"
    text = fsdp.read_text()  # the call in llama3's apply_fsdp; llama4's, which qwen3 uses, calls it too
    assert text.count("    disable_fsdp_gradient_division(model)\n") == 1
    fsdp.write_text(text.replace("    disable_fsdp_gradient_division(model)\n", "    pass  # planted\n"))
    done = zoo(python, tmp_path, "--only", "llama3,qwen3,deepseek_v3", "--meshes", "dp=2;tp=2", "-n", "0", "--out",
               "out", env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads((tmp_path / "out" / "zoo.json").read_text())
    assert found["torchtitan"] == RELEASE_BEFORE, found
    cell = "tt{}-partial-{}-fp32-sched_1f1b.sp_{}-steps3-seed0".format
    # 0.2's tp plans always shard the sequence: sp_on alone where tp splits; qwen3 not on tp (NOT_RUN)
    moe = "ttdeepseekv3-partial-{}-{}-ep_2.sp_{}-steps3-seed0".format
    assert {r["cell"]: r["verdict"] for r in found["cells"]} == {
        cell("llama3", "dp2", "off"): "red", cell("llama3", "tp2", "on"): "pass",
        cell("qwen3", "dp2", "off"): "pass", moe("dp2", "fp32", "off"): "pass", moe("dp2", "bf16", "off"): "pass",
        moe("tp2", "fp32", "on"): "known"}, found["cells"]
    red = next(r for r in found["cells"] if r["verdict"] == "red")
    assert red["why"].startswith("first diverging module: output (parameter gradients, step 1)"), red
    assert "1/dp" in " ".join(junit_texts(tmp_path / "out" / "junit.xml")[red["cell"]].split()), red
    assert "sequence parallel off" in found["not_run"] and "torchtitan.hf_datasets.text_datasets" in found["shims"], found


def test_another_release_series_is_refused_in_one_line_that_says_what_to_install(tmp_path):
    """torchtitan 0.1.0, a series the zoo has no glue for: one line, before any import of torchtitan's
    (whose API is not the one the glue calls, which failed deep inside torchtitan's own imports)."""
    python = venv_with_release(tmp_path / "venv", "torchtitan==0.1.0")
    done = zoo(python, tmp_path, "--only", "qwen3")
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line == (f"python -m harness.zoo torchtitan: the torchtitan zoo is written against torchtitan {VERSION}, and "
                    f"0.1.0 is installed. Install {VERSION}: pip install -e '.[torchtitan]' && pip install --no-deps "
                    f"torchtitan=={VERSION}"), line
    assert not (tmp_path / "zoo-out").exists()


def test_the_nightly_torchtitan_job_installs_and_runs_as_tested_here():
    from tests.test_workflow import WORKFLOWS, lint, load

    workflow = WORKFLOWS / "zoo.yml"
    done = lint(workflow)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = {s["name"]: s for s in load(workflow)["jobs"]["torchtitan"]["steps"] if "name" in s}
    install = steps["Install (as docs/zoo.md)"]["run"]
    assert ".[torchtitan]" in install and f"--no-deps torchtitan=={VERSION}" in install, install
    assert steps["Zoo"]["run"].startswith(".venv/bin/python -m harness.zoo torchtitan ")
    before = steps["Zoo, the release before"]["run"]
    assert f"--no-deps torchtitan=={RELEASE_BEFORE}" in before and "-m harness.zoo torchtitan --out" in before, before
    assert "-m harness.zoo diff " in steps["What changed since the release before"]["run"]
