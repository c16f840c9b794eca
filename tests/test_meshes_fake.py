"""Dense and sparse mesh layouts at 64..4096 ranks on PyTorch's fake backend, against the model.

The layouts: for each world, five shapes a trainer runs (FSDP with experts over every rank; all five
dims with ep borrowing tp; pp with tp reused by experts; HSDP-heavy with cp; deep pp with small
groups), dp taking what the other degrees leave and ep as large as the lender allows. The
default process group is process-global, so the layouts run in two subprocesses (one per core), each
re-initialising the fake world once per rank it plays (see ``harness.meshes.fake``).
"""
import json
import subprocess
import sys
import time

from harness.meshes.device_mesh import MeshSpec

from .conftest import ROOT

WORLDS = (64, 128, 256, 512, 1024, 2048, 4096)
# (pp, rep, cp, tp, ep wanted, etp = tp?)
SHAPES = (
    (1, 1, 1, 1, 8, False),
    (2, 2, 2, 4, 8, False),
    (4, 1, 1, 8, 4, True),
    (2, 4, 4, 2, 64, True),
    (8, 2, 1, 2, 16, False),
)


def layouts() -> list[str]:
    out = []
    for world in WORLDS:
        for pp, dr, cp, tp, ep, etp_is_tp in SHAPES:
            dp = world // (pp * dr * cp * tp)
            lender = dp * cp * (1 if etp_is_tp else tp)
            spec = MeshSpec.of(world, pp=pp, rep=dr, dp=dp, cp=cp, tp=tp,
                               ep=min(ep, lender), etp=tp if etp_is_tp else 1)
            out.append(spec.id)
    return out


def run_fake(specs: list[str], **job) -> list[dict]:
    """Check ``specs`` in two subprocesses side by side; one result per layout."""
    halves = [specs[0::2], specs[1::2]]
    procs = [subprocess.Popen([sys.executable, "-m", "harness.meshes.fake", json.dumps({"specs": h, **job})],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for h in halves if h]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return results


def test_at_least_thirty_layouts_from_64_to_4096_ranks():
    specs = layouts()
    assert len(set(specs)) >= 30
    assert {MeshSpec.parse(s).world for s in specs} == set(WORLDS)


def test_every_layout_matches_the_model_on_the_fake_backend():
    specs = layouts()
    start = time.perf_counter()
    # every rank of one 64-rank layout joins the fake world itself, 3 ranks of each other layout
    every = specs[1]
    results = run_fake(specs, real_ranks=3, real_ranks_of={every: 64}, every_rank_upto=1024, sample=64, seed=0)
    wall = time.perf_counter() - start
    assert sorted(r["spec"] for r in results) == sorted(specs)
    errors = [e for r in results for e in r["errors"]]
    assert not errors, "\n".join(errors[:20])
    for r in results:
        # every rank up to 1024 ranks, the first, the last and a seeded sample of 64 beyond
        assert r["ranks_checked"] == r["world"] if r["world"] <= 1024 else 3 <= r["ranks_checked"] <= 66
        if r["spec"] == every:
            assert sorted(r["real_ranks"]) == list(range(64))
        else:
            assert len(r["real_ranks"]) == 3
    checked = sum(r["ranks_checked"] for r in results)
    print(f"\n{len(results)} layouts, worlds {min(r['world'] for r in results)}..{max(r['world'] for r in results)}, "
          f"{checked} ranks checked, {sum(len(r['real_ranks']) for r in results)} fake-backend joins, "
          f"wall {wall:.1f} s (per layout, summed: {sum(r['seconds'] for r in results):.1f} s)")


def test_swapped_groups_are_named():
    """Groups enumerated with two sparse dims swapped (ep for efsdp): the check names both."""
    from harness.meshes.check import check_all_groups
    from harness.names import GROUPS

    spec = MeshSpec.parse("world=64,dp=8,tp=8,ep=8,etp=8")
    partitions = {n: spec.groups(n) for n in GROUPS}
    partitions["ep"], partitions["efsdp"] = partitions["efsdp"], partitions["ep"]
    errors = check_all_groups(spec, partitions)
    assert [e.split(":")[1].strip() for e in errors] == ["the efsdp groups differ from the model's",
                                                         "the ep groups differ from the model's"]
