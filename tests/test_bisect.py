"""harness.bisect on planted bugs: the minimal config, nondeterminism, budgets, git bisect run."""
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkout import copy_checkout, venv_over_this_one
from tests.conftest import flat, line_of

from harness.bisect.shrink import Search
from harness.bisect.signature import Signature, whole_factor
from harness.config import Config

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(".paritytest", "bisect")  # where bisect writes in the project (docs/bisect-and-explore.md)
CONFTEST = '''
from harness.registry import register_implementation
register_implementation("tp", "overtp", "tests.planted:tp_grads_over_tp")
register_implementation("tp", "noisy", "tests.planted:tp_noisy")
register_implementation("ringattn", "stuck", "tests.planted:ring_never_rotates")
register_implementation("tp", "colbwd", "tests.planted:tp_column_backward_unreduced")
register_implementation("moe", "offby1", "tests.planted:moe_expert_off_by_one")
register_implementation("pp", "mb1x2", "tests.planted:pp_microbatch_loss_doubled")
register_implementation("fsdp", "swapgather", "tests.planted:fsdp_gather_swaps_shards")
register_implementation("ckpt", "rotload", "tests.planted:ckpt_load_rotates_rows")
register_implementation("tp", "spunreduced", "tests.planted:tp_sp_replicated_grads_unreduced")
'''


def bisect(tmp_path, *args, timeout=600, python=sys.executable):
    """Run ``python -m harness.bisect`` the way a user does, from a directory whose conftest
    registers the planted implementations: bisect itself must load it, as pytest would."""
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "conftest.py").write_text(CONFTEST)
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # the planted implementations live in tests/
    return subprocess.run([str(python), "-m", "harness.bisect", *args], cwd=project, env=env,
                          capture_output=True, text=True, timeout=timeout)


def result(tmp_path):
    return json.loads((tmp_path / "project" / OUT / "result.json").read_text())


def test_whole_factors_name_scaling_bugs():
    assert whole_factor(0.25) == 4 and whole_factor(2.01) == 2 and whole_factor(1 / 3) == 3
    assert whole_factor(1.0) is None and whole_factor(1.4) is None and whole_factor(0.7) is None


def test_a_signature_holds_when_the_kind_matches_and_its_worst_tensor_still_fails():
    sig = Signature("scale", ("grad/w1", "grad/b1"))
    assert sig.holds_in(Signature("scale", ("grad/b1", "grad/w1")))
    assert not sig.holds_in(Signature("mismatch", ("grad/w1",)))
    assert not sig.holds_in(Signature("scale", ("out",)))
    mismatch = Signature("mismatch", ("out",))
    assert mismatch.holds_in(Signature("scale", ("out", "grad/x")))  # a scaling is a kind of mismatch
    assert not sig.holds_in(Signature("mismatch", ("grad/w1",)))  # but a scaling must stay one


def test_shrinking_keeps_two_dims_a_bug_needs():
    """A pure-Python oracle: the bug needs tp > 1 and ep != tp; everything else is noise."""
    start = Config("tp", "ours", {"dp": 2, "tp": 4}, "bf16", dict(b=4, s=8, h=16, f=32, v=40), {"op": "mlp"})

    def holds(cfg):
        return cfg.degree("tp") > 1 and cfg.degree("dp") > 1 and cfg.size("b") >= 4

    search = Search(start)
    minimal = search.run(holds)
    assert minimal.dims == {"dp": 2, "tp": 2} and minimal.dtype == "fp32" and minimal.size("b") == 4
    roles = search.fields()
    assert {"dp=2", "tp=2", "b=4"} == set(roles["essential"])
    assert "dtype=fp32" in roles["any value"] and "s=1" not in roles["essential"]


@pytest.mark.slow
def test_a_scaling_bug_from_an_8_rank_cell_shrinks_to_tp2_within_budget(tmp_path):
    cell = "tp-overtp-dp2.tp4-bf16-op_mlp-b4.f32.h16.s8.v40-seed0"
    done = bisect(tmp_path, "run", cell)
    assert done.returncode == 1, done.stdout + done.stderr
    found = result(tmp_path)
    minimal = Config.parse(found["minimal"])
    assert minimal.dims == {"tp": 2} and minimal.dtype == "fp32"
    assert found["kind"] == "scale" and found["tensors"][0].startswith("grad/")
    assert "tp=2" in found["essential"]
    assert found["trials"] <= 40 and found["seconds"] < 120
    # every event matches: the gradients go wrong in the step after the last one (where the bug is)
    place = found["localisation"]
    assert place["first_diverging"] is None and place["result_matches"] is False and place["compared"] > 0
    assert ("grad/b1, grad/b2, grad/w1, grad/w2 are the reference x 1/2 = 1/tp: scaled by a group's size"
            in flat(done.stdout)), done.stdout
    assert place["scaled_results"] == {f"grad/{p}": "x 1/2 = 1/tp" for p in ("b1", "b2", "w1", "w2")}, place
    assert "reproduce: " in done.stdout and "harness.bisect check " + found["minimal"] in done.stdout
    lines = (tmp_path / "project" / OUT / "trials.jsonl").read_text().splitlines()
    assert len(lines) == found["trials"] and json.loads(lines[0])["config"] == cell


@pytest.mark.slow
def test_replicated_weights_whose_gradients_are_never_all_reduced_are_named_as_partial_sums(tmp_path):
    """Sequence parallel's layer norm weights and second bias skip their all-reduce: every event
    matches, and the gradients are named as what they are, not as 'after the last recorded event'."""
    done = bisect(tmp_path, "run", "tp-spunreduced-tp2-fp32-op_sp-b4.f32.h16.s8.v40-seed0")
    assert done.returncode == 1, done.stdout + done.stderr
    found = result(tmp_path)
    assert Config.parse(found["minimal"]).dims == {"tp": 2}, found
    place = found["localisation"]
    assert place["first_diverging"] is None and place["partial_results"]["grad/b2"] == "tp", place
    line = ("compared events match; grad/b2, grad/ln_b, grad/ln_w are per-rank partial sums over tp (summed they "
            "match the reference): their all-reduce over tp is missing")
    assert line in flat(done.stdout), done.stdout
    assert "after the last recorded event" not in done.stdout
    # pytest says the same under the cell's table (the component declares no diagnosis of its own)
    project = tmp_path / "project"
    (project / "test_mine.py").write_text(
        "import pytest\nfrom harness.config import Config\n\n\n"
        "@pytest.mark.parametrize('cfg', [Config.parse('tp-spunreduced-tp2-fp32-op_sp-b4.f32.h16.s8.v40-seed0')], ids=str)\n"
        "def test_mine(cfg, parity):\n    parity(cfg)\n")
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_mine.py"], cwd=project,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600)
    assert ran.returncode == 1 and line in flat(ran.stdout), ran.stdout[-4000:]


@pytest.mark.slow
def test_a_ring_bug_keeps_cp_and_drops_every_switch_it_does_not_need(tmp_path):
    cell = "ringattn-stuck-cp4.tp2-bf16-gqa_on.layout_zigzag.mask_causal-b2.d4.h16.q4.s48-seed0"
    done = bisect(tmp_path, "run", cell)
    assert done.returncode == 1, done.stdout + done.stderr
    minimal = Config.parse(result(tmp_path)["minimal"])
    assert minimal.dims == {"cp": 2}
    assert dict(minimal.switches) == {"gqa": "off", "layout": "contig", "mask": "full"}
    # the first ring step merges the rank's own block, which is right; the second is where K/V should have moved
    assert result(tmp_path)["localisation"]["origin"]["event"] == "fwd ring ring_step=1"


@pytest.mark.slow
def test_what_run_prints_fits_the_screen_and_reproduces_where_it_was_typed_and_its_files_are_gitignored(tmp_path):
    """A project with its own .venv, as a user's: a ring cell's ids are long, yet no line bisect prints
    (progress on stderr, the end on stdout) passes 200 columns; the reproduce line names the interpreter
    as a failing cell's does (relative to the project) and, pasted there, reruns the minimal cell; the
    files are where the docs say, in a directory git ignores, and none is left in the project's root."""
    project = tmp_path / "project"
    project.mkdir()
    python = venv_over_this_one(project / ".venv")  # the project's own, as a user's holds
    cell = "ringattn-stuck-cp4.tp2-bf16-gqa_on.layout_zigzag.mask_causal-b2.d4.h16.q4.s48-seed0"
    done = bisect(tmp_path, "run", cell, python=python)
    assert done.returncode == 1, done.stdout + done.stderr
    printed = (done.stdout + done.stderr).splitlines()
    assert max(map(len, printed)) <= 200, [line for line in printed if len(line) > 200]
    found = result(tmp_path)
    assert len(flat(line_of(done.stdout, "minimal: "))) > 200  # a long line, wrapped: not cut
    reproduce = line_of(done.stdout, "reproduce: ")
    assert reproduce == f"reproduce: .venv/bin/python -m harness.bisect check {found['minimal']}", reproduce
    assert not Path(shlex.split(found["reproduce"])[0]).is_absolute() and found["reproduce"] in reproduce
    pasted = subprocess.run(["bash", "-c", found["reproduce"]], cwd=project, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            capture_output=True, text=True, timeout=600)
    assert pasted.returncode == 1 and f"{found['minimal']}: mismatch" in pasted.stdout, pasted.stdout + pasted.stderr
    docs = (ROOT / "docs" / "bisect-and-explore.md").read_text()
    assert f"`{OUT.as_posix()}/result.json`" in docs and "bisect-out" not in docs
    assert done.stdout.splitlines()[-1] == f"wrote {OUT.as_posix()}/result.json and trials.jsonl beside it"
    assert sorted(p.name for p in project.iterdir()) == [".paritytest", ".venv", "conftest.py"]
    assert (project / ".paritytest" / ".gitignore").read_text().splitlines()[-1] == "*"
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=project, check=True,
                            capture_output=True, text=True).stdout
    assert "conftest.py" in status and ".paritytest" not in status, status


# (a planted bug's 8- or 4-rank cell, the mesh bisect must shrink it to, the event where the bug lives)
PLANTED = {
    "tp: column-parallel backward without its all-reduce": (
        "tp-colbwd-dp2.tp4-bf16-op_mlp-b4.f32.h16.s8.v40-seed0", {"tp": 2}, "bwd fc1", True),
    "moe: the second local expert runs the first one's weights": (
        "moe-offby1-ep4-bf16-cap_none.emesh_dense.norm_off.route_rand.score_softmax-e8.f16.h8.k2.t24-seed0",
        None, "fwd expert expert=1", True),
    "pp: the last stage doubles microbatch 1's loss": (
        "pp-mb1x2-pp4.dp2-fp32-sched_interleaved.tied_on-b8.f16.h8.l8.m4.s4.v24.vs2-seed0", {"dp": 1},
        "bwd head microbatch=1", False),
    "fsdp: the all-gather swaps two ranks' shards of W1": (
        "fsdp-swapgather-rep2.shard4-bf16-plain-b72.f13.h6.m1.o5-seed0", {"rep": 1, "shard": 2},
        "fwd weights layer=0 step=1", True),
    "ckpt: the load puts W1's rows one off": (
        "ckpt-rotload-w4-fp32-load_ours4.save_hsdp2x2-b24.f10.h6-seed0", None, "load checkpoint", True),
}


@pytest.mark.slow
@pytest.mark.parametrize("bug", PLANTED)
def test_bisect_names_the_minimal_config_and_the_event_where_a_planted_bug_lives(tmp_path, bug):
    cell, dims, event, starts_there = PLANTED[bug]
    done = bisect(tmp_path, "run", cell)
    assert done.returncode == 1, done.stdout + done.stderr
    found = result(tmp_path)
    minimal = Config.parse(found["minimal"])
    assert found["minimal"] != cell and minimal.world <= Config.parse(cell).world
    if dims is not None:
        assert minimal.dims == dims, found
    assert minimal.dtype == "fp32" and found["trials"] <= 40
    place = found["localisation"]
    assert place["first_diverging"]["event"] == event, place
    if starts_there:  # its inputs match the reference: this operation is where the error starts
        assert place["origin"]["event"] == event and f"where it starts: {event}:" in done.stdout
    else:  # its inputs already differ: the error is in unrecorded code just before it (the loss scaling)
        assert place["origin"] is None and place["last_matching"] == "fwd head microbatch=1"


@pytest.mark.slow
def test_a_nondeterministic_implementation_is_reported_not_bisected(tmp_path):
    done = bisect(tmp_path, "run", "tp-noisy-tp2-fp32-op_mlp-b4.f32.h16.s8.v40-seed0")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "nondeterministic" in done.stdout and result(tmp_path)["verdict"] == "nondeterministic"


def test_check_follows_git_bisect_exit_codes(tmp_path):
    assert bisect(tmp_path, "check", "tp-ours-tp2-fp32-op_mlp-b4.f32.h16.s8.v40-seed0").returncode == 0
    assert bisect(tmp_path, "check", "tp-overtp-tp2-fp32-op_mlp-b4.f32.h16.s8.v40-seed0").returncode == 1
    skip = bisect(tmp_path, "check", "tp-ours-tp3-fp32-op_mlp-b4.f32.h16.s8.v2-seed0")  # v=2 over tp=3: a rule
    assert skip.returncode == 125, skip.stdout + skip.stderr
    bad = bisect(tmp_path, "check", "not-a-config")
    assert bad.returncode == 2 and "expected 7" in flat(bad.stderr)


def test_bisect_loads_the_conftests_of_the_ini_testpaths_whatever_the_addopts(tmp_path):
    """Options of pytest's terminal plugin in a user's addopts (pytest 9 rejects them when that
    plugin is blocked) and a conftest found only through testpaths: the names it registers count,
    and a name it does not register is a usage error that says where bisect looked."""
    project = tmp_path / "project"
    (project / "checks").mkdir(parents=True)
    (project / "pytest.ini").write_text("[pytest]\naddopts = -ra -v --tb=short\ntestpaths = checks\n")
    (project / "checks" / "conftest.py").write_text(CONFTEST)
    done = bisect(tmp_path, "check", "tp-yours-tp2-fp32-op_mlp-b4.f32.h16.s8.v40-seed0")
    assert done.returncode == 2, done.stdout + done.stderr
    said = flat(done.stderr)  # one message, wrapped to the screen
    assert "unknown implementation 'yours' of tp; registered: colbwd, dtensor, hf, megatron, noisy, ours, overtp" \
        in said and f"loaded conftests: {project / 'conftest.py'}, {project / 'checks' / 'conftest.py'}" \
        in said and f"ini file {project / 'pytest.ini'}, collecting checks" in said, done.stderr
    assert max(map(len, done.stderr.splitlines())) <= 200, done.stderr
    assert "no divergence" not in done.stdout + done.stderr


def test_a_command_oracle_and_the_trial_budget(tmp_path):
    # the oracle says bad while tp > 1: the search wants more trials than it is given
    oracle = [sys.executable, "-c", "import sys; sys.exit(1 if '.tp' in sys.argv[1] or '-tp' in sys.argv[1] and "
              "'tp1' not in sys.argv[1] else 0)", "{}"]
    done = bisect(tmp_path, "run", "tp-ours-dp2.tp4-fp32-op_mlp-b4.f32.h16.s8.v40-seed0", "--max-trials", "3",
                  "--", *oracle)
    assert done.returncode == 4, done.stdout + done.stderr
    assert result(tmp_path)["verdict"] == "budget exhausted"


@pytest.mark.slow
def test_git_bisect_run_finds_the_commit_that_broke_a_cell(tmp_path):
    repo = tmp_path / "repo"
    copy_checkout(repo)
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True, text=True)  # noqa: E731
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "good", "--allow-empty")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "good")
    good = git("rev-parse", "HEAD").stdout.strip()
    tp = repo / "harness" / "parallel" / "tp.py"
    for i, text in enumerate(["# a harmless comment\n", None, "# another\n"]):
        if text is None:  # the breaking commit: the row-parallel all-reduce forgotten
            source = tp.read_text().replace("out = reduce_from_group(F.linear(x_shard, w), tp)",
                                            "out = F.linear(x_shard, w)")
            assert "out = F.linear(x_shard, w)" in source
            tp.write_text(source)
        else:
            tp.write_text(tp.read_text() + text)
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", f"change {i}")
    breaking = git("rev-parse", "HEAD~1").stdout.strip()
    env = dict(os.environ, PYTHONPATH=str(repo))
    cell = "tp-ours-tp2-fp32-op_mlp-b4.f32.h16.s8.v40-seed0"
    subprocess.run(["git", "bisect", "start", "HEAD", good], cwd=repo, check=True, capture_output=True)
    done = subprocess.run(["git", "bisect", "run", sys.executable, "-m", "harness.bisect", "check", cell],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert f"{breaking} is the first bad commit" in done.stdout, done.stdout + done.stderr


def test_bisects_pool_imports_the_targets_modules_not_every_registered_ones():
    """Each step of ``git bisect run`` starts a pool: its zygotes import what the target's component
    and implementation need, not transformers and Megatron-Core for a cell of ours."""
    from argparse import Namespace

    from harness.bisect.__main__ import _pool_options

    ours = Config.parse("tp-ours-tp4-fp32-op_mlp-b4.f32.h16.s8.v40-seed0")
    options = _pool_options(Namespace(pool_size=4, case_deadline=30.0), [ours], ROOT)
    assert "harness.parallel.tp" in options["preload"] and "reference.tp" in options["alone_preload"]
    heavy = {"harness.parallel.tp_megatron", "harness.parallel.tp_hf", "harness.examples.hf"}
    assert not heavy & (set(options["preload"]) | set(options["alone_preload"])), options
    llama = Config.parse("llama-tp-tp2-fp32-plain-steps3-seed0")
    assert "harness.examples.hf" in _pool_options(Namespace(pool_size=4, case_deadline=30.0), [llama], ROOT)["preload"]
