"""``python -m harness.zoo transformers`` as a user runs it, from a directory of their own: a right
plan passes at every mesh, and the plan entries its tiny build leaves unexercised are listed; a plan
with a known upstream bug (apertus and inkling2_text, whose router forces fp32, in transformers
5.23, the pinned release) is ``known`` and its fix passes, an architecture the zoo does not build (a
multimodal composite whose language model it runs on its own) is a skip that says why (never a red),
and a bad option is one line with the fix."""
import json
import os
import re

import pytest

from tests.checkout import copy_checkout
from tests.project import ROOT, UserProject


@pytest.fixture
def project(tmp_path):
    """A directory of the user's own, without a pytest.ini."""
    return UserProject(tmp_path / "project", ini=False)


def zoo(project, *args):
    return project.harness("zoo", "transformers", *args, timeout=900)


@pytest.mark.slow  # runs a zoo: a pytest process of its own and its pool
def test_the_zoo_checks_each_plan_and_skips_what_it_cannot_build(project):
    pytest.importorskip("transformers", reason="pip install -e '.[thirdparty]'")
    done = zoo(project, "--only", "llama,qwen3_moe,llama4,apertus,inkling2_text,gemma,step3p5",
               "--plans", "tp,ep", "-n", "0", "--out", "out")
    assert done.returncode == 0, done.tail
    cells = {r["cell"]: r for r in json.loads((project.path / "out" / "zoo.json").read_text())["cells"]}
    verdicts = {cell: r["verdict"] for cell, r in cells.items()}
    assert verdicts == {
        "hfllama-tp-tp2-fp32-plain-steps3-seed0": "pass", "hfllama-tp-tp4-fp32-plain-steps3-seed0": "pass",
        "hfqwen3moe-tp-tp2-fp32-plain-steps3-seed0": "pass", "hfqwen3moe-tp-tp4-fp32-plain-steps3-seed0": "pass",
        "hfqwen3moe-ep-dp2-fp32-ep_2-steps3-seed0": "pass",
        # llama4 ships a TP plan, no EP plan: no ep cell
        "hfllama4-tp-tp2-fp32-plain-steps3-seed0": "skip", "hfllama4-tp-tp4-fp32-plain-steps3-seed0": "skip",
        # transformers 5.23's apertus plan leaves the xIELU activation's parameters' gradients partial:
        # known there, and its one-rule override passes
        "hfapertus-tp-tp2-fp32-plain-steps3-seed0": "known", "hfapertus-tp-tp4-fp32-plain-steps3-seed0": "known",
        "hfapertus-tpfixed-tp2-fp32-plain-steps3-seed0": "pass",
        # its router runs in fp32 ("as in the original"): the reference runs that op from its fp32 kernel,
        # and the plan's 'colwise' fused gate_up_proj is known, its 'packed_colwise' fix passes
        "hfinkling2text-tp-tp2-fp32-plain-steps3-seed0": "known",
        "hfinkling2text-tp-tp4-fp32-plain-steps3-seed0": "known",
        "hfinkling2text-tpfixed-tp2-fp32-plain-steps3-seed0": "pass",
        "hfinkling2text-ep-dp2-fp32-ep_2-steps3-seed0": "pass",
        # its embeddings tied, as shipped: sharded and tied again in from_pretrained's order
        "hfgemma-tp-tp2-fp32-plain-steps3-seed0": "pass", "hfgemma-tp-tp4-fp32-plain-steps3-seed0": "pass",
        # MoE from its fourth layer as shipped: the shrink keeps one layer of each MLP kind, dense then
        # sparse, so the ep cell dispatches tokens to experts (the planted test below: without, a skip)
        "hfstep3p5-tp-tp2-fp32-plain-steps3-seed0": "pass", "hfstep3p5-tp-tp4-fp32-plain-steps3-seed0": "pass",
        "hfstep3p5-ep-dp2-fp32-ep_2-steps3-seed0": "pass",
    }, verdicts
    assert cells["hfllama4-tp-tp2-fp32-plain-steps3-seed0"]["why"] == (
        "not built tiny: a multimodal composite whose language model is llama4_text, which the zoo runs as an "
        "architecture of its own (the composite's sizes live in its parts' configs)"), cells
    table = (project.path / "out" / "zoo.md").read_text()
    assert "13 pass, 0 red, 0 crash, 2 skip, 4 known, 0 fixed" in table, table
    # what a maintainer acts on: the command per cell that did not pass, what the report was made with,
    # the page by model type with a legend, and a plan not shipped told from a cell not run
    assert cells["hfapertus-tp-tp4-fp32-plain-steps3-seed0"]["reproduce"] == \
        "python -m harness.zoo transformers --only apertus --plans tp", cells
    assert "reproduce" not in cells["hfllama-tp-tp2-fp32-plain-steps3-seed0"]
    made = json.loads((project.path / "out" / "zoo.json").read_text())
    # Qwen3-MoE's plan shards the dense MLP that layers outside decoder_sparse_step have; the tiny
    # config's layers are all MoE, so no cell exercises those entries, and the report says so
    dense = ["model.layers.*.mlp.gate_proj", "model.layers.*.mlp.up_proj", "model.layers.*.mlp.down_proj"]
    assert made["unexercised"] == {"qwen3_moe": {"tp": dense}}, made["unexercised"]
    assert "## Plan entries no cell exercises" in table and "| qwen3_moe | tp | `model.layers.*.mlp.gate_proj`" in table
    assert made["transformers"] == "5.23.0" and made["python"].startswith("3.") and made["minutes"] > 0, made
    assert made["harness"].startswith("paritytest ") and made["date"].endswith(" UTC"), made
    page = (project.path / "out" / "zoo.html").read_text()
    assert "<tr><th>inkling2_text</th>" in page and "<tr><th>llama</th>" in page, page[:2000]
    assert "a declared upstream bug (or a tolerance limit these kernels cross), failing as declared" \
        in page  # the legend
    llama = page.split("<tr><th>llama</th>")[1].split("</tr>")[0]
    # no EP plan: its ep square is not shipped; no known bug, so no tpfixed cell: blank
    assert llama.count("not shipped") == 1 and llama.count("<td></td>") == 1, llama


@pytest.mark.slow  # runs a zoo: a pytest process of its own and its pool
def test_a_known_bug_whose_cell_fails_another_way_a_lost_tie_and_a_wrong_load_are_red_saying_so(project, tmp_path):
    """A throwaway copy of the tree whose apertus entry declares another first line than the one its
    cells fail with: they are red, naming where they start and the bug declared, not known. In the
    same copy, the tied embeddings of a built model left untied after sharding (gemma ships them
    tied): red where the embedding's gradient misses the head's. hrm_text's loading bug no longer
    declared: its from_pretrained cell is red by the load check, naming which rows landed where. And
    step3p5 shrunk to its first two layers' MLP kinds, both dense (the shrink keeps one of each): its ep
    cell would run no expert, so it skips saying so, and the report lists the expert entries as
    unexercised. And ernie4_5_vl_moe_text fed token ids alone (its INPUTS entry gone): no token reaches
    its vision experts, whose cells pass, and the report lists their entries as given no gradient."""
    pytest.importorskip("transformers", reason="pip install -e '.[thirdparty]'")
    tree = copy_checkout(tmp_path / "tree")
    source = tree / "harness" / "zoo" / "transformers.py"
    declared = r'r"^first diverging module: model\.layers\.\d+\.mlp\.act_fn \(parameter gradients, step 1\)"'
    assert declared in source.read_text()
    source.write_text(source.read_text().replace(declared, r'r"^first diverging module: .*down_proj"'))
    distribute = tree / "harness" / "examples" / "llama_hf.py"
    tie = "        model.tie_weights(recompute_mapping=False)\n"
    assert tie in distribute.read_text()
    distribute.write_text(distribute.read_text().replace(tie, "        pass  # planted: the tie is lost\n"))
    entry = 'KnownBug("hrm_text", ("tpauto",)'
    assert entry in source.read_text()
    source.write_text(source.read_text().replace(entry, 'KnownBug("undeclared", ("tpauto",)'))
    sparse = '        sizes["mlp_layer_types"] = (kinds * count)[:count]\n'
    assert sparse in source.read_text()
    source.write_text(source.read_text().replace(sparse, "        pass  # planted: the first layers' kinds, all dense\n"))
    vision = '    "ernie4_5_vl_moe_text": lambda ids:'
    assert vision in source.read_text()
    source.write_text(source.read_text().replace(vision, '    "planted: token ids alone": lambda ids:'))
    env = project.env(PYTHONPATH=os.pathsep.join([str(tree), str(project.path)]))
    done = project.harness("zoo", "transformers", "--only", "apertus,gemma,hrm_text,step3p5,ernie4_5_vl_moe_text",
                           "--plans", "tp,tpauto,ep", "-n", "2", "--out", "out", env=env, timeout=900)
    assert done.returncode == 0, done.tail
    cells = {r["cell"]: r for r in json.loads((project.path / "out" / "zoo.json").read_text())["cells"]}
    assert {c: r["verdict"] for c, r in cells.items()} == {
        "hfapertus-tp-tp2-fp32-plain-steps3-seed0": "red", "hfapertus-tp-tp4-fp32-plain-steps3-seed0": "red",
        "hfapertus-tpauto-tp2-fp32-plain-steps3-seed0": "red", "hfapertus-tpfixed-tp2-fp32-plain-steps3-seed0": "pass",
        "hfgemma-tp-tp2-fp32-plain-steps3-seed0": "red", "hfgemma-tp-tp4-fp32-plain-steps3-seed0": "red",
        "hfgemma-tpauto-tp2-fp32-plain-steps3-seed0": "pass",  # from_pretrained ties it itself
        "hfhrmtext-tp-tp2-fp32-plain-steps3-seed0": "pass", "hfhrmtext-tp-tp4-fp32-plain-steps3-seed0": "pass",
        "hfhrmtext-tpauto-tp2-fp32-plain-steps3-seed0": "red",
        # two dense layers: the TP plan's dense entries are exercised, the experts' are not
        "hfstep3p5-tp-tp2-fp32-plain-steps3-seed0": "pass", "hfstep3p5-tp-tp4-fp32-plain-steps3-seed0": "pass",
        "hfstep3p5-tpauto-tp2-fp32-plain-steps3-seed0": "pass", "hfstep3p5-ep-dp2-fp32-ep_2-steps3-seed0": "skip",
        # fed token ids alone, every token is text: its vision experts get none, and pass unseen
        "hfernie45vlmoetext-tp-tp2-fp32-plain-steps3-seed0": "pass",
        "hfernie45vlmoetext-tp-tp4-fp32-plain-steps3-seed0": "pass",
        "hfernie45vlmoetext-tpauto-tp2-fp32-plain-steps3-seed0": "pass",
        "hfernie45vlmoetext-ep-dp2-fp32-ep_2-steps3-seed0": "pass"}, cells
    assert cells["hfstep3p5-ep-dp2-fp32-ep_2-steps3-seed0"]["why"].startswith(
        "the tiny build has no expert its EP plan names (layers.*.mlp.experts): a cell would run the dense model"), cells
    experts = ["layers.*.mlp.experts.gate_up_proj", "layers.*.mlp.experts.down_proj", "layers.*.mlp.experts"]
    made = json.loads((project.path / "out" / "zoo.json").read_text())
    # ... which the report says: their entries name parameters two steps on one process leave without a gradient
    vision = [f"layers.*.mlp.vision_moe.experts{part} (no gradient)" for part in (".gate_up_proj", ".down_proj", "")]
    assert made["unexercised"] == {"step3p5": {"tp": experts, "ep": experts},
                                   "ernie4_5_vl_moe_text": {"tp": vision, "ep": vision}}, made["unexercised"]
    table = (project.path / "out" / "zoo.md").read_text()
    assert "## Plan entries no cell exercises" in table and "| step3p5 | ep | `layers.*.mlp.experts.gate_up_proj`" in table
    why = cells["hfapertus-tp-tp2-fp32-plain-steps3-seed0"]["why"]
    assert why.startswith("first diverging module: model.layers.1.mlp.act_fn (parameter gradients, step 1)"), why
    assert "(not the declared bug, transformers 5.23.0: the MLP's xIELU activation" in why, why
    lost = cells["hfgemma-tp-tp2-fp32-plain-steps3-seed0"]["why"]
    assert lost.startswith("first diverging module: model.embed_tokens (parameter gradients, step 1)"), lost
    load = cells["hfhrmtext-tpauto-tp2-fp32-plain-steps3-seed0"]["why"]
    assert load.startswith("LoadMismatch: from_pretrained loaded 24 parameter(s) other than save_pretrained was "
                           "given (each gathered with full_tensor()): model.L_module.layers.0.self_attn.q_proj.weight: "
                           "rows 0-15 hold model.L_module.layers.0.self_attn.gate_proj.weight's rows 16-31, "), load


FAMILIES = '''
"""Two tiny model families of the user's own, registered with transformers' auto classes: checkpoints
that hold each layer's o_proj and down_proj fused, one above the other. fusedlm's converter splits
them back; swappedlm's (planted) loads each half into the other's place."""
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import Chunk, WeightConverter


class SwappedChunk(Chunk):
    """Chunk, each half loaded into the other target's place; saved by plain concatenation."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        first, second = super().convert(input_dict, source_patterns, target_patterns, **kwargs).items()
        return {first[0]: second[1], second[0]: first[1]}


for name, split in (("fusedlm", Chunk), ("swappedlm", SwappedChunk)):
    config = type(f"{name}Config", (LlamaConfig,), {"model_type": name})
    model = type(f"{name}ForCausalLM", (LlamaForCausalLM,), {"config_class": config})
    AutoConfig.register(name, config)
    AutoModelForCausalLM.register(config, model)
    register_checkpoint_conversion_mapping(name, [WeightConverter(
        source_patterns="outs.weight", target_patterns=["self_attn.o_proj.weight", "mlp.down_proj.weight"],
        operations=[split(dim=0)])])
'''


@pytest.mark.slow  # runs a zoo: a pytest process of its own and its pool
def test_a_family_of_the_users_own_runs_by_import_and_the_load_check_names_its_converters_swap(project):
    """docs/zoo.md's --import: two model types of the user's own, registered from a module in their
    directory, run as transformers' own do. Their checkpoints fuse o_proj and down_proj (a rowwise
    pair, which from_pretrained shards before it splits them, and may); one family's converter, planted,
    loads each half into the other's place: its from_pretrained cell is red by the load check, before
    any step, naming which rows landed where; the right family passes, and so do both built ones."""
    pytest.importorskip("transformers", reason="pip install -e '.[thirdparty]'")
    project.write({"myfamilies.py": FAMILIES})
    done = zoo(project, "--import", "myfamilies", "--only", "fusedlm,swappedlm", "--plans", "tp,tpauto", "-n", "2",
               "--out", "out")
    assert done.returncode == 0, done.tail
    cells = {r["cell"]: r for r in json.loads((project.path / "out" / "zoo.json").read_text())["cells"]}
    assert {c: r["verdict"] for c, r in cells.items()} == {
        "hffusedlm-tp-tp2-fp32-plain-steps3-seed0": "pass", "hffusedlm-tp-tp4-fp32-plain-steps3-seed0": "pass",
        "hffusedlm-tpauto-tp2-fp32-plain-steps3-seed0": "pass",
        "hfswappedlm-tp-tp2-fp32-plain-steps3-seed0": "pass", "hfswappedlm-tp-tp4-fp32-plain-steps3-seed0": "pass",
        "hfswappedlm-tpauto-tp2-fp32-plain-steps3-seed0": "red"}, cells
    red = cells["hfswappedlm-tpauto-tp2-fp32-plain-steps3-seed0"]
    assert red["why"].startswith("LoadMismatch: from_pretrained loaded 4 parameter(s) other than save_pretrained "
                                 "was given"), red
    assert ("model.layers.0.self_attn.o_proj.weight: rows 0-31 hold model.layers.0.mlp.down_proj.weight's rows "
            "0-31") in red["why"], red
    assert red["reproduce"].startswith("python -m harness.zoo transformers --only swappedlm --plans tpauto "
                                       "--import myfamilies"), red
    # a module that does not import: one line naming it and the fix, before anything runs
    bad = zoo(project, "--import", "nosuchfamilies", "--only", "fusedlm")
    assert bad.returncode == 2 and "--import nosuchfamilies: ModuleNotFoundError" in bad.stderr, bad.tail
    assert "Traceback" not in bad.stderr, bad.stderr


def test_an_unknown_plan_or_model_type_is_one_line_with_the_choices(project):
    done = zoo(project, "--plans", "tp,pp")
    assert done.returncode == 2 and "--plans: unknown pp; give some of tp, tpauto, ep, tpep" in done.stderr, done.stderr
    # a model type misspelt (its cell's name, which drops the underscores): one line that says the near one
    done = project.harness("zoo", "transformers", "--only", "qwen3moe,llama", timeout=300)
    assert done.returncode == 2 and re.search(r"error: --only: unknown qwen3moe \(did you mean qwen3_moe\?\); "
                                              r"\d{3} model types ship a TP or EP plan here$", done.stderr), done.stderr


def test_the_nightly_zoo_workflow_lints_and_runs_the_command_tested_here():
    from tests.test_workflow import WORKFLOWS, lint, load

    workflow = WORKFLOWS / "zoo.yml"
    done = lint(workflow)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = {s["name"]: s for s in load(workflow)["jobs"]["zoo"]["steps"] if "name" in s}
    assert steps["Zoo"]["run"].startswith(".venv/bin/python -m harness.zoo transformers ")
    assert "workflow_dispatch" in load(workflow)[True] and "schedule" in load(workflow)[True]  # YAML reads `on` as True


FAMILY = '''
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from harness.model import ModelCase


class MLP(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, width), torch.nn.Linear(width, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return {"input": torch.randn(4, 8, generator=g), "target": torch.randn(4, 8, generator=g)}


def loss(out, batch):
    return ((out - batch["target"]) ** 2).mean()


def tp(model, meshes):
    return parallelize_module(model, meshes.mesh("tp"), {"up": ColwiseParallel(), "down": RowwiseParallel()})


def case(size):
    return ModelCase(build=lambda: MLP({"small": 8, "wide": 32}[size]), batch=batch, loss=loss,
                     parallelize={"tp": tp})
'''
FAMILY_CONFTEST = '''
from harness.model import register_model

for size in ("small", "wide"):
    register_model(f"mlp{size}", f"family:case({size})")
'''
FAMILY_TEST = '''
import pytest
from harness.model import model_cells

CELLS = model_cells("mlpsmall", meshes=["tp=2"]) + model_cells("mlpwide", meshes=["tp=2"])


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_family(cfg, parity):
    parity(cfg)
'''


def test_a_users_family_registers_its_cases_by_one_factory(user_project):
    """docs/models.md's family: two cases from one function, imported by the ranks by path."""
    user_project.write({"family.py": FAMILY, "conftest.py": FAMILY_CONFTEST, "test_family.py": FAMILY_TEST})
    done = user_project.pytest("-rA")
    assert done.returncode == 0 and "2 passed" in done.stdout, done.tail
    assert "test_family[mlpsmall-tp-tp2-" in done.stdout and "test_family[mlpwide-tp-tp2-" in done.stdout


@pytest.mark.parametrize("model_type, says", [
    ("apertus", "model.layers.0.mlp.act_fn.alpha_p: gradient differs; summed over the ranks it matches: its all-reduce "
                "is missing"),
    ("llama", "llama: every parameter's gradient matches one process")])
def test_the_maintainers_reproduction_in_the_docs_shows_the_bug_and_passes_a_right_plan(project, model_type, says):
    """docs/zoo_repro.py: torch and transformers only, under torchrun, as docs/zoo.md gives it."""
    pytest.importorskip("transformers", reason="pip install -e '.[thirdparty]'")
    done = project.run("python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       str(ROOT / "docs" / "zoo_repro.py"), model_type)
    assert done.returncode == 0 and says in done.stdout, done.tail


def test_diff_names_each_cell_whose_verdict_or_reason_moved(project):
    """Two releases' zoo.json: a verdict that moved, a skip whose reason changed and a known cell that
    fails otherwise are each a line; a cell that stayed as it was is not, nor is a declared bug that
    still holds (its reason names the new release, not one it was seen on: one line for them all)."""
    def write(name, library_version, cells):
        path = project.path / name
        path.write_text(json.dumps({"library": "transformers", "transformers": library_version,
                                    "cells": [dict(cell=c, verdict=v, why=w) for c, v, w in cells]}))
        return path

    old = write("old.json", "5.23.0", [("hfa-tp-tp2", "pass", ""), ("hfb-tp-tp2", "skip", "not built tiny: x"),
                                       ("hfc-tp-tp2", "known", "bug"), ("hfd-tp-tp2", "skip", "no token ids"),
                                       ("hfe-tp-tp2", "known", "transformers 5.23.0: mask: 4 heads"),
                                       ("hfe-tp-tp4", "known", "transformers 5.23.0: mask: 4 heads"),
                                       ("hff-tp-tp2", "known", "transformers 5.23.0: norms left plain")])
    later = "transformers 5.24.0, a release it has not been seen on yet (seen on 5.23.0): "
    new = write("new.json", "5.24.0", [("hfa-tp-tp2", "pass", ""), ("hfb-tp-tp2", "skip", "not built tiny: y"),
                                       ("hfc-tp-tp2", "fixed", "declared known (bug) but matches now"),
                                       ("hfd-tp-tp2", "skip", "no token ids"),
                                       ("hfe-tp-tp2", "known", later + "mask: 4 heads"),
                                       ("hfe-tp-tp4", "known", later + "mask: 4 heads"),
                                       ("hff-tp-tp2", "known", later + "norms left plain, and more")])
    done = project.harness("zoo", "diff", str(old), str(new), timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "transformers 5.23.0 -> 5.24.0: 3 cells changed",
        "hfb-tp-tp2: skip, another reason: not built tiny: x -> not built tiny: y",
        "hfc-tp-tp2: known -> fixed (declared known (bug) but matches now)",
        f"hff-tp-tp2: known, another reason: transformers 5.23.0: norms left plain -> {later}norms left plain, and more",
        "still known, the same declared bug: 2 cells of 1 model(s) (hfe)"], done.stdout
