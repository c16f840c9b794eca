"""Bad checkpoints: each is refused with an error that names the file and the key, and the target
state is left as it was; a save whose rank is killed half way leaves nothing that loads.

The ranks run in the warm pool (``small_pool``, 4 ranks), FSDP2 over 2 ranks: a real DCP save and
load with real process groups. Checkpoints are written to pytest's ``tmp_path`` (not the task's
scratch directory, which the pool removes after each task) so the test can damage them between
the saving task and the loading one.
"""
import json
import os
import re
import signal

import pytest
import torch

from harness.config import Config
from harness.pool.parent import CaseFailure
from harness.parallel.checkpoint import _local, parse_layout, side
from harness.parallel.checkpoint_io import MANIFEST, METADATA, CheckpointError
from reference.checkpoint import SIZES, make_problem

LAYOUT = parse_layout("fsdp2")
MESH = (("w", 2),)
EXTRA = [LAYOUT.dims]


def _cfg(sizes=SIZES, load="fsdp2") -> Config:
    return Config("ckpt", "dcp", MESH, "fp32", sizes, {"save": "fsdp2", "load": load})


# ---- rank functions (run in the pool) ------------------------------------------------------------
def save_task(ctx, payload):
    """Train one step on fsdp2 and save to ``path`` (``sizes``/``load`` pick another model or key format)."""
    path, sizes, load = payload
    cfg = _cfg(sizes, load)
    held = side(ctx, LAYOUT, cfg, make_problem(cfg).params)
    held.step(*make_problem(cfg).batches[0])
    held.save(path)


def load_task(ctx, path):
    """Try to load ``path`` into a trained target; return the error and whether the target is untouched."""
    cfg = _cfg()
    problem = make_problem(cfg)
    held = side(ctx, LAYOUT, cfg, problem.target_params)
    held.step(*problem.target_batches[0])
    before = {k: _local(t).clone() for k, t in held.tensors().items()}
    try:
        held.load(path)
        error = None
    except CheckpointError as e:
        error = str(e)
    untouched = all(torch.equal(before[k], _local(t)) for k, t in held.tensors().items())
    return error, untouched


def dying_save_task(ctx, payload):
    """As save_task, but rank ``victim`` is killed (SIGKILL) inside DCP's write, with half its file on disk."""
    path, victim = payload
    if ctx.rank == victim:
        from torch.distributed.checkpoint import FileSystemWriter

        write = FileSystemWriter.write_data

        def write_half_then_die(self, plan, planner):
            write(self, plan, planner).wait()
            for name in os.listdir(self.path):
                if name.startswith(f"__{victim}_"):
                    file = os.path.join(self.path, name)
                    os.truncate(file, os.path.getsize(file) // 2)
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_half_then_die  # this rank process only: it dies here
    save_task(ctx, (path, SIZES, "fsdp2"))


def full_state_task(ctx, layouts):
    """``full_state`` (one gather, placed by DTensor's offsets) against ``full_tensor()`` on each layout."""
    out = {}
    cfg = _cfg()
    problem = make_problem(cfg)
    for text in layouts:
        layout = parse_layout(text)
        if ctx.rank >= layout.world:
            continue
        held = side(ctx, layout, cfg, problem.params)
        held.step(*problem.batches[0])
        mine = held.full_state()
        out[text] = all(torch.equal(mine[k], t.full_tensor() if hasattr(t, "full_tensor") else t)
                        for k, t in held.tensors().items())
    return out


# ---- the tests -----------------------------------------------------------------------------------
def _save(pool, path, sizes=SIZES, load="fsdp2"):
    pool.run("tests.test_checkpoint_faults:save_task", (str(path), sizes, load), MESH, extra_meshes=EXTRA)


def _load(pool, path) -> str | None:
    """Every rank must give the same error, and a refused load must leave every rank's state as it
    was (a good one must change it); returns the error (None: loaded)."""
    out = pool.run("tests.test_checkpoint_faults:load_task", str(path), MESH, extra_meshes=EXTRA)
    (error,) = {e for e, _ in out.values()}
    untouched = {u for _, u in out.values()}
    assert untouched == {error is not None}, f"untouched={untouched} after: {error}"
    return error


def _items(path, key):
    with open(os.path.join(path, MANIFEST)) as f:
        return [item for item in json.load(f)[1:] if item["key"] == key]


def test_a_good_checkpoint_loads(small_pool, tmp_path):
    path = tmp_path / "ckpt"
    _save(small_pool, path)
    assert _load(small_pool, path) is None


def test_missing_directory(small_pool, tmp_path):
    error = _load(small_pool, tmp_path / "nowhere")
    assert error == f"no checkpoint at {tmp_path / 'nowhere'}: the directory does not exist"


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "deleted"])
def test_damaged_data_file_names_the_file_and_the_key(small_pool, tmp_path, damage):
    path = tmp_path / "ckpt"
    _save(small_pool, path)
    (item,) = [i for i in _items(path, "model.w1.weight") if i["file"].startswith("__1_")]  # rank 1's chunk
    file = path / item["file"]
    if damage == "truncated":
        os.truncate(file, item["start"] + item["length"] // 2)
    elif damage == "corrupted":
        data = bytearray(file.read_bytes())
        data[item["start"] + item["length"] // 2] ^= 0x40
        file.write_bytes(bytes(data))
    else:
        file.unlink()
    error = _load(small_pool, path)
    assert error.startswith(str(file)), error
    expected = {"truncated": r"is truncated: \d+ bytes, but key '.*' .*lies at bytes \d+\.\.\d+",
                "corrupted": r"is corrupted: the bytes of key 'model\.w1\.weight' \(chunk at offset \[5, 0\]\) "
                             r"at \d+\.\.\d+ differ from the checksum recorded at save",
                "deleted": r"is missing; it holds key '"}[damage]
    assert re.search(expected, error), error


def test_corrupted_metadata(small_pool, tmp_path):
    path = tmp_path / "ckpt"
    _save(small_pool, path)
    data = bytearray((path / METADATA).read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / METADATA).write_bytes(bytes(data))
    error = _load(small_pool, path)
    assert error == (f"{path / METADATA} is corrupted: its checksum differs from the one recorded at save "
                     f"in {path / MANIFEST}")


def test_checkpoint_of_a_different_model_names_the_key(small_pool, tmp_path):
    path = tmp_path / "wider"
    _save(small_pool, path, sizes=dict(SIZES, f=12))  # same keys, W1/b1/W2 of another width
    error = _load(small_pool, path)
    assert error == (f"{path / METADATA}: key 'model.w1.weight' is saved with shape [12, 6] torch.float32, "
                     "the target has [10, 6] torch.float32: the checkpoint was saved from a different model")


def test_checkpoint_with_other_keys_names_the_key(small_pool, tmp_path):
    path = tmp_path / "flat"
    _save(small_pool, path, load="ours2")  # saved under our FSDP's keys (model.w1, optim.w1.exp_avg, ...)
    error = _load(small_pool, path)
    assert re.fullmatch(rf"{re.escape(str(path / METADATA))} has no key 'model\.w1\.weight' that the target needs "
                        r"\(and \d+ more\): the checkpoint was saved from a different model", error), error


@pytest.mark.parametrize("victim", [0, 1], ids=["coordinator", "rank1"])
def test_save_killed_midway_leaves_nothing_that_loads(small_pool, tmp_path, victim):
    path = tmp_path / "ckpt"
    with pytest.raises(CaseFailure) as failure:
        small_pool.run("tests.test_checkpoint_faults:dying_save_task", (str(path), victim), MESH,
                       extra_meshes=EXTRA, deadline=10.0)
    assert f"rank {victim}: died" in str(failure.value)
    assert not path.exists()
    (partial,) = [p for p in tmp_path.iterdir() if p.name.startswith("ckpt.partial-")]
    assert not (partial / MANIFEST).exists()
    error = _load(small_pool, path)
    assert error == (f"no checkpoint at {path}: the directory does not exist "
                     f"(found ['{partial.name}']: a save that did not complete)")
    error = _load(small_pool, partial)
    assert error == (f"{partial / MANIFEST} is missing: {partial} is not a complete checkpoint "
                     "(a save that was interrupted leaves no manifest)")


def test_full_state_agrees_with_full_tensor(small_pool):
    layouts = ["fsdp1", "fsdp3", "fsdp4", "hsdp2x2", "fsdptp2x2", "ours3", "ourshsdp2x2"]
    meshes = []
    for text in layouts:
        layout = parse_layout(text)
        meshes += [m for m in (layout.dims, layout.whole) if m not in meshes and m != (("w", 4),)]
    out = small_pool.run("tests.test_checkpoint_faults:full_state_task", layouts, (("w", 4),), extra_meshes=meshes)
    assert out[0] == {text: True for text in layouts}
