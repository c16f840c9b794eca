"""Which library versions were under test: the run header, the summary, the junit XML and the
report name them, a version other than the thirdparty pin is said once at the top, and skip and
xfail reasons name the version installed (an xfail, the pinned version it was declared for)."""
import re
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness import versions
from harness.versions import Library
from tests.checkout import ROOT, copy_checkout, user_env, venv_over_this_one
from tests.project import UserProject

PINNED = {"transformers": "5.23.0", "megatron-core": "0.16.1", "accelerate": "1.15.0"}
# an older 5.x that installs over the pin beside CPU torch 2.13 (--no-deps: nothing else changes)
OLDER_TRANSFORMERS = "5.22.2"
# a few hf cells: a skip stating transformers' behaviour, a declared divergence (strict xfail), and
# one that runs
SKIPPED = "moe-hf-dp2.tp2-fp32-cap_none.emesh_ep2.epimpl_allreduce.norm_off.route_skew.score_softmax-e8.f16.h8.k1.t24-seed0"
DECLARED = "moe-hf-ep2-bf16-cap_none.emesh_dense.epimpl_alltoall.norm_off.route_skew.score_softmax-e16.f16.h8.k2.t24-seed0"
RUNS = "tp-hf-tp2-fp32-op_colshard.style_colwise-b4.f32.h16.s8.v40-seed0"


def test_the_pins_are_pyprojects_thirdparty_extra_read_from_the_installed_metadata():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["thirdparty"]
    written = dict(re.fullmatch(r"([\w-]+)==([\w.]+)", r).groups() for r in extra)
    assert versions.pins() == written == PINNED  # PINNED: what the reasons in this file assume


def test_only_exact_pins_of_the_thirdparty_extra_count():
    assert versions._pins_from(['transformers==5.23.0; extra == "thirdparty"', "torch>=2.6",
                                'pyyaml; extra == "ci"', 'megatron_core==0.16.1 ; extra == "thirdparty"',
                                'numpy>=2; extra == "thirdparty"']) == {"transformers": "5.23.0",
                                                                         "megatron-core": "0.16.1"}


def test_a_version_other_than_the_pin_is_named_with_its_pin_and_warned_about_once():
    libs = [Library("torch", "2.13.0+cpu", None), Library("transformers", "5.22.2", "5.23.0"),
            Library("megatron-core", None, "0.16.1")]
    assert versions.line(libs) == "torch 2.13.0+cpu, transformers 5.22.2 (pinned 5.23.0), megatron-core not installed"
    warning = versions.mismatch_warning(libs)
    assert warning.startswith("WARNING: transformers 5.22.2 is installed, the thirdparty extra pins 5.23.0")
    assert warning.endswith("pip install transformers==5.23.0") and "megatron" not in warning
    assert versions.mismatch_warning([Library("transformers", "5.23.0", "5.23.0"), libs[0], libs[2]]) is None


def test_reasons_name_the_installed_versions_here():
    """In this environment (the pins installed): every third-party skip and xfail reason names
    the library's installed version; none is about a version the metadata does not hold."""
    pytest.importorskip("transformers")
    pytest.importorskip("megatron.core")
    from harness.config import Config
    from harness.resolve import resolve

    installed = {name: versions.installed(name) for name in PINNED}
    reasons = []
    for text in (SKIPPED, DECLARED, "tp-megatron-tp2-fp32-op_xent-b4.f32.h16.s8.v40-seed0",
                 "tp-megatron-tp3-fp32-op_mlp-b4.f32.h16.s8.v40-seed0"):
        reasons.append(resolve(Config.parse(text)).disposition.reason)
    assert reasons[0].startswith(f"transformers {installed['transformers']}: AllReduceEP")
    assert reasons[1].startswith(f"transformers {installed['transformers']}: load_balancing_loss_func")
    assert reasons[2].startswith(f"megatron-core {installed['megatron-core']}: vocab_parallel_cross_entropy")
    assert reasons[3].startswith(f"megatron-core {installed['megatron-core']}: refuses it")


def test_the_run_header_and_junit_xml_name_the_versions_here(pytester):
    import torch

    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("--junitxml=out.xml")
    header = result.stdout.lines[:result.stdout.lines.index(next(l for l in result.stdout.lines if "collected" in l))]
    from importlib.metadata import version

    harness = f"paritytest {version('paritytest')}"  # which release's checks ran, first
    assert any(line.startswith(f"{harness}: torch {torch.__version__}, transformers ") for line in header), header
    suite = ET.parse(pytester.path / "out.xml").getroot()
    recorded = suite.find(".//properties/property[@name='versions']")
    assert [str(lib) for lib in versions.from_json(recorded.get("value"))][:2] == [harness, f"torch {torch.__version__}"]
    assert [lib.name for lib in versions.from_json(recorded.get("value"))] == [
        "paritytest", "torch", "transformers", "megatron-core", "accelerate"]


def test_the_report_names_the_versions_and_warns_at_the_top(tmp_path):
    """``python -m harness.report`` on junit XML whose run had another transformers installed."""
    libs = [Library("paritytest", "0.2.0", None), Library("torch", "2.13.0", None),
            Library("transformers", "5.22.2", "5.23.0")]
    junit = tmp_path / "cases.xml"
    junit.write_text(
        "<testsuites><testsuite name='pytest' tests='1'><properties>"
        f"<property name='versions' value='{versions.to_json(libs)}'/></properties>"
        "<testcase classname='tests.test_x' name='test_x' time='0.1'/></testsuite></testsuites>")
    done = subprocess.run([sys.executable, "-m", "harness.report", "--junit", str(junit), "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("## ")  # the headline stays first
    assert lines[2].startswith("⚠️ **transformers 5.22.2 is installed, the thirdparty extra pins 5.23.0")
    assert lines[4] == "**Versions:** paritytest 0.2.0, torch 2.13.0, transformers 5.22.2 (pinned 5.23.0)"
    page = (tmp_path / "report.html").read_text()
    assert "<b>Versions:</b> paritytest 0.2.0, torch 2.13.0, transformers 5.22.2 (pinned 5.23.0)" in page


@pytest.mark.slow  # runs three cells in a pytest of its own
def test_a_maintainer_with_an_older_transformers_installed_over_the_pin_is_told(tmp_path):
    """As a maintainer bumping transformers would: an older 5.x installed over the pin with pip, then a
    few hf cells run from a checkout with junit XML and the report. (README's install itself is
    .ci/run's first step, and a fresh install of the harness test_bisect_project's and test_workflow's;
    here a virtual environment over this run's.)"""
    source = copy_checkout(tmp_path / "paritytest")
    env = user_env()
    python = venv_over_this_one(tmp_path / "venv")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                              f"transformers=={OLDER_TRANSFORMERS}"], env=env, capture_output=True, text=True,
                             timeout=600)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    cells = " or ".join((SKIPPED, DECLARED, RUNS))
    done = UserProject(source, ini=False).run(
        "bash", "-euo", "pipefail", "-c", f"{python} -m pytest cases/test_moe.py cases/test_tp.py -rsxX -k '{cells}' "
        f"--junitxml=reports/cases.xml && {python} -m harness.report --junit reports/cases.xml --out reports", env=env)
    out = done.stdout
    assert done.returncode == 0, done.tail
    older = f"transformers {OLDER_TRANSFORMERS}"
    header = out[:out.index("collected ")]
    assert ": torch 2.13.0" in header and f"{older} (pinned 5.23.0), megatron-core 0.16.1" in header
    warning = f"WARNING: {older} is installed, the thirdparty extra pins 5.23.0"
    assert out.count(warning) == 1 and warning in header  # once, at the top
    assert re.search(rf"^SKIPPED .*: {re.escape(older)}: ", out, re.M)  # the skip reason
    declared = f"{older} is installed, this was declared for the pinned 5.23.0: load_balancing_loss_func"
    assert re.search(rf"^X(FAIL|PASS) .*{re.escape(declared)}", out, re.M)  # the xfail reason
    assert "transformers 5.23.0:" not in out  # no reason claims the pin is what ran
    assert f"versions: torch 2.13.0" in out and f"{older} (pinned 5.23.0)" in out[out.index("parity summary"):]

    suite = ET.parse(source / "reports" / "cases.xml").getroot()
    recorded = {lib.name: lib for lib in versions.from_json(suite.find(".//properties/property[@name='versions']")
                                                             .get("value"))}
    assert recorded["transformers"] == Library("transformers", OLDER_TRANSFORMERS, "5.23.0")
    summary = (source / "reports" / "summary.md").read_text()
    assert f"⚠️ **{warning.removeprefix('WARNING: ')}" in summary and f"{older} (pinned 5.23.0)" in summary


def test_a_divergence_that_shows_by_machine_is_declared_not_strict():
    """The fixture runs a declared divergence as a strict xfail unless its declaration says that
    whether it shows depends on the machine's kernels."""
    from harness.parallel.thirdparty_moe import HF_MOE_KNOWN, hf_moe_xfail
    from harness.versions import declared

    assert declared("transformers", "x").strict and not declared("transformers", "x", strict=False).strict
    assert declared("transformers", "x", strict=False) == declared("transformers", "x")  # the same text
    from harness.config import Config

    known = [hf_moe_xfail(Config.parse(cell)) for cell in HF_MOE_KNOWN]
    assert known and all(k and k.strict is False for k in known)
