"""FSDP2's mixed precision as bf16 users train with it, from a user's own project (a temporary
directory, pytest in a subprocess): the shipped ``titanmp`` case (``harness/examples/titan.py``,
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` read from ``harness.model.running()``,
``mixed_precision="params"``) is green on its bf16 cells against the fp64 reference, and the same
function with a bug a bf16 user could ship (gradients averaged over dp once more after FSDP2's own
average) is red, named with its group; and a ``parallelize`` that sets no policy on its mesh (TP alone,
under ``mixed_precision="params"``) trains in fp32: its bf16 cell fails saying so, never green at
fp32's numbers."""
import textwrap

from tests.conftest import flat

MODEL = textwrap.dedent('''\
    import dataclasses

    from harness.examples import titan


    def averaged_twice(model, meshes):
        made = titan.parallelize_mixed(model, meshes)
        for p in made.parameters():  # "average over dp", on top of FSDP2's own average
            p.register_post_accumulate_grad_hook(lambda p: p.grad.div_(meshes.spec.dp))
        return made


    BUG = dataclasses.replace(titan.MIXED, parallelize={"twice": averaged_twice})
    # TP with no precision policy: nothing computes in bf16
    NOPOLICY = dataclasses.replace(titan.CASE, parallelize={"tponly": titan.parallelize}, supports={},
                                   mixed_precision="params")
    ''')
CONFTEST = ('from harness.model import register_model\n\nregister_model("mpbug", "mymodel:BUG")\n'
            'register_model("nopolicy", "mymodel:NOPOLICY")\n')
TEST = textwrap.dedent('''\
    import pytest

    from harness.model import model_cells

    CELLS = (model_cells("titanmp", meshes=["dp=2", "rep=2,dp=2"], dtypes=["bf16"])
             + model_cells("mpbug", meshes=["dp=2"], dtypes=["bf16"])
             + model_cells("nopolicy", meshes=["tp=2"], dtypes=["bf16"]))


    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_cell(cfg, parity):
        parity(cfg)
    ''')


def test_fsdp2_mixed_precision_is_green_and_a_bf16_users_bug_is_red(user_project):
    user_project.write({"mymodel.py": MODEL, "conftest.py": CONFTEST, "test_cells.py": TEST})
    done = user_project.pytest("-rA", "--case-deadline", "120")
    out = done.stdout
    assert done.returncode == 1 and "2 failed, 2 passed" in out, done.tail
    assert "PASSED test_cells.py::test_cell[titanmp-fsdpmp-dp2-bf16" in out
    assert "PASSED test_cells.py::test_cell[titanmp-fsdpmp-rep2.dp2-bf16" in out
    bug = flat(out.split("test_cell[mpbug-twice-dp2-bf16")[1])
    # held to the bf16 policy grown by one process computing as FSDP2's policy does
    assert "(rtol=0.0625 (bf16, n=64); per tensor x (1 + 16 x one process's bf16 err/tol there)" in bug, bug[:3000]
    assert "the reference x 1/2 = 1/dp" in bug, bug[:4000]
    fp32 = flat(out.split("_ test_cell[nopolicy-tponly-tp2-bf16")[1].split("reproduce:")[0])
    assert fp32.startswith("-plain-steps3-seed0] _") and "bf16 ran in fp32: no module of parallelize 'tponly' computed " \
        "in bf16 on any rank" in fp32 and "MixedPrecisionPolicy(param_dtype=running().dtype)" in fp32, fp32[:3000]
    assert "ran fp32 1" in flat(out.split("parity summary")[1]), out[-3000:]  # failed as: not a mismatch, not a crash
