"""Every cell starts clean, from a user's project of its own (its files written into tmp_path,
``python -m pytest`` in a subprocess from there, as in tests/test_users_cases.py).

Cells whose code does to its processes what trainers and kernel libraries do (grad mode left off, a
function of ``torch.nn.functional`` replaced, the default dtype changed in ``build``, deterministic
algorithms on, the process group destroyed, or destroyed and made again with ``env://``, sixty groups
made and left, transformers' modeling code patched in ``build``), each followed by clean cells of two
worlds (dp=2 and dp=4) and a clean transformers model. The clean cells must be green with the very
numbers they have in a run without the faulty cells, forward, reversed and under ``-n 2``; a faulty
cell is told what it changed, in one line, as a warning when it passed and in its failure when not.
"""
from __future__ import annotations

import textwrap

import pytest

from tests.project import Run, UserProject
from tests.test_torchrun import torchrun

pytestmark = pytest.mark.slow  # four pytest runs of a user's project, two of them under -n 2 and torchrun

CASES = textwrap.dedent('''\
    import dataclasses
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import transformers.models.llama.modeling_llama as modeling_llama
    from harness.examples import llama_hf
    from harness.model import ModelCase


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))


    def batch(step):
        g = torch.Generator().manual_seed(step)
        return {"input": torch.randn(8, 8, generator=g), "target": torch.randn(8, 4, generator=g)}


    def loss(output, batch):
        return F.mse_loss(output, batch["target"])


    def fsdp(model, meshes):
        for layer in (model.fc1, model.fc2):
            fully_shard(layer, mesh=meshes.dense["dp"])
        return fully_shard(model, mesh=meshes.dense["dp"])


    def grad_off(model, meshes):
        torch.set_grad_enabled(False)
        return fsdp(model, meshes)


    def gelu_patched(model, meshes):
        F.gelu = lambda x, approximate="none": torch.tanh(x)  # as a kernel library patches a model's ops
        return fsdp(model, meshes)


    def deterministic(model, meshes):
        torch.use_deterministic_algorithms(True)
        return fsdp(model, meshes)


    def destroyed(model, meshes):
        model = fsdp(model, meshes)
        dist.destroy_process_group()  # as a trainer does at exit
        return model


    def own_group(model, meshes):
        """A trainer that owns its process group, as under torchrun: torchtitan's init_distributed."""
        dist.destroy_process_group()
        dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR/PORT
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        for layer in (model.fc1, model.fc2):
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)


    def many_groups(model, meshes):
        ranks = list(range(dist.get_world_size()))
        for i in range(60):  # groups of their own (a timeout each), never destroyed
            dist.new_group(ranks, timeout=timedelta(seconds=600 + i))
        return fsdp(model, meshes)


    def float64_net():
        torch.set_default_dtype(torch.float64)
        return Net()


    def patched_llama():
        """A kernel library applied in build: transformers' RMSNorm replaced in its modeling module."""
        def forward(self, hidden_states):
            return self.weight * hidden_states * 1.5

        modeling_llama.LlamaRMSNorm.forward = forward
        return llama_hf.CASE.build()


    IMPLS = {"fsdp": fsdp, "gradoff": grad_off, "gelu": gelu_patched, "deterministic": deterministic,
             "destroyed": destroyed, "owngroup": own_group, "manygroups": many_groups}
    NET = ModelCase(build=Net, batch=batch, loss=loss, parallelize=IMPLS)
    WIDENET = ModelCase(build=float64_net, batch=batch, loss=loss, parallelize={"fsdp": fsdp})
    PATCHEDLLAMA = dataclasses.replace(llama_hf.CASE, build=patched_llama)
    ''')
CONFTEST = textwrap.dedent('''\
    from harness.model import register_model

    register_model("net", "mycases:NET")
    register_model("widenet", "mycases:WIDENET")
    register_model("llama", "harness.examples.llama_hf:CASE", preload=("harness.examples.hf",))
    register_model("patchedllama", "mycases:PATCHEDLLAMA", preload=("harness.examples.hf",))
    ''')
TEST = textwrap.dedent('''\
    import os

    import pytest

    from harness.model import model_cells

    FAULTS = [("net", "gradoff"), ("net", "gelu"), ("widenet", "fsdp"), ("net", "deterministic"),
              ("net", "destroyed"), ("net", "owngroup"), ("net", "manygroups"), ("patchedllama", "tp")]
    CELLS = []
    for seed, (model, impl) in enumerate(FAULTS):
        if not os.environ.get("CLEAN_ONLY"):
            CELLS += model_cells(model, impls=[impl], meshes=["dp=2"] if impl != "tp" else ["tp=2"], seed=seed)
        CELLS += model_cells("net", impls=["fsdp"], meshes=["dp=2", "dp=4"], seed=seed)
        CELLS += model_cells("llama", impls=["tp"], meshes=["tp=2"], seed=seed) if impl == "tp" else []
    if os.environ.get("REVERSED"):
        CELLS.reverse()
    if os.environ.get("TWO_RANKS"):  # under torchrun --nproc-per-node 2
        CELLS = [c for c in CELLS if c.world == 2 and "llama" not in c.component]


    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_cell(cfg, parity):
        parity(cfg)
    ''')
FAULTY = {"gradoff": "net-gradoff-dp2-fp32-plain-steps3-seed0",
          "gelu": "net-gelu-dp2-fp32-plain-steps3-seed1",
          "float64": "widenet-fsdp-dp2-fp32-plain-steps3-seed2",
          "deterministic": "net-deterministic-dp2-fp32-plain-steps3-seed3",
          "destroyed": "net-destroyed-dp2-fp32-plain-steps3-seed4",
          "owngroup": "net-owngroup-dp2-fp32-plain-steps3-seed5",
          "manygroups": "net-manygroups-dp2-fp32-plain-steps3-seed6",
          "patchedllama": "patchedllama-tp-tp2-fp32-plain-steps3-seed7"}
CLEAN = ([f"net-fsdp-dp{n}-fp32-plain-steps3-seed{s}" for s in range(8) for n in (2, 4)]
         + ["llama-tp-tp2-fp32-plain-steps3-seed7"])


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> UserProject:
    pytest.importorskip("transformers")
    return UserProject(tmp_path_factory.mktemp("clean") / "project",
                       {"mycases.py": CASES, "conftest.py": CONFTEST, "test_clean.py": TEST})


def run(project: UserProject, *args: str, **env: str):
    """The project's pytest run: its output, and its cells by id from its junit XML."""
    done = project.pytest("--pool-size", "4", "--case-deadline", "120", *args, env=project.env(**env), timeout=900)
    return done.stdout, done.cells


@pytest.fixture(scope="module")
def clean(project):
    return run(project, CLEAN_ONLY="1")


@pytest.fixture(scope="module", params=["forward", "reversed -n 2"])
def faulty(project, request):
    if request.param == "forward":
        return run(project)
    return run(project, "-n", "2", REVERSED="1")


def verdict(cell) -> tuple:
    return cell.outcome, cell.record.get("ratio"), cell.record.get("tensor")


def test_clean_cells_after_faulty_ones_are_green_with_the_numbers_of_a_run_without_them(clean, faulty):
    (_, alone), (out, mixed) = clean, faulty
    assert sorted(alone) == sorted(CLEAN), sorted(alone)
    for cell in CLEAN:
        assert alone[cell].outcome == "passed", alone[cell].text
        assert verdict(mixed[cell]) == verdict(alone[cell]), (cell, mixed[cell].text or mixed[cell].record, out[-4000:])
        # the clean run wrote the goldens: the same numbers, bit for bit, after the faulty cells
        assert mixed[cell].record["golden"] == "identical", (cell, mixed[cell].record)


@pytest.mark.parametrize("fault, line, red", [
    ("gradoff", "grad mode left off", True),
    ("gelu", "torch.nn.functional.gelu replaced", True),
    ("float64", "default dtype float64", False),
    ("deterministic", "deterministic algorithms left on", False),
    ("patchedllama", "transformers.models.llama.modeling_llama.LlamaRMSNorm.forward replaced", False),
])
def test_a_cell_that_changed_its_processes_is_told_what_in_one_line(faulty, fault, line, red):
    out, cells = faulty
    cell = cells[FAULTY[fault]]
    if red:  # the change is the cause: said in the failure
        assert cell.outcome == "failed" and line in cell.text, cell.text
    else:  # a warning on the green cell, and in its record
        assert cell.outcome == "passed", cell.text
        assert line in cell.record.get("left_changed", ""), cell.record
        assert line in out, out[-6000:]


def test_a_trainer_that_owns_its_process_group_is_green_and_so_is_the_cell_after_it(faulty):
    _, cells = faulty
    for fault in ("owngroup", "manygroups"):
        assert cells[FAULTY[fault]].outcome == "passed", cells[FAULTY[fault]].text
        assert "left_changed" not in cells[FAULTY[fault]].record, cells[FAULTY[fault]].record
    # a process group destroyed by the cell's code is its own cell's failure, said so, never the next cell's
    destroyed = cells[FAULTY["destroyed"]]
    assert destroyed.outcome == "failed" and "the cell's code destroyed its default process group" in destroyed.text, \
        destroyed.text
    assert all(cells[c].outcome == "passed" for c in CLEAN), {c: cells[c].outcome for c in CLEAN}


def test_under_torchrun_what_a_cell_changed_never_reaches_the_next_cell_of_its_process(project, clean, tmp_path):
    """One pytest process a rank: settings and code put back in place, the world made anew."""
    xml = tmp_path / "torchrun.xml"
    done = torchrun(["--standalone", "--nproc-per-node", "2"], ["--junitxml", str(xml), "--case-deadline", "120",
                                                               "--rank-logs", str(tmp_path / "logs")],
                    cwd=project.path, env=project.env(TWO_RANKS="1"), timeout=900)
    cells = Run(done, xml).cells  # asserts the XML is there, showing the run's output if not
    clean_cells = [c for c in CLEAN if "dp2" in c]
    assert set(clean_cells) <= set(cells), sorted(cells)
    for cell in clean_cells:
        assert verdict(cells[cell]) == verdict(clean[1][cell]), (cell, cells[cell].text, done.stdout[-4000:])
        assert cells[cell].record["golden"] == "identical", (cell, cells[cell].record)
    for fault, line in (("gradoff", "grad mode left off"), ("gelu", "torch.nn.functional.gelu replaced")):
        assert cells[FAULTY[fault]].outcome == "failed", cells[FAULTY[fault]].text
        assert f"{FAULTY[fault]} on rank 0: its code left its process changed: {line}" in done.stdout, done.stdout[-6000:]
    assert "deterministic algorithms left on" in cells[FAULTY["deterministic"]].record.get("left_changed", "")
    for fault in ("owngroup", "manygroups"):
        assert cells[FAULTY[fault]].outcome == "passed", cells[FAULTY[fault]].text
