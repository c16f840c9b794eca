"""The comparison and the tolerance policy: catches real errors, accepts rounding noise."""
import math

import pytest
import torch

from harness.compare.diff import compare, unravel
from harness.layout import MeshLayout, Piece, Shard, assemble
from harness.compare.tolerance import TORCH_DTYPE, tolerance


def reference(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("n", [16, 256, 4096])
def test_planted_relative_error_of_1e_3_is_caught_in_fp32(n):
    want = reference(64, 64)
    got = want.float()
    got[7, 9] *= 1 + 1e-3
    report = compare({"w": got}, {"w": want}, tolerance("fp32", n))
    (row,) = report.failing()
    assert row.tensor == "w" and row.worst_index == (7, 9) and row.problem == "mismatch"
    assert row.bad == "1/4096"


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_rounding_noise_of_a_real_matmul_is_accepted(dtype):
    a, b = reference(32, 256), reference(256, 48, seed=1)
    t = TORCH_DTYPE[dtype]
    low = (a.to(t) @ b.to(t)).double()  # one rounding of the inputs, one of the output
    exact = a.to(t).double() @ b.to(t).double()
    assert compare({"y": low}, {"y": exact}, tolerance(dtype, 256)).ok


def test_scaling_bug_shows_in_the_norm_ratio():
    want = reference(8, 8)
    (row,) = compare({"g": want / 4}, {"g": want}, tolerance("bf16", 64)).failing()
    assert row.norm_ratio == pytest.approx(0.25)


def test_nan_is_never_within_tolerance():
    want = reference(4, 4)
    got = want.clone()
    got[1, 2] = float("nan")
    (row,) = compare({"g": got}, {"g": want}, tolerance("fp32", 1)).failing()
    assert row.problem == "nan/inf" and row.worst_index == (1, 2)


def test_missing_and_misshaped_tensors_fail():
    want = {"a": reference(2), "b": reference(3)}
    report = compare({"a": reference(4), "c": reference(3)}, want, tolerance("fp32", 1))
    problems = {(r.tensor, r.problem) for r in report.failing()}
    assert problems == {("a", "shape"), ("b", "missing"), ("c", "missing")}


def test_bad_ranks_name_the_shard_that_holds_the_error():
    layout = MeshLayout(("tp",), (4,))
    want = reference(8, 4)
    pieces = {r: Piece(want[2 * r: 2 * r + 2].clone(), (8, 4), {"tp": Shard(0)}) for r in range(4)}
    pieces[2].tensor[1, 3] += 1.0
    (row,) = compare({"g": assemble("g", pieces, layout)}, {"g": want}, tolerance("fp32", 8)).failing()
    assert row.ranks == "2" and row.worst_index == (5, 3)


def test_replicas_that_disagree_fail_even_if_one_copy_is_right():
    layout = MeshLayout(("tp",), (2,))
    want = reference(4)
    wrong = want.clone()
    wrong[0] += 1.0
    got = assemble("b", {0: Piece(wrong, (4,)), 1: Piece(want.clone(), (4,))}, layout)  # rank 1 wins
    (row,) = compare({"b": got}, {"b": want}, tolerance("fp32", 1)).failing()
    assert row.problem == "replicas" and row.ranks == "0,1"


def test_table_names_tensor_values_errors_and_tolerance():
    want = reference(4)
    table = compare({"grad/w": want * 2}, {"grad/w": want}, tolerance("fp32", 4)).table()
    for column in ("tensor", "worst index", "actual", "expected", "abs err", "rel err", "tol", "norm ratio"):
        assert column in table
    assert "grad/w" in table


def test_tolerance_grows_with_reduction_size_and_dtype():
    assert tolerance("fp32", 4096).rtol > tolerance("fp32", 16).rtol
    assert tolerance("bf16", 16).rtol > tolerance("fp16", 16).rtol > tolerance("fp32", 16).rtol
    with pytest.raises(ValueError, match="no tolerance for dtype 'int8'"):
        tolerance("int8", 1)


def test_each_tensor_gets_its_own_reduction_size():
    from harness.compare.tolerance import Tolerances

    tols = Tolerances("fp32", {"*": 16, "loss": 4096})
    assert tols.get("loss").rtol == tolerance("fp32", 4096).rtol
    assert tols.get("grad/w").rtol == tolerance("fp32", 16).rtol
    want = {"loss": reference(1)[0], "grad/w": reference(8)}
    got = {"loss": want["loss"] * (1 + 1e-5), "grad/w": want["grad/w"] * (1 + 1e-5)}
    # 1e-5 relative: within the loss's tolerance (n=4096), beyond that of a 16-term result
    assert [r.tensor for r in compare(got, want, tols).failing()] == ["grad/w"]
    assert "loss n=4096" in str(tols)


@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 4), (1, 7, 1, 2)])
def test_the_worst_index_is_torch_unravel_index(shape):
    n = math.prod(shape)
    for flat in range(n):
        want = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape)) if shape else ()
        assert unravel(flat, shape) == want


def test_one_process_rounding_widens_only_the_tensors_it_amplifies():
    from harness.compare.tolerance import ROUNDING, Tolerances

    want = {"param/a": reference(64), "param/b": reference(64, seed=1)}
    base = tolerance("fp32", 16)
    # one process in fp32 lies 3 tolerances from fp64 in a (AdamW amplified its rounding), not at all in b
    one = {"param/a": want["param/a"] + 3 * base.allowed(want["param/a"]), "param/b": want["param/b"].clone()}
    tols = Tolerances("fp32", 16, want, one)
    assert tols.get("param/a").growth == pytest.approx(3) and tols.get("param/b").growth == 0
    near = {n: t + 10 * base.allowed(t) for n, t in want.items()}  # a parallel run 10 tolerances off
    assert [r.tensor for r in compare(near, want, tols).failing()] == ["param/b"]
    # a bug (a tensor halved) stays red where rounding is amplified, by the margin left
    (row,) = compare({"param/a": want["param/a"] / 2}, {"param/a": want["param/a"]}, tols).failing()
    assert row.ratio > 1e3 / (1 + ROUNDING * 3)
    assert f"x (1 + {ROUNDING:g} x one process's fp32 err/tol there), the most 3 at param/a" in str(tols)


def test_a_tensor_zero_to_the_cells_precision_is_held_to_its_familys_scale():
    from harness.compare.tolerance import Tolerances

    want = {"grad/w": reference(32), "grad/v": reference(32, seed=1), "grad/gate": reference(8, seed=2) * 1e-21}
    got = dict(want, **{"grad/gate": reference(8, seed=3) * 1e-11})  # fp32 rounding of terms of scale ~1
    assert compare(got, want, tolerance("fp32", 16)).failing()[0].ratio > 1e15  # its own near-zero scale
    assert compare(got, want, Tolerances("fp32", 16, want)).ok
    # a tensor small but resolved keeps its own scale: halving it is red
    want["grad/v"] = want["grad/v"] * 1e-3
    (row,) = compare(dict(want, **{"grad/v": want["grad/v"] / 2}), want, Tolerances("fp32", 16, want)).failing()
    assert row.tensor == "grad/v" and row.ratio > 1e3
