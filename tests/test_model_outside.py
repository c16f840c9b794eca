"""README's "Your own model", followed to the letter in a project outside this checkout: the files
come from README's code blocks, and pytest runs them the way the section says, in a subprocess, from
the project's directory (the harness is the one installed in this environment, not this checkout's
path)."""
from tests.conftest import flat
from tests.project import UserProject
from tests.test_outside_project import code_blocks, doc_section, project_files


def model_blocks():
    return code_blocks(doc_section("README.md", "Your own model"))


def installed(project: UserProject) -> dict[str, str]:
    """The project's environment without PYTHONPATH: the harness is the installed one, not this checkout's path."""
    return {k: v for k, v in project.env().items() if k != "PYTHONPATH"}


def test_the_user_writes_at_most_30_lines():
    files = project_files(model_blocks())
    assert set(files) == {"mymodel.py", "tests_model/conftest.py", "tests_model/test_mlp.py"}
    lines = [line for text in files.values() for line in text.splitlines()[1:] if line.strip()]
    assert len(lines) <= 30, f"{len(lines)} lines"


def test_an_outside_project_checks_its_own_model_as_readme_says(user_project):
    # its pytest.ini (user_project's): the project's own rootdir, not this checkout's
    user_project.write(project_files(model_blocks()))
    command = [body for lang, body in model_blocks() if lang == "sh"][0].strip()
    assert command == ".venv/bin/python -m pytest tests_model"
    done = user_project.pytest("tests_model", "--case-deadline", "120", env=installed(user_project))
    assert done.returncode == 0, done.tail
    assert "3 passed" in done.stdout
    goldens = sorted(p.name for p in (user_project.path / "golden" / "mlp").iterdir())
    assert goldens == ["mlp-mine-dp2-fp32-plain-steps3-seed0.safetensors",
                       "mlp-mine-dp2.tp2-fp32-plain-steps3-seed0.safetensors",
                       "mlp-mine-tp2-fp32-plain-steps3-seed0.safetensors"]


def test_the_same_project_with_a_bug_in_its_parallelize_fails_naming_the_module(user_project):
    """The README model sharded by FSDP2 over the wrong mesh dim (rep, 1 rank here): no
    gradient is averaged over the data-parallel ranks. Red, and the failure names the parameter's module."""
    user_project.write({name: text.replace('mesh=meshes.dense["dp"]', 'mesh=meshes.dense["rep"]')
                        for name, text in project_files(model_blocks()).items()})
    assert 'meshes.dense["rep"]' in (user_project.path / "mymodel.py").read_text()
    done = user_project.pytest("tests_model", "-k", "dp2 and not tp2", "--case-deadline", "120",
                               env=installed(user_project))
    assert done.returncode == 1, done.tail
    # each data-parallel rank's gradients are its own batch's: the reduction over dp that never ran, named so
    assert ("first diverging parameter gradients (step 1, in backward order): 2.bias (module 2: differs over dp "
            "(averaged over dp it matches the reference): its reduction over dp is missing") \
        in flat(done.stdout), done.stdout[-6000:]
    assert "first diverging module: 2 " in flat(done.stdout), done.stdout[-6000:]  # the rerun with hooks found it

    # without the rerun: the comparison's own line, no module, and how to get it
    quick = user_project.pytest("tests_model", "-k", "dp2 and not tp2", "--case-deadline", "120", "--no-localise",
                                env=installed(user_project))
    assert quick.returncode == 1, quick.tail
    text = flat(quick.stdout)
    assert "first diverging parameter gradients (step 1, in backward order): 2.bias (module 2: mismatch" in text, text
    assert "first diverging module" not in text, text
    assert "not run again to find where it starts (--no-localise): its reproduce command does" in text, text
