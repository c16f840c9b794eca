"""A library registers its own implementations on install, through the entry-point group
``paritytest.components``: its cells then run in any project of that environment, with no conftest.

The library is installed as pip lays a package out (its module and a ``.dist-info`` with
``entry_points.txt``) in a directory on the project's ``PYTHONPATH``; the project's test names the
library's implementation and nothing else.
"""
import subprocess
import sys
import textwrap

LIBRARY = {
    "paritylib/__init__.py": "",
    "paritylib/parity.py": textwrap.dedent("""\
        from harness.registry import register_implementation


        def register():
            # the library's own TP, here the harness's own code under another name
            register_implementation("tp", "paritylib", "harness.parallel.tp:run")
        """),
    "paritylib-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: paritylib\nVersion: 1.0\n",
    "paritylib-1.0.dist-info/entry_points.txt": "[paritytest.components]\nparitylib = paritylib.parity:register\n",
}
PROJECT = {
    "pytest.ini": "[pytest]\n",
    "test_lib.py": textwrap.dedent("""\
        from harness.config import Config


        def test_the_librarys_tp(parity):
            parity(Config.parse("tp-paritylib-tp2-fp32-op_mlp-b4.f32.h16.s8.v40-seed0"))
        """),
}


def _write(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _pytest(project, pythonpath):
    env = {"PATH": "/usr/bin:/bin", **({"PYTHONPATH": str(pythonpath)} if pythonpath else {})}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--case-deadline", "120"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=300)


def test_an_installed_librarys_implementation_runs_in_a_project_without_a_conftest(tmp_path):
    site, project = tmp_path / "site", tmp_path / "project"
    _write(site, LIBRARY)
    _write(project, PROJECT)
    done = _pytest(project, site)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout
    assert (project / "golden" / "tp" / "tp-paritylib-tp2-fp32-op_mlp-b4.f32.h16.s8.v40-seed0.safetensors").exists()


def test_without_the_library_the_cell_names_what_is_registered(tmp_path):
    _write(tmp_path, PROJECT)
    done = _pytest(tmp_path, None)
    assert done.returncode == 1
    assert "no implementation 'paritylib' of tp; registered: dtensor, hf, megatron, ours" in done.stdout
