"""``python -m harness.zoo transformers`` as a user runs it, from a directory of their own: a right
plan passes at every mesh, an architecture the generic shrink cannot build is a skip that says why
(never a red), and a bad option is one line with the fix."""
import json
import subprocess
import sys

import pytest

from tests.test_torchrun import env_for, private_tmpdir  # noqa: F401  (autouse fixture)


def zoo(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "harness.zoo", "transformers", *args], cwd=tmp_path,
                          env=env_for(tmp_path), capture_output=True, text=True, timeout=900)


def test_the_zoo_checks_each_plan_and_skips_what_it_cannot_build(tmp_path):
    pytest.importorskip("transformers", reason="pip install -e '.[thirdparty]'")
    done = zoo(tmp_path, "--only", "llama,qwen3_moe,llama4", "--plans", "tp,ep", "-n", "2", "--out", "out")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cells = {r["cell"]: r for r in json.loads((tmp_path / "out" / "zoo.json").read_text())["cells"]}
    verdicts = {cell: r["verdict"] for cell, r in cells.items()}
    assert verdicts == {
        "hfllama-tp-tp2-fp32-plain-steps3-seed0": "pass", "hfllama-tp-tp4-fp32-plain-steps3-seed0": "pass",
        "hfqwen3moe-tp-tp2-fp32-plain-steps3-seed0": "pass", "hfqwen3moe-tp-tp4-fp32-plain-steps3-seed0": "pass",
        "hfqwen3moe-ep-dp2-fp32-ep_2-steps3-seed0": "pass",
        # llama4 ships a TP plan, no EP plan: no ep cell
        "hfllama4-tp-tp2-fp32-plain-steps3-seed0": "skip", "hfllama4-tp-tp4-fp32-plain-steps3-seed0": "skip"}, verdicts
    assert cells["hfllama4-tp-tp2-fp32-plain-steps3-seed0"]["why"].startswith("not built tiny: "), cells
    table = (tmp_path / "out" / "zoo.md").read_text()
    assert "5 pass, 0 red, 0 crash, 2 skip, 0 known" in table, table


def test_an_unknown_plan_is_one_line_with_the_choices(tmp_path):
    done = zoo(tmp_path, "--plans", "tp,pp")
    assert done.returncode == 2 and "--plans: unknown pp; give some of tp, tpauto, ep" in done.stderr, done.stderr
