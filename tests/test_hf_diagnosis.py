"""transformers' own TP plan on its Qwen3, in a user's project: the shipped plan passes; the same plan
with its q/k norm rules overridden to ``replicate`` (plain weights, no gradient all-reduce, though each
rank's norms see only its own heads) is named at the q/k norms as a missing all-reduce over tp, in
the same words by pytest, bisect and exploration."""
import pytest

from tests.conftest import flat
from tests.project import UserProject

CASE = '''
from transformers import Qwen3Config, Qwen3ForCausalLM

from harness.examples.llama_hf import batch, distribute, forward, loss
from harness.model import ModelCase


def build():
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=16, attn_implementation="eager",
                                        tie_word_embeddings=False))


def shipped(model, meshes):
    return distribute(model, meshes, tp_size=meshes.spec.tp)


def plain_norms(model, meshes):
    return distribute(model, meshes, tp_size=meshes.spec.tp,
                      tp_plan={"model.layers.*.self_attn.q_norm": "replicate",
                               "model.layers.*.self_attn.k_norm": "replicate"})


def tp_only(spec):
    others = [d for d in ("pp", "rep", "dp", "cp") if getattr(spec, d) > 1]
    return f"tensor parallel only, not {', '.join(others)}" if others else None


CASE = ModelCase(build=build, batch=batch, loss=loss, forward=forward,
                 parallelize={"shipped": shipped, "plainnorms": plain_norms},
                 supports={"shipped": tp_only, "plainnorms": tp_only})
'''
CONFTEST = 'from harness.model import register_model\n\nregister_model("qwen3", "qwen3case:CASE")\n'
TEST = '''import pytest

from harness.model import model_cells


@pytest.mark.parametrize("cfg", model_cells("qwen3", meshes=["tp=2"]), ids=str)
def test_qwen3(cfg, parity):
    parity(cfg)
'''
LINE = ("first diverging module: model.layers.1.self_attn.k_norm (parameter gradients, step 1), in the backward "
        "pass: the gradient it received still matches, its parameters' gradients (weight) are per-rank partial sums "
        "over tp (summed they match the reference): their all-reduce over tp is missing")
NEXT = ("model.layers.1.self_attn.q_norm.weight (module model.layers.1.self_attn.q_norm: partial sums over tp "
        "(summed they match the reference): its all-reduce over tp is missing, ranks 0,1)")


@pytest.mark.slow
def test_q_and_k_norms_left_plain_under_tp_are_named_alike_by_pytest_bisect_and_explore(tmp_path):
    project = UserProject(tmp_path / "project", {"qwen3case.py": CASE, "conftest.py": CONFTEST, "test_qwen3.py": TEST},
                          ini=False)

    tested = project.pytest("--case-deadline", "120")
    assert tested.returncode == 1 and "1 failed, 1 passed" in tested.stdout, tested.tail
    assert "FAILED test_qwen3.py::test_qwen3[qwen3-plainnorms-tp2-fp32-plain-steps3-seed0]" in tested.stdout
    assert LINE in flat(tested.stdout) and NEXT in flat(tested.stdout), tested.stdout[-4000:]

    bisected = project.harness("bisect", "run", "qwen3-plainnorms-tp2-fp32-plain-steps3-seed0", "--out",
                               str(project.path / "bisect-out"))
    assert bisected.returncode == 1 and "essential: tp=2" in bisected.stdout, bisected.stdout + bisected.stderr
    assert LINE in flat(bisected.stdout), bisected.stdout

    explored = project.harness("explore", "qwen3:plainnorms", "--seed", "0", "--max-examples", "20",
                               "--database", "none", "--pool-size", "2", "--out", str(project.path / "explore-out"))
    assert explored.returncode == 1 and "essential: tp=2" in explored.stdout, explored.stdout + explored.stderr
    assert LINE in flat(explored.stdout), explored.stdout
