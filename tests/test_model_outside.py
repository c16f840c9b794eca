"""README's "Your own model", followed to the letter in a project outside this checkout: the files
come from README's code blocks, and pytest runs them the way the section says, in a subprocess, from
the project's directory (the harness is the one installed in this environment, not this checkout's
path)."""
import os
import subprocess
import sys
from pathlib import Path

from tests.test_outside_project import code_blocks, doc_section, project_files

ROOT = Path(__file__).resolve().parent.parent


def model_blocks():
    return code_blocks(doc_section("README.md", "Your own model"))


def test_the_user_writes_at_most_30_lines():
    files = project_files(model_blocks())
    assert set(files) == {"mymodel.py", "tests_model/conftest.py", "tests_model/test_mlp.py"}
    lines = [line for text in files.values() for line in text.splitlines()[1:] if line.strip()]
    assert len(lines) <= 30, f"{len(lines)} lines"


def test_an_outside_project_checks_its_own_model_as_readme_says(tmp_path):
    project = tmp_path / "myproject"
    for name, text in project_files(model_blocks()).items():
        path = project / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (project / "pytest.ini").write_text("[pytest]\n")  # the project's own rootdir, not this checkout's
    command = [body for lang, body in model_blocks() if lang == "sh"][0].strip()
    assert command == ".venv/bin/python -m pytest tests_model"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "pytest", "tests_model", "-p", "no:cacheprovider",
                           "--case-deadline", "120"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "3 passed" in done.stdout
    goldens = sorted(p.name for p in (project / "golden" / "mlp").iterdir())
    assert goldens == ["mlp-mine-dp2-fp32-plain-steps3-seed0.safetensors",
                       "mlp-mine-dp2.tp2-fp32-plain-steps3-seed0.safetensors",
                       "mlp-mine-tp2-fp32-plain-steps3-seed0.safetensors"]


def test_the_same_project_with_a_bug_in_its_parallelize_fails_naming_the_module(tmp_path):
    """The README model sharded by FSDP2 over the wrong mesh dim (rep, 1 rank here): no
    gradient is averaged over the data-parallel ranks. Red, and the failure names the parameter's module."""
    project = tmp_path / "myproject"
    for name, text in project_files(model_blocks()).items():
        path = project / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.replace('mesh=meshes.dense["dp"]', 'mesh=meshes.dense["rep"]'))
    assert 'meshes.dense["rep"]' in (project / "mymodel.py").read_text()
    (project / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "pytest", "tests_model", "-p", "no:cacheprovider", "-k",
                           "dp2 and not tp2", "--case-deadline", "120"], cwd=project, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    assert "first diverging parameter gradients (step 1, in backward order): 2.bias (module 2: replicas" \
        in done.stdout, done.stdout[-6000:]
