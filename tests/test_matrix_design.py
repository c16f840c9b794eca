"""The gate's covering designs (harness.matrix.design): every pair of values on every mesh, the full
product behind --full-matrix, and the planted bugs of the component it shrinks still red under it."""
import itertools
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import cases.test_ring_attention as ring_cases
from harness.bisect.runner import Trials
from harness.config import Config
from harness.matrix import FULL_ENV, covering
from harness.registry import register_implementation

ROOT = Path(__file__).resolve().parent.parent


def pairs_by_group(configs) -> dict:
    """(impl, mesh) -> every (axis, value, axis, value) that occurs together in one config."""
    out = defaultdict(set)
    for cfg in configs:
        axes = [("dtype", cfg.dtype), *(("s", str(v)) for k, v in cfg.sizes if k == "s"), *cfg.switches]
        out[(cfg.impl, cfg.mesh)] |= {a + b for a, b in itertools.combinations(sorted(axes), 2)}
    return out


def test_the_ring_gate_meets_every_pair_of_values_on_every_mesh_in_a_fifth_of_the_cells():
    gate, full = ring_cases.CELLS, ring_cases.FULL
    assert set(gate) < set(full) and len(gate) <= len(full) // 4, (len(gate), len(full))
    assert pairs_by_group(gate) == pairs_by_group(full)
    # a pair the rules forbid is not asked for: cp=8 runs zigzag only at s=48
    cp8 = [c for c in gate if c.mesh == (("cp", 8),) and c.switch("layout") == "zigzag"]
    assert cp8 and {c.size("s") for c in cp8} == {48}


def test_a_covering_design_is_deterministic_and_keeps_every_value_of_a_single_axis():
    def cfg(dtype, **switches):
        return Config("tp", "ours", (("tp", 2),), dtype, {"b": 4}, switches)

    one_axis = [cfg("fp32", op=op) for op in ("a", "b", "c")]
    assert covering(one_axis) == one_axis
    # a group of one config, nothing varying (a zoo's dense model on dp=2 beside its product on tp=2): kept
    alone = Config("tp", "ours", (("dp", 2),), "fp32", {"b": 4}, {"op": "a"})
    assert covering([alone, *one_axis]) == [alone, *one_axis]
    product = [cfg(d, x=x, y=y, z=z) for d in ("fp32", "bf16") for x in "ab" for y in "ab" for z in "abc"]
    chosen = covering(product)
    assert chosen == covering(list(product)) and len(chosen) < len(product)
    assert pairs_by_group(chosen) == pairs_by_group(product)


def collected(*args, env=None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "cases/test_ring_attention.py", *args], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})))
    assert done.returncode in (0, 4), done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_the_full_product_runs_with_an_option_or_the_environment_and_a_bad_value_is_named():
    assert f"{len(ring_cases.CELLS)} tests collected" in collected(env={FULL_ENV: "0"}).stdout
    full = f"{len(ring_cases.FULL)} tests collected"
    assert full in collected("--full-matrix", env={FULL_ENV: ""}).stdout
    assert full in collected(env={FULL_ENV: "1"}).stdout
    bad = collected(env={FULL_ENV: "yes"})
    assert bad.returncode == 4 and f"{FULL_ENV}=yes: use 1 for the full matrix" in bad.stderr, bad.stderr


# ---- planted ring bugs (tests/planted.py): each still turns every mesh it can show on red -------------
register_implementation("ringattn", "norotate", "tests.planted:ring_never_rotates")
register_implementation("ringattn", "norescale", "tests.planted:ring_merge_without_rescale")
register_implementation("ringattn", "zzascontig", "tests.planted:ring_zigzag_mask_as_contig")
# the bug, and which cells of the full product it turns red (the cp=1 cells have no ring)
RING_BUGS = {
    "norotate": lambda c: c.degree("cp") > 1,
    "norescale": lambda c: c.degree("cp") > 1,
    "zzascontig": lambda c: c.degree("cp") > 1 and c.switch("layout") == "zigzag" and c.switch("mask") == "causal",
}


@pytest.mark.slow  # the 48 gate cells of our ring, three times
@pytest.mark.parametrize("bug", list(RING_BUGS))
def test_a_planted_ring_bug_is_red_on_every_mesh_under_the_gates_design(bug, rank_pool):
    shows = RING_BUGS[bug]
    gate = [c.replace(impl=bug) for c in ring_cases.CELLS if c.impl == "ours"]
    trials = Trials(rank_pool, max_trials=len(gate) + 1, max_seconds=3600, quiet=True)
    red = {cfg for cfg in gate if trials.run(cfg).signature.failed}
    assert red == {cfg for cfg in gate if shows(cfg)}, sorted(c.id for c in red ^ {c for c in gate if shows(c)})
    meshes = {c.mesh for c in ring_cases.FULL if shows(c)}
    assert {c.mesh for c in red} == meshes and len(meshes) == 7
