"""Benchmarks of the harness: ``python -m harness.bench [--json] [--repeats N]``.

Measures, in one invocation (this machine is shared and noisy, so figures are medians, and the
speedup is a ratio against the baseline run right here):

* pool start: a fresh pool of 8 ranks, from nothing (a new keeper, :class:`harness.pool.kept.ForkServer`)
  to every rank joined; pool restart: the same pool started again after it was killed (as after a
  hang), forked from the process's keeper, and its ratio to the start;
* first case: the TP MLP cell as the first case on each of those fresh pools (what the first cell
  of every pytest worker, and the cell after a hang, costs), beside the warm figure;
* a cell after a cell of another world size: the TP MLP cell (tp=4) each time right after the same
  cell at tp=2, so that its ranks make a new world (default group, meshes) first
  (:mod:`harness.world`), beside the warm figure;
* empty case round trip at world 2, 4 and 8;
* one representative cell per component (``CELLS``: the TP MLP cell at tp=4, ring attention at
  cp=4, MoE at ep=4 (ours and transformers'), ...): run, assemble, compare with the cached reference;
* the edit loop, end to end (``--edit-loop N``, default 5 each): ``python -c "import torch, pytest"``,
  one cell by node id with a cold pool, and the same with a kept pool (``--keep-pool``; started and
  warmed once beforehand, stopped after), each a fresh pytest process from the checkout root, medians
  and the ratios to the import in the same invocation;
* starting every cell clean (:mod:`harness.pool.state`): the baseline a rank takes once, the check
  after each task, and a check that finds a function replaced;
* spawn-per-test, the baseline: the same cell in freshly spawned processes with a fresh process
  group, as PyTorch's MultiProcessTestCase runs each test; for the TP cell and for the whole-model
  cell (``MODELS``: transformers' tiny Llama, its TP plan x FSDP2 on dp=2,tp=2, 3 steps; without
  transformers, harness/examples/titan.py on the same mesh).

The table goes to stderr; with ``--json``, stdout is one JSON object with the figures, nothing else
(``python -m harness.bench --json | jq .speedup_vs_spawn``). About a minute on 2 idle cores.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import statistics
import sys
import tempfile
import time

from .cell import assemble_result, parity, run_cell
from .config import Config
from .pool.kept import fork_server
from .pool.parent import Pool
from .resolve import resolve
from reference.checkpoint import SIZES as CKPT_SIZES

TP_MLP = Config("tp", "ours", {"tp": 4}, "fp32", dict(b=4, s=8, h=16, f=32, v=40), {"op": "mlp"})
MODELS = {  # a warm whole-model cell each; the first that runs here is also spawned per test
    "model_llama_dp2tp2": Config.parse("llama-tpfsdp-dp2.tp2-fp32-plain-steps3-seed0"),
    "model_titan_dp2tp2": Config("titan", "titan", {"dp": 2, "tp": 2}, "fp32", {"steps": 3}),
}
# One representative cell per component, timed warm (run, assemble, compare with the cached reference).
CELLS = {
    "tp_mlp_tp4": TP_MLP,
    "ring_cp4": Config("ringattn", "ours", {"cp": 4}, "fp32", dict(b=2, s=48, h=16, q=4, d=4),
                       {"mask": "causal", "layout": "zigzag", "gqa": "on"}),
    "moe_ep4": Config("moe", "ours", {"ep": 4}, "fp32", dict(t=24, h=8, f=16, e=8, k=2),
                      {"emesh": "dense", "cap": "125", "score": "softmax", "norm": "on", "route": "rand"}),
    # transformers' EP on the same shape (dropless: it has no capacity); skipped without the extra
    "moe_hf_ep4": Config("moe", "hf", {"ep": 4}, "fp32", dict(t=24, h=8, f=16, e=8, k=2),
                         {"emesh": "dense", "cap": "none", "score": "softmax", "norm": "on", "route": "rand",
                          "epimpl": "alltoall"}),
    "pp4_interleaved": Config("pp", "ours", {"pp": 4}, "fp32", dict(b=8, s=4, h=8, f=16, v=24, l=8, m=8, vs=2),
                              {"sched": "interleaved", "tied": "on"}),
    "hsdp_2x2": Config("fsdp", "ours", {"rep": 2, "shard": 2}, "fp32", dict(b=72, h=6, f=13, o=5, m=1)),
    "ckpt_fsdp3_to_hsdp2x4": Config("ckpt", "dcp", {"w": 8}, "fp32", CKPT_SIZES, {"save": "fsdp3", "load": "hsdp2x4"}),
    # whole models: transformers' tiny Llama (2 layers, its TP plan x FSDP2), harness/examples/titan.py (a 2-layer
    # Llama, TP + SP + loss_parallel x FSDP2); 4 ranks, 3 AdamW steps
    **MODELS,
}


NODE_ID = f"cases/test_tp.py::test_tp[{TP_MLP.id}]"


def _seconds(command: list[str], env: dict, cwd: str) -> float:
    import subprocess

    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return took


def edit_loop(repeats: int) -> dict:
    """Medians of ``repeats`` end-to-end runs each, interleaved (import, cold, kept, in an order
    that rotates each round), so that the machine's load falls alike on all three: the import of
    torch and pytest, one cell by node id on a cold pool and on a kept one."""
    import tempfile

    from .pool import kept

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runtime = tempfile.mkdtemp(prefix="bench", dir="/tmp")  # a kept pool of its own, stopped at the end
    env = dict(os.environ, XDG_RUNTIME_DIR=runtime)
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop(kept.ENV, None)
    pytest_cell = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", NODE_ID]
    keep = [*pytest_cell, "--keep-pool", "600"]
    commands = {"import": [sys.executable, "-c", "import torch, pytest"], "cold": pytest_cell, "kept": keep}
    times: dict[str, list[float]] = {name: [] for name in commands}
    try:
        _seconds(keep, env, root)  # starts the kept pool: its torch import is paid here, once
        for round_ in range(repeats):
            # each kind first, second and third in turn: a load that falls or rises through the
            # invocation favours none of them
            names = list(commands)
            for name in names[round_ % 3:] + names[:round_ % 3]:
                times[name].append(_seconds(commands[name], env, root))
    finally:
        _seconds([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--stop-pool"], env, root)
        import shutil

        shutil.rmtree(runtime, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "import_torch_pytest_s": round(medians["import"], 3),
        "one_cell_cold_s": round(medians["cold"], 3),
        "one_cell_kept_s": round(medians["kept"], 3),
        "one_cell_cold_over_import": round(medians["cold"] / medians["import"], 2),
        "one_cell_kept_over_import": round(medians["kept"] / medians["import"], 2),
        "edit_loop_runs": {name: [round(v, 3) for v in values] for name, values in times.items()},
        "edit_loop_repeats": repeats,
    }


def clean_start(repeats: int) -> dict:
    """What starting every cell clean costs a rank (:mod:`harness.pool.state`): the baseline taken
    once as the rank starts, and the check after each task, with every registered implementation's
    modules imported as a rank of the default pool has them; and the check of a task that replaced
    a function (which then replaces the ranks: a pool start, above)."""
    import importlib

    import torch.nn.functional as F

    from .pool.parent import default_preload
    from .pool.state import Baseline

    for module in default_preload():
        importlib.import_module(module)
    t = time.perf_counter()
    baseline = Baseline.take()
    take_ms = (time.perf_counter() - t) * 1e3
    check_ms = _median_ms(baseline.check, repeats)
    gelu = F.gelu

    def patched() -> None:
        F.gelu = lambda x, approximate="none": x
        baseline.check(put_back_code=True)

    patched_ms = _median_ms(patched, max(5, repeats // 10))
    assert F.gelu is gelu
    return {"clean_take_ms": round(take_ms, 2), "clean_check_ms": round(check_ms, 3),
            "clean_check_patched_ms": round(patched_ms, 3), "clean_dicts": len(baseline.spaces.dicts)}


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _spawned_rank(rank: int, world: int, store_path: str, cfg: Config, out) -> None:
    import torch
    import torch.distributed as dist

    from .paths import load
    from .layout import MeshLayout
    from .pool.rank import build_meshes, context
    from .pool.wire import dumps

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    cell = resolve(cfg)
    meshes: dict = {}
    layout = MeshLayout.of(cfg.mesh)
    build_meshes(meshes, (layout, *cell.meshes), "gloo")
    ctx = context(rank, layout, cell.meshes, meshes, torch.device("cpu"), "gloo", "")
    pieces = load(cell.impl.run)(ctx, cfg)
    out.send_bytes(dumps(pieces))  # as the pool sends results
    dist.destroy_process_group()


def spawn_per_test(cfg: Config) -> None:
    """One test the MultiProcessTestCase way: spawn ranks, init a process group, run, tear down."""
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(cfg.world)]
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_spawned_rank, args=(r, cfg.world, os.path.join(tmp, "store"), cfg, pipes[r][1]))
                 for r in range(cfg.world)]
        for p in procs:
            p.start()
        pieces = {r: pickle.loads(recv.recv_bytes()) for r, (recv, _) in enumerate(pipes)}
        for p in procs:
            p.join()
            if p.exitcode:
                raise RuntimeError(f"spawned rank exited with {p.exitcode}")
    _, report = parity(resolve(cfg), assemble_result(cfg.mesh, pieces))
    assert report.ok, report.table()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m harness.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object, last line")
    parser.add_argument("--repeats", type=int, default=200, help="round trips per empty-case median")
    parser.add_argument("--starts", type=int, default=3, help="pool starts (and spawn-per-test runs) per median")
    parser.add_argument("--edit-loop", type=int, default=5, metavar="N",
                        help="end-to-end runs per median of the edit-loop figures (0: skip them)")
    parser.add_argument("--only-edit-loop", action="store_true", help="measure the edit-loop figures alone")
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr)

    loop = edit_loop(args.edit_loop) if args.edit_loop > 0 else {}
    if loop:
        say(f"import torch, pytest      {loop['import_torch_pytest_s']:8.2f} s   median of {args.edit_loop}")
        say(f"one cell by id, cold pool {loop['one_cell_cold_s']:8.2f} s   {loop['one_cell_cold_over_import']:.2f}x the import")
        say(f"one cell by id, kept pool {loop['one_cell_kept_s']:8.2f} s   {loop['one_cell_kept_over_import']:.2f}x the import")
    if args.only_edit_loop:
        if args.json:
            print(json.dumps(loop))
        return loop

    starts, firsts, restarts = [], [], []
    for _ in range(args.starts):
        fork_server().close()  # from nothing: a new keeper imports torch and the preloads
        pool = Pool(size=8)
        t = time.perf_counter()
        pool.start()
        starts.append(time.perf_counter() - t)
        firsts.append(_median_ms(lambda: run_cell(TP_MLP, pool), 1))  # mesh groups, imports: all first
        pool.kill()  # as after a hang: the next start forks from the process's keeper
        t = time.perf_counter()
        pool.start()
        restarts.append(time.perf_counter() - t)
        pool.close()
    pool = Pool(size=8)
    pool.start()
    empty = {}
    for world in (2, 4, 8):
        mesh = (("tp", world),)
        pool.run("harness.pool.tasks:noop", None, mesh)  # creates and caches the mesh's groups
        empty[str(world)] = _median_ms(lambda: pool.run("harness.pool.tasks:noop", None, mesh), args.repeats)
    cell_repeats = max(20, args.repeats // 10)
    cell_ms = {}
    for name, cfg in CELLS.items():
        disposition = resolve(cfg).valid().disposition
        if disposition.kind == "skip":
            print(f"cell {name:<20} skipped: {disposition.reason}", file=sys.stderr)
            continue
        run_cell(cfg, pool)  # warm: reference computed, groups cached, modules imported
        cell_ms[name] = _median_ms(lambda: run_cell(cfg, pool), cell_repeats)
    other = TP_MLP.replace(mesh={"tp": 2})
    after_other = []
    for _ in range(cell_repeats):
        run_cell(other, pool)
        after_other.append(_median_ms(lambda: run_cell(TP_MLP, pool), 1))
    pool.close()
    tp_ms = cell_ms["tp_mlp_tp4"]
    spawn = [_median_ms(lambda: spawn_per_test(TP_MLP), 1) / 1e3 for _ in range(args.starts)]
    model = next(name for name in MODELS if name in cell_ms)
    model_spawn = [_median_ms(lambda: spawn_per_test(MODELS[model]), 1) / 1e3 for _ in range(args.starts)]
    clean = clean_start(args.repeats)
    figures = {
        "pool_start_s": round(statistics.median(starts), 3),
        "pool_restart_s": round(statistics.median(restarts), 3),
        "restart_over_start": round(statistics.median(restarts) / statistics.median(starts), 3),
        "first_case_ms": round(statistics.median(firsts), 2),
        "empty_case_ms": {k: round(v, 3) for k, v in empty.items()},
        "cell_ms": {name: round(ms, 2) for name, ms in cell_ms.items()},
        "cell_after_other_world_ms": round(statistics.median(after_other), 2),
        "other_world_over_warm": round(statistics.median(after_other) / tp_ms, 2),
        "spawn_per_test_s": round(statistics.median(spawn), 3),
        "speedup_vs_spawn": round(statistics.median(spawn) * 1e3 / tp_ms, 1),
        "model_spawn_per_test_s": round(statistics.median(model_spawn), 3),
        "model_speedup_vs_spawn": round(statistics.median(model_spawn) * 1e3 / cell_ms[model], 1),
        **clean,
        "clean_check_over_empty_case": round(clean["clean_check_ms"] / empty["4"], 3),
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        **loop,
    }

    say(f"pool start (8 ranks)      {figures['pool_start_s']:8.2f} s   median of {args.starts}")
    say(f"pool restart (8 ranks)    {figures['pool_restart_s']:8.2f} s   median of {args.starts}, "
        f"{figures['restart_over_start']:.2f}x the start: forked from the process's keeper, after a hang")
    say(f"first TP cell, fresh pool {figures['first_case_ms']:8.2f} ms  median of {args.starts} (warm: below)")
    for world, ms in figures["empty_case_ms"].items():
        say(f"empty case, world {world}       {ms:8.2f} ms  median of {args.repeats}")
    for name, ms in cell_ms.items():
        say(f"cell {name:<20} {ms:8.2f} ms  run + assemble + compare, median of {cell_repeats}: {CELLS[name].id}")
    say(f"tp_mlp_tp4 after a tp2 cell {figures['cell_after_other_world_ms']:6.2f} ms  median of {cell_repeats}, "
        f"{figures['other_world_over_warm']:.2f}x the warm cell: a new world (default group, meshes) first")
    say(f"spawn-per-test, same cell {figures['spawn_per_test_s']:8.2f} s   median of {args.starts}")
    say(f"speedup per case          {figures['speedup_vs_spawn']:8.1f} x")
    say(f"spawn-per-test, model     {figures['model_spawn_per_test_s']:8.2f} s   median of {args.starts}: "
        f"{MODELS[model].id}")
    say(f"speedup per model cell    {figures['model_speedup_vs_spawn']:8.1f} x")
    say(f"clean start: baseline     {figures['clean_take_ms']:8.2f} ms  once per rank, {figures['clean_dicts']} "
        "module and class dicts")
    say(f"clean start: check        {figures['clean_check_ms']:8.3f} ms  per rank and task, median of {args.repeats}, "
        f"{figures['clean_check_over_empty_case']:.2f}x the empty case at world 4")
    say(f"clean start: a patch      {figures['clean_check_patched_ms']:8.3f} ms  found and put back")
    if args.json:
        print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
