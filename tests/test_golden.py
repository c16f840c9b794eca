"""Golden files: exact round trip, deterministic bytes, clear errors, update only what changed."""
import os
import subprocess
import sys

import pytest
import torch

from harness.cell import CellOutcome, Divergence, check_golden
from harness.compare.diff import Report
from harness.config import Config
from harness.golden.store import GoldenError, golden_path, read_golden, write_golden
from harness.compare.tolerance import tolerance

CFG = Config("tp", "ours", {"tp": 2}, "bf16", {"b": 4}, {"op": "mlp"})
RERUN = "python -m pytest 'cases/test_tp.py::test_tp[x]'"


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"out": torch.randn(4, 8, generator=g).bfloat16(), "grad/w": torch.randn(8, generator=g),
            "loss": torch.tensor(0.25)}


def test_round_trip_is_exact_and_keeps_metadata(tmp_path):
    path = golden_path(tmp_path, CFG)
    write_golden(path, tensors(), {"config": CFG.id, "torch": "x"})
    got, meta = read_golden(path, CFG)
    assert meta == {"config": CFG.id, "torch": "x"}
    assert all(got[k].dtype == t.dtype and torch.equal(got[k], t) for k, t in tensors().items())
    assert os.listdir(path.parent) == [path.name]  # no temporary file left beside it


WRITE = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.test_golden import tensors, CFG
from harness.golden.store import write_golden
from pathlib import Path
write_golden(Path(sys.argv[1]), tensors(), {{"config": CFG.id, "b": "2", "a": "1"}})
"""


def test_bytes_are_deterministic_across_processes(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [tmp_path / f"{i}.safetensors" for i in range(2)]
    for path in paths:  # separate processes: any per-process hash seed would show
        subprocess.run([sys.executable, "-c", WRITE.format(root=root), str(path)], check=True)
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_missing_golden_says_how_to_create_it(tmp_path):
    with pytest.raises(GoldenError, match=r"is missing: create it with\n  python -m pytest 'cases/test_tp.py::test_tp\[x\]' --update-golden"):
        read_golden(golden_path(tmp_path, CFG), CFG, RERUN)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_golden_is_a_clear_error_naming_the_file(tmp_path, damage):
    path = golden_path(tmp_path, CFG)
    write_golden(path, tensors(), {"config": CFG.id})
    data = path.read_bytes()
    path.write_bytes({"garbage": b"\x00not a safetensors file" * 10, "truncated": data[: len(data) // 2],
                      "empty": b""}[damage])
    with pytest.raises(GoldenError, match="corrupt or truncated") as error:
        read_golden(path, CFG, RERUN)
    assert str(path) in str(error.value) and "--update-golden" in str(error.value)


def test_golden_of_another_config_is_refused(tmp_path):
    path = golden_path(tmp_path, CFG)
    write_golden(path, tensors(), {"config": "tp-ours-tp4-bf16-op_mlp-b4-seed0"})
    with pytest.raises(GoldenError, match="holds config"):
        read_golden(path, CFG)


def outcome(result):
    return CellOutcome(CFG, tolerance("bf16", 16), Report(), result=result)


def test_update_writes_only_what_changed_and_says_what_moved(tmp_path):
    path = golden_path(tmp_path, CFG)
    first = outcome(tensors())
    check_golden(first, tmp_path, update=True)
    assert first.golden_status == "written"
    before = path.stat().st_mtime_ns, path.read_bytes()
    same = outcome(tensors())
    check_golden(same, tmp_path, update=True)
    assert same.golden_status == "identical" and (path.stat().st_mtime_ns, path.read_bytes()) == before
    moved = tensors()
    moved["grad/w"] = moved["grad/w"] * 1.5
    changed = outcome(moved)
    check_golden(changed, tmp_path, update=True)
    assert changed.golden_status == "updated"
    assert "grad/w" in changed.moved and "1.5" in changed.moved  # norm ratio of what moved
    assert torch.equal(read_golden(path, CFG)[0]["grad/w"], moved["grad/w"])


def test_drift_fails_without_update_and_rounding_passes_as_not_identical(tmp_path):
    check_golden(outcome(tensors()), tmp_path, update=True)
    drifted = tensors()
    drifted["out"] = drifted["out"] * 2
    with pytest.raises(Divergence, match="drifted from its golden file"):
        check_golden(outcome(drifted), tmp_path)
    noisy = tensors()
    noisy["grad/w"] = noisy["grad/w"] * (1 + 1e-7)
    result = outcome(noisy)
    check_golden(result, tmp_path)
    assert result.golden_status == "within tolerance" and not result.golden.bit_identical


def test_a_missing_golden_is_written_from_a_passing_run_or_fails_when_strict(tmp_path):
    with pytest.raises(GoldenError, match="is missing"):
        check_golden(outcome(tensors()), tmp_path, missing="fail", rerun=RERUN)
    assert not golden_path(tmp_path, CFG).exists()
    new = outcome(tensors())
    check_golden(new, tmp_path, missing="write")
    assert new.golden_status == "written" and golden_path(tmp_path, CFG).exists()
    again = outcome(tensors())
    check_golden(again, tmp_path, missing="fail")
    assert again.golden_status == "identical"
