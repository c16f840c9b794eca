"""The warm pool under faults: raising, hanging and dying ranks; random state; no orphans."""
import json
import os
import signal
import subprocess
import time

import pytest
import torch

from harness.registry import reference_of
from harness.resolve import _references, resolve
from harness.config import Config
from harness.pool.parent import CaseFailure, Pool, PoolError, default_preload, reference_preload
from harness.registry import COMPONENTS, Component, get, register_component
from tests.conftest import run_python

TP4 = (("tp", 4),)


def test_rank_that_raises_reports_every_rank(small_pool):
    with pytest.raises(CaseFailure) as failure:
        small_pool.run("tests.faults:raise_on_rank1", None, TP4)
    text = str(failure.value)
    assert "rank 1: raised: ValueError: planted failure on rank 1" in text
    assert 'tests/faults.py", line' in text  # rank 1's own traceback
    # left waiting in the collective rank 1 never joined, at the same line: told once, together
    assert "ranks 0, 2, 3: hung: in all_reduce" in text and text.count("hung: in all_reduce") == 1
    assert {o.status for o in failure.value.outcomes.values()} == {"raised", "hung"}
    assert small_pool.run("harness.pool.tasks:noop", None, TP4) == {r: None for r in range(4)}


def test_every_rank_raising_keeps_the_pool(small_pool):
    small_pool.start()
    starts = small_pool.starts
    with pytest.raises(CaseFailure) as failure:
        small_pool.run("tests.faults:raise_everywhere", None, TP4)
    for rank in range(4):
        assert f"RuntimeError: planted failure on rank {rank}" in str(failure.value)
    small_pool.run("harness.pool.tasks:noop", None, TP4)
    assert small_pool.starts == starts  # nobody was stuck: no restart needed


def test_hung_rank_shows_its_stack_fails_in_time_and_the_next_case_passes(small_pool):
    deadline = 2.0
    small_pool.run("harness.pool.tasks:noop", None, TP4)  # started, its world and mesh built: the clock times the case
    start = time.monotonic()
    with pytest.raises(CaseFailure) as failure:
        small_pool.run("tests.faults:hang_on_last", None, TP4, deadline=deadline)
    assert time.monotonic() - start < deadline + 10
    text = str(failure.value)
    assert "passed its deadline of 2.0 s" in text
    assert "rank 3: hung: at tests/faults.py" in text and "in hang_on_last" in text
    assert "ranks 0-2: hung: in all_reduce" in text  # waiting at the same line: told together
    starts = small_pool.starts
    assert small_pool.run("tests.faults:pids", None, TP4)  # a fresh pool answers
    assert small_pool.starts == starts + 1


def test_rank_that_exits_is_named_with_its_exit_code(small_pool):
    with pytest.raises(CaseFailure) as failure:
        small_pool.run("tests.faults:exit_on_rank1", 7, TP4)
    assert "rank 1: died: process died (exit code 7)" in str(failure.value)
    small_pool.run("harness.pool.tasks:noop", None, TP4)


def test_ranks_that_die_while_starting_are_named_with_how_they_ended():
    pool = Pool(size=2, preload=["tests.fork_exits"])
    try:
        with pytest.raises(PoolError) as failure:
            pool.start()
        assert "pool of 2 ranks failed to start: rank " in str(failure.value)
        assert "died while starting (exit code 5)" in str(failure.value), failure.value
    finally:
        pool.close()


def test_result_the_parent_cannot_unpickle_is_named(small_pool):
    with pytest.raises(CaseFailure, match="its result cannot be unpickled in the parent"):
        small_pool.run("tests.faults:unpicklable_result", None, (("tp", 2),))
    small_pool.run("harness.pool.tasks:noop", None, TP4)


def test_tensors_travel_exactly_with_their_kind(small_pool):
    """Results and payloads cross the pipe as raw bytes (plain CPU tensors) or pickle's own way (a
    Parameter, a tensor that needs a gradient, a conj view): same values, dtypes, shapes, kinds."""
    payload = {"x": torch.randn(5, 3), "half": torch.ones(2, dtype=torch.float16), "n": 3}
    values = small_pool.run("tests.faults:tensors_of_every_kind", payload, (("tp", 2),))
    for rank, got in values.items():
        base = torch.arange(24, dtype=torch.float64).reshape(4, 6) + rank
        want = {"view": base[1:, ::2], "scalar": torch.tensor(rank + 0.5), "empty": torch.empty(0, 3, dtype=torch.int64),
                "bf16": (base / 7).to(torch.bfloat16), "bool": base > 10,
                "complex": torch.complex(base.float(), -base.float()).conj(), "param": base.float(), "grad": base.float()}
        assert got["payload"]["n"] == 3
        for name in ("x", "half"):
            assert torch.equal(got["payload"][name], payload[name]) and got["payload"][name].dtype == payload[name].dtype
        for name, t in want.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
            assert torch.equal(got[name].resolve_conj(), t.resolve_conj()), name
        assert isinstance(got["param"], torch.nn.Parameter) and got["grad"].requires_grad
        assert got["view"].is_contiguous() and got["view"].untyped_storage().nbytes() == got["view"].nbytes


def test_random_state_is_private_per_rank_and_fixed_by_the_seed(small_pool):
    first = small_pool.run("tests.faults:draw_random", None, TP4, seed=5)
    again = small_pool.run("tests.faults:draw_random", None, TP4, seed=5)
    other = small_pool.run("tests.faults:draw_random", None, TP4, seed=6)
    assert all(torch.equal(first[r], again[r]) for r in range(4))
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first[0], other[0])
    small_pool.kill()  # a fresh pool (fresh processes) draws the same numbers
    fresh = small_pool.run("tests.faults:draw_random", None, TP4, seed=5)
    assert all(torch.equal(first[r], fresh[r]) for r in range(4))


def test_a_reference_is_computed_once_per_problem_on_a_rank_beside_the_pool(small_pool):
    """A cell's reference runs in a world of one on a rank beside the pool's, not in pytest's process
    (whose optimizer step would import torch._dynamo, about 1 s, for nothing else), once per problem,
    with the numbers the same reference gives in this process (in a world of one made there); the
    cells' ranks keep their world (leaving it would build every mesh again)."""
    tp = get("tp")
    register_component(Component("wheretp", "tests.faults:reference_where", tp.validate, tp.reduction,
                                 dict(tp.implementations)))
    sizes = dict(b=2, s=4, h=8, f=8, v=8)
    try:
        ranks = small_pool.run("tests.faults:pids", None, TP4)
        world = small_pool.run("tests.faults:default_group", None, TP4)
        cfg = Config("wheretp", "ours", {"tp": 2}, "fp32", sizes, {"op": "mlp"})
        got = resolve(cfg).reference(small_pool)
        beside = int(got["pid"])
        assert beside in small_pool.pids and beside not in [*ranks.values(), os.getpid()]
        assert got["world"].tolist() == [1, 0, 0, 0, 1]  # a world of one: size, rank, RANK, LOCAL_RANK, WORLD_SIZE
        assert resolve(Config("wheretp", "ours", {"tp": 4}, "fp32", sizes, {"op": "mlp"})).reference(small_pool) is got
        assert int(resolve(Config("wheretp", "ours", {"tp": 4}, "fp32", sizes, {"op": "sp"})).reference(
            small_pool)["pid"]) == beside  # another problem: computed again, there
        real = Config("tp", "ours", {"tp": 2}, "fp32", sizes, {"op": "mlp"})
        there, here = resolve(real).reference(small_pool), reference_of(tp.reference, real.problem)
        assert there.keys() == here.keys() and all(torch.equal(there[k], here[k]) for k in here)
        assert reference_of(get("wheretp").reference, cfg.problem)["world"].tolist() == [1, 0, 0, 0, 1]  # here: a world of one too
        assert small_pool.run("tests.faults:default_group", None, TP4) == world
    finally:
        COMPONENTS.pop("wheretp")
        for key in [k for k in _references if k[0] in ("wheretp", "tp")]:
            del _references[key]


def test_the_pools_of_a_process_import_what_its_cells_need_once_and_nothing_else():
    """The cells' pool and the pool of one fork from one keeper of the process (a fresh one here:
    this process's earlier pools preloaded every registered component), which imports what both
    need: the implementations' and the references' modules of the selected cells, not the others'."""
    from harness.pool.kept import fork_server

    fork_server().close()
    cfgs = [Config("tp", "ours", {"tp": 2}, "fp32", dict(b=2, s=4, h=8, f=8, v=8), {"op": "mlp"})]
    pool = Pool(size=2, preload=default_preload(cfgs), alone_preload=reference_preload(cfgs))
    modules = ["harness.parallel.tp", "harness.parallel.tp_megatron", "reference.moe", "reference.tp"]
    try:
        pool.start(alone=True)
        assert pool.run("tests.faults:imported", modules, (("tp", 2),)) == {r: ["harness.parallel.tp", "reference.tp"]
                                                                            for r in (0, 1)}
        assert pool.alone("tests.faults:imported", modules, (("tp", 1),)) == ["harness.parallel.tp", "reference.tp"]
        keeper = fork_server()._proc.pid
        pool.kill()  # as after a hang: the next start forks from the same keeper
        assert pool.run("tests.faults:imported", modules, (("tp", 2),))[1] == ["harness.parallel.tp", "reference.tp"]
        assert fork_server()._proc.pid == keeper and pool.starts == 2
    finally:
        pool.close()


def test_the_process_that_drives_a_pool_runs_one_intra_op_thread():
    """Its OpenMP threads would spin between its comparisons on the cores its ranks need."""
    code = ("import torch; torch.set_num_threads(2)\n"
            "from harness.pool.parent import Pool\n"
            "pool = Pool(size=2)\n"
            "pool.run('harness.pool.tasks:noop', None, (('tp', 2),))\n"
            "print('threads', torch.get_num_threads()); pool.close()")
    out, err = run_python(code, stdout=subprocess.PIPE, stderr=subprocess.PIPE).communicate(timeout=300)
    assert "threads 1" in out, out + err


def test_mesh_larger_than_pool_is_refused_before_running(small_pool):
    from harness.pool.parent import PoolError

    with pytest.raises(PoolError, match="needs 8 ranks but the pool has 4"):
        small_pool.run("harness.pool.tasks:noop", None, (("tp", 8),))


def test_two_pools_side_by_side_do_not_collide():
    """What two xdist workers do: each hosts its own rendezvous on a free port."""
    a, b = Pool(size=2), Pool(size=2)
    try:
        a.start()
        b.start()
        assert a.run("harness.pool.tasks:all_reduce_rank", "tp", (("tp", 2),)) == {0: 1.0, 1: 1.0}
        assert b.run("harness.pool.tasks:all_reduce_rank", "tp", (("tp", 2),)) == {0: 1.0, 1: 1.0}
    finally:
        a.close()
        b.close()


START_POOL = """
import json, sys
from harness.pool.parent import Pool
pool = Pool(size=2)
pool.start()
print(json.dumps([pool.pids, pool._tmp]), flush=True)
sys.stdin.readline()  # until the test says go: then a normal exit, through atexit
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): count it as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def _wait_gone(pids, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("ending", ["normal exit", "SIGKILL"])
def test_no_process_is_left_behind(ending):
    proc = run_python(START_POOL, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    pids, tmp = json.loads(proc.stdout.readline())
    assert len(pids) == 3 and all(_alive(p) for p in pids)  # the zygote and two ranks
    assert os.path.isdir(tmp)
    if ending == "SIGKILL":
        proc.send_signal(signal.SIGKILL)
    else:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    proc.wait(timeout=30)
    assert _wait_gone(pids) == []
    assert not os.path.exists(tmp)  # nor its temporary directory (stack dumps, rank logs)
