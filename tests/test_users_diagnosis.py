"""Where a divergence starts, told from a user's own project (written to a temporary directory, run
with pytest in a subprocess): a bug whose forward matches everywhere is named in the backward pass at
its module, not at a module whose output expert parallelism makes per rank by design; a bug in one
stage of a 1F1B pipeline is named at its module, its microbatches joined as the whole batch; and one
block's ``wo`` whose rowwise output is left ``Partial()`` is named at ``wo`` as partial sums over tp,
while the same plan without the bug passes; a row-parallel layer whose caller reduces its partial
sums is not named for them, and a bug in its own gradient is, in the backward pass; a hook of the
user's after ``wo``'s rowwise style, scaling what it returns on every rank alike, is named at ``wo``
itself: a module with hooks of its own is judged by its numbers. A diagnosis whose rerun raises or
dies says so, and what it could not do.

The bugs are users' parallelize functions registered by path from the project's conftest:
``ep_without_expert_sum`` (tests/model_bugs_moe.py), ``stage_reinitialised``, ``wo_partial_in_one_block``,
``wo_scaled_in_one_block`` and ``fails_when_recorded`` (tests/model_bugs.py), ``caller_reduces_fc2_gradient_twice``
(tests/model_handtp.py)."""
import re
import textwrap

import pytest

from tests.conftest import flat, line_of

CONFTEST = textwrap.dedent('''\
    from harness.model import register_model

    register_model("moebug", "tests.model_bugs_moe:NOEXPSUM")
    register_model("pipebug", "tests.model_bugs:BUGS")
    register_model("callerreduces", "tests.model_handtp:CALLER_REDUCES")
    ''')
TEST = textwrap.dedent('''\
    import pytest

    from harness.model import model_cells

    CELLS = (model_cells("moebug", meshes=["dp=4"], switches={"ep": ["2"]})  # efsdp = 2 copies
             + model_cells("pipebug", impls=["stagereinit"], meshes=["pp=2"])
             + model_cells("pipebug", impls=["wopartial", "wohook", "tpnosp", "rerunraises", "rerundies"],
                           meshes=["tp=2"])
             + model_cells("callerreduces", meshes=["tp=2"]))


    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_bug(cfg, parity):
        parity(cfg)
    ''')


def test_each_bug_is_named_where_it_starts(user_project):
    pytest.importorskip("transformers", reason="pip install -e '.[thirdparty]' (transformers' Qwen3-MoE)")
    user_project.write({"conftest.py": CONFTEST, "test_bugs.py": TEST})
    done = user_project.pytest("--case-deadline", "120")
    assert done.returncode == 1 and "7 failed, 2 passed" in done.stdout, done.tail
    assert "test_bug[callerreduces-callerreduces-" not in done.summary  # its caller reduces it: right, green
    # -q (UserProject.pytest's) leaves out the line each failing cell says as it fails, as pytest's own
    assert not re.search(r"^FAILED \S+: ", done.stdout.split("= FAILURES =")[0], re.M), done.stdout[:3000]
    moe, pipe, partial, hooked, reduced = (done.stdout.split(f"test_bug[{cell}")[1] for cell in
                                           ("moebug-noexpsum", "pipebug-stagereinit", "pipebug-wopartial",
                                            "pipebug-wohook", "callerreduces-fc2gradtwice"))
    # a row-parallel fc2 whose partial sums the MLP calling it reduces (Megatron's split, the reduction
    # in its caller): not where it starts, since what uses them matches; its doubled gradient is
    assert ("first diverging module: mlp.fc2 (parameter gradients, step 1), in the backward pass: every judged "
            "forward output matches (mlp.fc2 returns per-rank partial sums over tp, which mlp reduces; not judged), "
            "the gradient it received still matches, its parameters' gradients (weight) do not") in flat(reduced), \
        reduced[:4000]
    # a rerun that raises (every rank) or dies (one rank): the diagnosis says what it could not do, and why
    raised, died = (flat(done.stdout.split(f"test_bug[pipebug-{impl}")[1]) for impl in ("rerunraises", "rerundies"))
    assert ("(the rerun that records each module's tensors raised on ranks [0, 1]: ModuleError: in module output: "
            "RuntimeError: the output head's second call while recording") in raised and "were not checked for partial sums)" in raised, raised[:4000]
    assert "first diverging parameter gradients (step 1, in backward order): layers.1.ffn_norm.weight" in raised
    assert ("(where it starts is not known: the rerun that records each module's tensors failed: ") in died \
        and "(recording events) failed after" in died and "died on ranks [1])" in died, died[:4000]
    moe_text, pipe_text, partial_text = flat(moe), flat(pipe), flat(partial)
    # a block's wo left as partial sums over tp: named at wo, not at the attention that uses it
    assert ("first diverging module: layers.1.attention.wo (output, step 1, microbatch 0): its inputs still match "
            "the reference, it returns per-rank partial sums over tp: summed they match the reference; "
            "layers.1.attention uses them unreduced") in partial_text, partial[:4000]
    # the same wo scaled by a hook after its style's: judged like any module, not named at its parent
    assert ("first diverging module: layers.1.attention.wo (output, step 1, microbatch 0): its inputs still match "
            "the reference, its outputs do not") in flat(hooked), hooked[:4000]
    assert ("first diverging module: model.layers.1.mlp.experts (parameter gradients, step 1), in the backward "
            "pass: every judged forward output matches") in moe_text, moe[:4000]
    assert ".mlp.gate" not in line_of(moe, "first diverging module:")
    assert ("first diverging module: layers.1.attention.wq (output, step 1, microbatch 0): its inputs still match "
            "the reference, its outputs do not") in pipe_text, pipe[:4000]
    # one screen: the table starts at the first diverging module's tensors and shows at most 12 rows
    lines = pipe.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("tensor "))
    assert "layers.1.attention.wq.weight" in lines[header + 1], lines[header:header + 3]
    assert lines[header + 13].startswith("... ") and "more rows" in lines[header + 13], lines[header + 12:header + 14]
    # and 120 columns: every line of the failure but the command that reruns it
    assert all(len(line) <= 120 for line in lines[:lines.index(next(li for li in lines if li.startswith("reproduce:")))])
