"""Pipeline schedules: the list builders, the simulator's rejections, the time x rank table, the
config rules, and the send/receive peers against the mesh model (``harness.layout.MeshLayout``)."""
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.config import Config, ConfigError
from harness.layout import MeshLayout, Piece, Shard, assemble
from harness.matrix import mesh
from harness.resolve import check_config
from harness.parallel import pipeline_schedule as ps
from harness.parallel.pipeline_schedule import B, F, RB, RF, SF, Action, ScheduleError, build, simulate, table

from .conftest import ROOT


def _swap(actions, i, j):
    actions = list(actions)
    actions[i], actions[j] = actions[j], actions[i]
    return actions


def _index(actions, kind, stage, mb):
    return next(i for i, a in enumerate(actions) if (a.kind, a.stage, a.mb) == (kind, stage, mb))


# ---- the builders --------------------------------------------------------------------------------

@given(st.sampled_from(["gpipe", "1f1b", "interleaved"]), st.integers(1, 8), st.integers(1, 20), st.integers(2, 4))
def test_every_built_schedule_passes_the_simulator(name, pp, m, vs):
    vs = vs if name == "interleaved" else 1
    if name != "gpipe" and m < pp or name == "interleaved" and m % ps.rounds(pp, m):
        return  # what check_config() rejects for these schedules (tested below)
    sched = build(name, pp, m, vs)
    simulate(sched)
    for rank, actions in enumerate(sched.lists):  # each of the rank's stages runs F and B once per microbatch
        compute = sorted((a.kind, a.stage, a.mb) for a in actions if a.kind in (F, B))
        assert compute == sorted((k, s, mb) for k in (F, B) for s in sched.stages_of(rank) for mb in range(m))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m", [(1, 1), (2, 3), (4, 4), (4, 8), (3, 7), (8, 9)])
def test_gpipe_and_1f1b_take_the_textbook_time(name, pp, m):
    """(m + pp - 1) forward and backward slots: the bubble (pp-1)/(m+pp-1) of GPipe and 1F1B alike."""
    timeline = simulate(build(name, pp, m), bwd_cost=2)
    assert timeline.makespan == 3 * (m + pp - 1)
    assert all(timeline.busy(r) == 3 * m for r in range(pp))


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 4), (8, 16)])
def test_interleaving_shrinks_the_bubble(pp, m):
    """Virtual stages of half the depth: in units of a full stage, the idle time drops (Narayanan et al.)."""
    plain = simulate(build("1f1b", pp, m), bwd_cost=2)
    inter = simulate(build("interleaved", pp, m, 2), bwd_cost=2)
    # a virtual stage holds half the layers: count its time in halves of a full stage's
    assert inter.makespan / 2 < plain.makespan
    assert inter.makespan - inter.busy(0) < 2 * (plain.makespan - plain.busy(0))


def test_1f1b_keeps_at_most_pp_minus_rank_microbatches_in_flight():
    sched = build("1f1b", 4, 8)
    for rank, actions in enumerate(sched.lists):
        live = worst = 0
        for a in actions:
            live += {F: 1, B: -1}.get(a.kind, 0)
            worst = max(worst, live)
        assert worst == 4 - rank


# ---- the simulator rejects broken lists, naming rank, stage and microbatch ------------------------

def test_a_deadlocking_list_is_rejected():
    """Rank 1 waits for the gradient of microbatch 0 before it sends that microbatch's activation on."""
    sched = build("1f1b", 4, 4)
    actions = sched.lists[1]
    send, recv = _index(actions, SF, 1, 0), _index(actions, RB, 1, 0)
    bad = list(actions)
    bad.insert(send, bad.pop(recv))  # RB(stage 1, mb 0) now comes before SF(stage 1, mb 0)
    with pytest.raises(ScheduleError, match="deadlock") as info:
        simulate(sched.replace_list(1, bad))
    message = str(info.value)
    assert re.search(r"rank 1 waits at action \d+ RB\(stage 1, mb 0\) from rank 2 for the input gradient of stage 2 "
                     r"microbatch 0", message), message
    assert re.search(r"rank 2 waits at action \d+ RF\(stage 2, mb 0\) from rank 1 for the output of stage 1 "
                     r"microbatch 0", message), message


def test_a_backward_before_its_forward_is_rejected():
    sched = build("gpipe", 2, 2)
    actions = sched.lists[1]  # the last stage: its backward needs only its own forward
    bad = _swap(actions, _index(actions, F, 1, 1), _index(actions, B, 1, 1))
    with pytest.raises(ScheduleError, match=r"rank 1 action \d+: backward of stage 1 microbatch 1 comes before its forward"):
        simulate(sched.replace_list(1, bad))


def test_messages_received_out_of_order_are_rejected():
    """Per-pair channels are FIFO (NCCL and untagged gloo): rank 1 may not take microbatch 1 first."""
    sched = build("gpipe", 2, 2)
    actions = list(sched.lists[1])
    first = actions[_index(actions, RF, 1, 0):_index(actions, F, 1, 0) + 1]
    second = actions[_index(actions, RF, 1, 1):_index(actions, F, 1, 1) + 1]
    bad = second + first + actions[len(first) + len(second):]
    with pytest.raises(ScheduleError, match=r"rank 1 action 0 RF\(stage 1, mb 1\) from rank 0 expects the output of "
                                            r"stage 0 microbatch 1.*is the output of stage 0 microbatch 0"):
        simulate(sched.replace_list(1, bad))


@pytest.mark.parametrize("edit, message", [
    (lambda a: a[:_index(a, B, 0, 1)] + a[_index(a, B, 0, 1) + 1:],
     r"rank 0 never runs the backward of stage 0 microbatch 1"),
    (lambda a: [Action(SF, x.stage, x.mb, 0) if x.kind == SF else x for x in a],
     r"rank 0 action 1 SF\(stage 0, mb 0\) to rank 0: stage 1 lives on rank 1, not rank 0"),
    (lambda a: [Action(F, 1, 0)] + a,
     r"rank 0 action 0 F\(stage 1, mb 0\): stage 1 lives on rank 1, not rank 0"),
    (lambda a: a + [Action(SF, 0, 0, 1)],
     r"rank 0 sends the output of stage 0 microbatch 0 \(stage 0, microbatch 0\) to rank 1, which never receives it"),
    (lambda a: _swap(a, _index(a, F, 0, 1), _index(a, SF, 0, 1)),
     r"rank 0 action \d+ SF\(stage 0, mb 1\) to rank 1: .* comes before the forward that produces what it sends"),
])
def test_other_broken_lists_name_rank_stage_and_microbatch(edit, message):
    sched = build("gpipe", 2, 2)
    with pytest.raises(ScheduleError, match=message):
        simulate(sched.replace_list(0, edit(list(sched.lists[0]))))


def test_a_stage_that_computes_before_its_input_arrives_is_rejected():
    sched = build("1f1b", 2, 2)
    actions = sched.lists[1]
    bad = _swap(actions, _index(actions, RF, 1, 0), _index(actions, F, 1, 0))
    with pytest.raises(ScheduleError, match=r"rank 1 action 0 F\(stage 1, mb 0\): forward of stage 1 microbatch 0 "
                                            r"comes before its input is received"):
        simulate(sched.replace_list(1, bad))


# ---- the time x rank table -----------------------------------------------------------------------

def test_table_shows_every_rank_and_the_bubble():
    text = table(simulate(build("interleaved", 2, 4, 2)))
    lines = text.splitlines()
    assert lines[0].startswith("interleaved: pp=2 microbatches=4 virtual=2")
    rows = [line for line in lines if line.startswith("rank ")]
    assert len(rows) == 2 and all("bubble" in r for r in rows)
    assert "F0.0" in rows[0] and "B3.1" in rows[1]  # microbatch.virtual stage


def test_table_prints_from_the_command_line():
    out = subprocess.run([sys.executable, "-m", "harness.parallel.pipeline_schedule", "1f1b", "--pp", "4", "--microbatches", "8"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert len([line for line in out.splitlines() if line.startswith("rank ")]) == 4
    assert "bubble 27%" in out  # (pp-1)/(m+pp-1) = 3/11


# ---- config rules, checked before any rank runs ---------------------------------------------------

SIZES = dict(b=4, s=4, h=8, f=16, v=24, l=4, m=4, vs=1)


def cfg(mesh_text="pp=2", sched="1f1b", tied="on", **sizes):
    return Config("pp", "ours", mesh(mesh_text), "fp32", dict(SIZES, **sizes), {"sched": sched, "tied": tied})


@pytest.mark.parametrize("config, message", [
    (cfg("pp=4", m=3, b=3), r"sched_1f1b needs at least pp=4 microbatches to fill the pipeline, got m=3"),
    (cfg("pp=4", sched="interleaved", m=2, b=2, l=8, vs=2), r"sched_interleaved needs at least pp=4 microbatches"),
    (cfg("pp=3", l=4), r"layers l=4 do not divide into pp×vs = 3×1 = 3 stages of equal depth: choose l a multiple of 3"),
    (cfg("pp=2", sched="interleaved", l=6, vs=2), r"layers l=6 do not divide into pp×vs = 2×2 = 4 stages"),
    (cfg("pp=2", b=6), r"batch b=6 does not divide into dp×m = 1×4 = 4 equal microbatches"),
    (cfg("dp=2,pp=2", b=4), r"batch b=4 does not divide into dp×m = 2×4 = 8 equal microbatches .*choose b a multiple of 8"),
    (cfg("pp=3", sched="interleaved", m=7, b=7, l=6, vs=2), r"m=7 microbatches in max\(1, m // pp\) = 2 rounds"),
    (cfg("pp=2", sched="interleaved", vs=1), r"sched_interleaved needs at least 2 virtual stages per rank"),
    (cfg("pp=2", sched="gpipe", vs=2, l=4), r"sched_gpipe runs one stage per rank: set vs1"),
    (cfg("pp=2", sched="zerobubble"), r"unknown pipeline schedule sched_zerobubble"),
    (cfg("pp=2", tied="maybe"), r"switch tied is on or off"),
    (cfg("pp=2,cp=2"), r"pp cells take mesh dims dp, pp, tp, not \['cp'\]"),
    (cfg("pp=2,tp=32"), r"tp=32 leaves a rank an empty chunk of f=16"),
])
def test_invalid_configs_name_the_rule(config, message):
    with pytest.raises(ConfigError, match=message):
        check_config(config)


def test_gpipe_accepts_fewer_microbatches_than_stages():
    check_config(cfg("pp=4", sched="gpipe", m=2, b=2))


def test_a_schedule_the_simulator_rejects_fails_validation(monkeypatch):
    """A schedule builder (here one whose last rank runs a backward first) is checked before any rank runs."""
    def broken(pp, m, rank, vs):
        order = ps.gpipe_order(pp, m, rank)
        if rank == pp - 1:
            order[0], order[m] = order[m], order[0]  # B(last, 0) before F(last, 0)
        return order

    monkeypatch.setitem(ps.BUILDERS, "broken", broken)
    monkeypatch.setitem(ps.VIRTUAL, "broken", "one")
    with pytest.raises(ConfigError, match=r"broken: rank 1 action 0: backward of stage 1 microbatch 0 comes before its forward"):
        check_config(cfg("pp=2", sched="broken"))


# ---- peers from the mesh, never from a table ------------------------------------------------------

PEER_MESHES = ["pp=4", "dp=2,pp=2", "pp=2,dp=2", "pp=4,dp=2", "dp=2,pp=4", "dp=2,pp=2,tp=2", "pp=2,dp=2,tp=2",
               "pp=2,tp=2", "tp=2,pp=4"]


def expected_peers(layout: MeshLayout, rank: int) -> dict[int, int]:
    """The rank at each pp coordinate that shares all other coordinates with ``rank``."""
    axis = layout.names.index("pp")
    coords = list(layout.coords(rank))
    out = {}
    for c in range(layout.shape[axis]):
        coords[axis] = c
        out[c] = layout.rank_of(tuple(coords))
    return out


@pytest.mark.parametrize("text", PEER_MESHES)
def test_peers_come_from_the_mesh_layout(text, rank_pool):
    dims = mesh(text)
    layout = MeshLayout.of(dims)
    seen = rank_pool.run("harness.parallel.pipeline:describe_peers", None, dims)
    for rank, peers in seen.items():
        assert peers == expected_peers(layout, rank), (text, rank)


def test_the_hand_written_map_holds_for_one_mesh_order_only(rank_pool):
    """The original 3D code's ``comm_map`` (pp sends 0→2, 1→3, 4→6, 5→7) is dp=2,pp=2,tp=2 written out;
    the same table is wrong once pp is the outer dim, where the derived peers still hold."""
    comm_map = {0: 2, 1: 3, 4: 6, 5: 7}

    def sends(text):  # pp coordinate 0 -> 1, as our executor addresses them
        seen = rank_pool.run("harness.parallel.pipeline:describe_peers", None, mesh(text))
        return {rank: peers[1] for rank, peers in seen.items() if peers[0] == rank}

    assert sends("dp=2,pp=2,tp=2") == comm_map
    outer = sends("pp=2,dp=2,tp=2")
    assert outer != comm_map
    layout = MeshLayout.of(mesh("pp=2,dp=2,tp=2"))
    assert outer == {r: expected_peers(layout, r)[1] for r in range(layout.world) if layout.coord(r, "pp") == 0}


# ---- the placement a pipeline's ends use ----------------------------------------------------------

def test_shard_on_first_and_last_coordinates_assembles_and_compares_replicas():
    layout = MeshLayout(("pp", "tp"), (3, 2))
    full = torch.arange(12.0).view(4, 3)
    place = {"pp": Shard(0, on=(0, -1)), "tp": Shard(0)}

    def piece(rank, value):
        pp, tp = layout.coords(rank)
        if pp not in (0, 2):
            return Piece(value[:0], (4, 3), place)
        return Piece(value[2 * tp:2 * tp + 2], (4, 3), place)

    got = assemble("emb", {r: piece(r, full) for r in range(layout.world)}, layout)
    assert torch.equal(got.tensor, full) and got.replica_gap == 0
    other = full.clone()
    other[3, 1] += 1  # the last stage's copy differs: a tied gradient that was not summed
    pieces = {r: piece(r, other if layout.coord(r, "pp") == 2 else full) for r in range(layout.world)}
    got = assemble("emb", pieces, layout)
    assert got.replica_gap == 1 and set(got.replica_gap_ranks) == {1, 5}
