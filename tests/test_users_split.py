"""A cell whose function split nothing over a mesh dim is a failure, never a green, told from a user's
own project (written to a temporary directory, run with pytest and ``python -m harness.explore`` in a
subprocess).

The user's model is harness/examples/titan.py's; their functions: ``fsdp`` knows FSDP2 over dp and
nothing else (on pp=2 every rank runs the whole model; on dp=2,tp=2 every parameter is whole over
tp), ``titan`` is torchtitan's order (pipeline, TP, FSDP) and passes on the same meshes, and
``nopipe`` applies TP and FSDP2 but knows no pipeline: exploration must never report a pp draw of it
clean, and draws no one-rank world.
"""
import json
import textwrap

from harness.config import Config

MODEL = textwrap.dedent('''\
    from harness.examples import titan
    from harness.model import ModelCase


    def fsdp_only(model, meshes):
        """FSDP2 over dp, whatever else the mesh has."""
        mesh = titan.fsdp_mesh(meshes)
        if mesh is not None:
            titan.apply_fsdp(model, mesh)
        return model


    def no_pipeline(model, meshes):
        """TP and FSDP2 as torchtitan applies them, and no pipeline."""
        return titan.parallelize_stage(model, meshes, loss_parallel=True)


    def tp_fits(spec):
        if spec.cp > 1:
            return "no context parallel here"
        return None if spec.tp in (1, 2) else "the model's 4 heads split over tp=2 only"


    CASE = ModelCase(build=titan.Transformer, batch=titan.batch, loss=titan.loss,
                     parallelize={"fsdp": fsdp_only, "titan": titan.parallelize, "nopipe": no_pipeline},
                     supports={"fsdp": tp_fits, "titan": tp_fits, "nopipe": tp_fits})
    ''')
CONFTEST = 'from harness.model import register_model\n\nregister_model("mine", "mymodel:CASE")\n'
TEST = textwrap.dedent('''\
    import pytest

    from harness.model import model_cells

    CELLS = model_cells("mine", impls=["fsdp", "titan"], meshes=["pp=2", "dp=2,tp=2"])


    @pytest.mark.parametrize("cfg", CELLS, ids=str)
    def test_mine(cfg, parity):
        parity(cfg)
    ''')


FILES = {"mymodel.py": MODEL, "conftest.py": CONFTEST, "test_mine.py": TEST}


def failure_of(stdout: str, cell: str) -> list[str]:
    """The lines pytest shows under a failing cell's header."""
    part = stdout.split(f"test_mine[{cell}] _")[1]
    return [line for line in part.splitlines()[1:] if line.strip()][:3]


def test_a_function_that_ignores_pp_or_tp_fails_naming_the_dim_and_a_right_one_passes(user_project):
    done = user_project.write(FILES).pytest("--case-deadline", "120")
    out, golden = done.stdout, user_project.path / "golden"
    assert done.returncode == 1 and "2 failed, 2 passed" in out, done.tail
    pp = failure_of(out, "mine-fsdp-pp2-fp32-plain-steps3-seed0")
    assert pp[0] == ("pp=2 split nothing: parallelize 'fsdp' returned a module, not a Pipelined: every pp rank ran "
                     "the whole model; declare its meshes: ModelCase(supports={'fsdp': fn(spec) -> reason or None})"), pp
    tp = failure_of(out, "mine-fsdp-dp2.tp2-fp32-plain-steps3-seed0")
    assert tp[0].startswith("tp=2 split nothing: parallelize 'fsdp' left every parameter, buffer and activation whole "
                            "over tp; declare its meshes: ModelCase(supports="), tp
    for lines in (pp, tp):  # one line, then how to rerun it: no crash report, no traceback
        assert len(lines[0]) < 200 and lines[1].startswith("reproduce: "), lines
    assert "split nothing" in out.split("parity summary")[1]  # the summary counts them apart from crashes
    assert not (golden / "mine" / "mine-fsdp-pp2-fp32-plain-steps3-seed0.safetensors").exists()


def test_exploration_never_reports_a_pipeline_draw_of_a_function_without_one_clean_nor_draws_one_rank(user_project):
    done = user_project.write(FILES).harness("explore", "mine:nopipe", "--seed", "0", "--max-examples", "12",
                                             "--database", "none", "--pool-size", "4", "--case-deadline", "120",
                                             "--out", "out")
    assert done.returncode == 0, done.tail
    trials = [(Config.parse(t["config"]), t)
              for t in map(json.loads, (user_project.path / "out" / "trials.jsonl").open())]
    piped = [t for cfg, t in trials if cfg.degree("pp") > 1]
    assert piped, [t["config"] for _, t in trials]  # pipeline meshes were drawn ...
    assert all(t["kind"] == "invalid" and "pp=" in t["detail"] and "split nothing" in t["detail"]
               for t in piped), piped  # ... and each one set aside, never clean
    assert not [t["config"] for cfg, t in trials if cfg.world == 1]
