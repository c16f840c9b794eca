"""docs/implementations.md's "Your own implementation", followed to the letter in a project outside
this checkout: its blocks, its install command (:func:`install_the_pages_project`, into a fresh
virtual environment: no PYTHONPATH, not run from this checkout) and its run command, for the tests
that run the page's project (test_bisect_project; test_workflow's caller, which runs the page's run
command and holds its goldens).

The files and commands come from the page's code blocks, not from the tests: a page that drifts
from what works fails there.
"""
import re
import subprocess
from pathlib import Path

from tests.checkout import copy_checkout, user_env

ROOT = Path(__file__).resolve().parent.parent
PLACEHOLDER = "/path/to/paritytest"
IMPLEMENTATIONS = "docs/implementations.md"  # the page that holds "Your own implementation"


def doc_section(page: str, title: str) -> str:
    """Section ``## title`` of ``page`` (``"README.md"``, ``"docs/implementations.md"``, ...), up to the next
    ``## `` heading."""
    text = (ROOT / page).read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def code_blocks(section: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def project_files(blocks) -> dict[str, str]:
    """Blocks whose first line names a file (``# mypkg/tp_impl.py``) are that file's whole text."""
    files = {}
    for _, body in blocks:
        first = body.splitlines()[0]
        match = re.fullmatch(r"# (\S+\.(?:py|ini|toml|cfg))", first)
        if match:
            files[match.group(1)] = body
    return files


def test_the_readme_blocks_name_a_package_a_conftest_a_test_and_the_commands():
    blocks = code_blocks(doc_section(IMPLEMENTATIONS, "Your own implementation"))
    files = project_files(blocks)
    assert {"mypkg/tp_impl.py", "tests_parity/conftest.py", "tests_parity/test_mine.py"} <= set(files)
    commands = [body for lang, body in blocks if lang == "sh"]
    assert any(PLACEHOLDER in c for c in commands) and any("pytest" in c for c in commands)


def pages_commands() -> tuple[str, str]:
    """The page's two shell blocks: its install command and its run command."""
    install, run = [body for lang, body in code_blocks(doc_section(IMPLEMENTATIONS, "Your own implementation"))
                    if lang == "sh"]
    return install, run


def install_the_pages_project(base: Path) -> Path:
    """The page's project at ``base/myproject``, its ``.venv`` made by the page's install command
    from a copy of this checkout (pip builds in the source tree, which must not be this checkout's)."""
    blocks = code_blocks(doc_section(IMPLEMENTATIONS, "Your own implementation"))
    project = base / "myproject"
    for name, text in project_files(blocks).items():
        path = project / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (project / "mypkg" / "__init__.py").touch()
    source = copy_checkout(base / "paritytest")
    install, _ = pages_commands()
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", install.replace(PLACEHOLDER, str(source))], cwd=project,
                          env=user_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    return project
