"""Where a divergence starts, told from a user's own project (written to a temporary directory, run
with pytest in a subprocess): a bug whose forward matches everywhere is named in the backward pass at
its module, not at a module whose output expert parallelism makes per rank by design; and a bug in one
stage of a 1F1B pipeline is named at its module, its microbatches joined as the whole batch."""
import subprocess
import sys
import textwrap

import pytest

from tests.test_torchrun import env_for, private_tmpdir  # noqa: F401  (autouse fixture)

BUGS = textwrap.dedent('''\
    import dataclasses

    import torch
    from torch.distributed.fsdp import fully_shard

    from harness.examples import qwen3moe_hf, titan


    def ep_without_expert_sum(model, meshes):
        """transformers' EP plan by hand, FSDP2 over dp for all but the experts, which are left out of
        it and so never summed over their copies: the forward matches, the experts' gradients do not."""
        from harness.examples.hf import DistributedConfig
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        spec = meshes.spec
        _, ep_plan, _ = model._resolve_parallel_plans(DistributedConfig(ep_size=spec.ep, fsdp_size=spec.dp))
        apply_expert_parallelism(model, meshes.sparse["ep"], meshes.dense["tp"], ep_plan, ep_implementation="all_to_all")
        experts = {p for name, p in model.named_parameters() if ".mlp.experts." in name}
        for layer in model.model.layers:
            fully_shard(layer, mesh=meshes.mesh("fsdp"), ignored_params=experts)
        return fully_shard(model, mesh=meshes.mesh("fsdp"), ignored_params=experts)


    def stage_reinitialised(model, meshes):
        """1F1B over two stages; the second re-initialises its attention's query weights after the split."""
        made = titan.pipeline(model, meshes, interleaved=False)
        stage = made.modules[0]
        if "1" in stage.layers:
            with torch.no_grad():
                torch.nn.init.normal_(stage.layers["1"].attention.wq.weight, std=0.02)
        return made


    MOE = dataclasses.replace(qwen3moe_hf.CASE, parallelize={"noexpsum": ep_without_expert_sum}, supports={})
    PIPE = dataclasses.replace(titan.CASE, parallelize={"stagereinit": stage_reinitialised}, supports={})
    ''')
CONFTEST = textwrap.dedent('''\
    from harness.model import register_model

    register_model("moebug", "bugs:MOE")
    register_model("pipebug", "bugs:PIPE")
    ''')
TEST = textwrap.dedent('''\
    import pytest

    from harness.model import model_cells

    CELLS = (model_cells("moebug", meshes=["dp=4"], switches={"ep": ["2"]})  # efsdp = 2 copies
             + model_cells("pipebug", meshes=["pp=2"]))


    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_bug(cfg, parity):
        parity(cfg)
    ''')


def test_each_bug_is_named_where_it_starts(tmp_path):
    pytest.importorskip("transformers", reason="pip install -e '.[thirdparty]' (transformers' Qwen3-MoE)")
    for name, text in (("bugs.py", BUGS), ("conftest.py", CONFTEST), ("test_bugs.py", TEST), ("pytest.ini", "[pytest]\n")):
        (tmp_path / name).write_text(text)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--case-deadline", "120"],
                          cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and "2 failed" in done.stdout, done.stdout[-5000:] + done.stderr[-2000:]
    moe, pipe = (done.stdout.split(f"test_bug[{cell}")[1] for cell in ("moebug-noexpsum", "pipebug-stagereinit"))
    assert ("first diverging module: model.layers.1.mlp.experts (parameter gradients, step 1), in the backward "
            "pass: every judged forward output matches") in moe, moe[:4000]
    assert ".mlp.gate" not in moe.split("first diverging module:")[1].splitlines()[0]
    assert ("first diverging module: layers.1.attention.wq (output, step 1, microbatch 0): its inputs still match "
            "the reference, its outputs do not") in pipe, pipe[:4000]
    # one screen: the table starts at the first diverging module's tensors and shows at most 12 rows
    lines = pipe.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("tensor "))
    assert "layers.1.attention.wq.weight" in lines[header + 1], lines[header:header + 3]
    assert lines[header + 13].startswith("... and ") and "more rows" in lines[header + 13], lines[header + 12:header + 14]
