"""Models that draw random numbers in training mode, from a user's project of its own (its files written
into tmp_path, ``python -m pytest`` in a subprocess from there, as in tests/test_users_cases.py).

* transformers' tiny Llama whose config sets ``attention_dropout=0.1``, under its own TP plan at tp=2;
* a plain net with ``nn.Dropout(p=0.2)`` under FSDP2 at dp=2, right and with a planted bug;
* the same net with ``p=0``: judged as any model, its planted bug red.

A sharded run draws other numbers than the one-process reference, so a cell of a model that draws is
skipped with one line (the op, the modules, how to turn them off in ``build``), never reported as a
divergence; bisect and exploration say the same line.
"""
from __future__ import annotations

import re
import textwrap

import pytest

from tests.conftest import flat
from tests.project import Run, UserProject

CASES = textwrap.dedent('''\
    import dataclasses

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from harness.examples import llama_hf
    from harness.model import ModelCase


    def dropout_llama():
        """The tiny Llama with attention dropout on, as a training config sets it."""
        from transformers import LlamaForCausalLM

        config = llama_hf.config()
        config.attention_dropout = 0.1
        return LlamaForCausalLM(config)


    DROPLLAMA = dataclasses.replace(llama_hf.CASE, build=dropout_llama)


    class Net(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), nn.Dropout(p), nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(self.drop(torch.relu(self.fc1(x))))


    def batch(step):
        g = torch.Generator().manual_seed(step)
        return {"input": torch.randn(8, 8, generator=g), "target": torch.randn(8, 4, generator=g)}


    def loss(output, batch):
        return F.mse_loss(output, batch["target"])


    def fsdp(model, meshes):
        for layer in (model.fc1, model.fc2):
            fully_shard(layer, mesh=meshes.dense["dp"])
        return fully_shard(model, mesh=meshes.dense["dp"])


    def fsdp_loss_over_world(model, meshes):
        """The planted bug: the loss divided by the world size by hand (on the gradient entering fc2),
        while FSDP2 averages the gradients over the same ranks as well."""
        world = meshes.spec.world
        model.fc2.register_full_backward_pre_hook(lambda module, grad: (grad[0] / world,))
        return fsdp(model, meshes)


    IMPLS = {"fsdp": fsdp, "lossworld": fsdp_loss_over_world}
    DROPNET = ModelCase(build=lambda: Net(0.2), batch=batch, loss=loss, parallelize=IMPLS)
    CALMNET = ModelCase(build=lambda: Net(0.0), batch=batch, loss=loss, parallelize=IMPLS)
    ''')
CONFTEST = textwrap.dedent('''\
    from harness.model import register_model

    register_model("dropllama", "mycases:DROPLLAMA")
    register_model("dropnet", "mycases:DROPNET")
    register_model("calmnet", "mycases:CALMNET")
    ''')
TEST = textwrap.dedent('''\
    import pytest

    from harness.model import model_cells

    CELLS = (model_cells("dropllama", impls=["tp"], meshes=["tp=2"])
             + model_cells("dropnet", meshes=["dp=2"])
             + model_cells("calmnet", meshes=["dp=2"]))


    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_random(cfg, parity):
        parity(cfg)
    ''')
IDS = {"llama": "dropllama-tp-tp2-fp32-plain-steps3-seed0",
       "dropnet": "dropnet-fsdp-dp2-fp32-plain-steps3-seed0",
       "dropnet bug": "dropnet-lossworld-dp2-fp32-plain-steps3-seed0",
       "calmnet": "calmnet-fsdp-dp2-fp32-plain-steps3-seed0",
       "calmnet bug": "calmnet-lossworld-dp2-fp32-plain-steps3-seed0"}
DRAWS = "the model draws random numbers in training mode ("


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> UserProject:
    pytest.importorskip("transformers")
    return UserProject(tmp_path_factory.mktemp("random") / "project",
                       {"mycases.py": CASES, "conftest.py": CONFTEST, "test_random.py": TEST})


@pytest.fixture(scope="module")
def run(project) -> tuple[Run, dict]:
    """The project's pytest run, and its cells by id from its junit XML."""
    done = project.pytest("-p", "no:randomly", "--pool-size", "2", "--case-deadline", "120")
    return done, done.cells


def cell(run, key: str):
    done, cells = run
    assert IDS[key] in cells, done.tail
    return cells[IDS[key]]


def test_a_transformers_config_with_attention_dropout_is_skipped_naming_the_modules_and_the_attribute(run):
    llama = cell(run, "llama")
    assert llama.outcome == "skipped" and llama.record["kind"] == "not judged", run[0].tail
    assert (llama.skip_reason.startswith(f"{DRAWS}aten.bernoulli_(p=0.9) in model.layers.0.self_attn, "
                                         "model.layers.1.self_attn)")
            and llama.skip_reason.endswith("turn them off in build: set attention_dropout=0.0 in the LlamaConfig "
                                           "(it has attention_dropout=0.1)")), llama.skip_reason
    # in the run's closing summary too, where skips are grouped by reason
    assert f"skipped dropllama x1: {llama.skip_reason}" in run[0].stdout, run[0].tail


def test_a_dropout_module_is_skipped_naming_it_and_p0_and_a_bug_under_it_is_not_a_divergence(run):
    right, bug = cell(run, "dropnet"), cell(run, "dropnet bug")
    assert right.outcome == bug.outcome == "skipped" and right.skip_reason == bug.skip_reason, run[0].tail
    assert right.skip_reason == (f"{DRAWS}aten.bernoulli_(p=0.8) in drop), which a parallel run cannot draw as one "
                                 "process does, so no cell of it is judged; turn them off in build: give drop p=0 "
                                 "(drop is Dropout(p=0.2, inplace=False)), or call .eval() on it"), right.skip_reason


def test_the_same_net_with_p0_is_judged_and_its_planted_bug_stays_red(run):
    """Only ops that draw count: the net's Dropout(p=0) draws nothing, so it is judged beside the p=0.2
    net that is not."""
    assert cell(run, "dropnet").outcome == "skipped"
    assert cell(run, "calmnet").outcome == "passed", run[0].tail
    bug = cell(run, "calmnet bug")
    assert bug.outcome == "failed" and bug.record["kind"] == "mismatch", run[0].tail
    assert (f"{IDS['calmnet bug']} diverges from the reference" in bug.text
            and re.search(r"grad/fc2\.weight +mismatch .* 0\.5 ", bug.text) and "random numbers" not in bug.text), bug.text


def test_bisect_and_explore_say_the_same_line(run, project):
    reason = cell(run, "dropnet").skip_reason
    check = project.harness("bisect", "check", IDS["dropnet"], "--pool-size", "2")
    assert check.returncode == 125 and flat(check.stdout) == flat(f"{IDS['dropnet']}: skip ({reason})"), check.tail
    explore = project.harness("explore", "dropnet:fsdp", "--pool-size", "2", "--max-examples", "5",
                              "--out", str(project.path.parent / "explored"))
    assert f"dropnet:fsdp: not explored: {reason}\n" in explore.stdout + explore.stderr, explore.tail
