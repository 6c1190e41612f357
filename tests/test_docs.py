"""The documentation: the site builds with `mkdocs build --strict` (no broken link, page or API reference), the
README stays a newcomer's page (at most 250 lines, every docs page linked), and every Python block in the README
and the docs runs here or says on its first line why it cannot (`# not run here: ...`)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from .helpers import ROOT, subprocess_env

DOCS = ROOT / "docs"
NOT_RUN = "# not run here: "


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.MULTILINE | re.DOTALL)


def documented() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    result = subprocess.run(
        command, cwd=ROOT, env=subprocess_env(NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "index.html").read_text().count("GRPOConfig") > 1
    assert (tmp_path / "site" / "search" / "search_index.json").exists()


def test_the_readme_is_short_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= 250, readme.count("\n")
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS.glob("*.md"):
        assert page.name in nav, f"{page.name} is not in mkdocs.yml's nav"
        if page.name != "index.md":
            assert f"(docs/{page.name})" in readme, f"the README does not link docs/{page.name}"


@pytest.mark.parametrize(
    "path, index",
    [(path, i) for path in documented() for i in range(len(python_blocks(path)))],
    ids=lambda value: value.name if isinstance(value, pathlib.Path) else str(value),
)
def test_every_python_block_runs_or_says_why_not(path, index, tmp_path, monkeypatch):
    block = python_blocks(path)[index]
    if block.startswith(NOT_RUN):
        assert len(block.splitlines()[0]) > len(NOT_RUN) + 10, "say why it cannot run here"
        compile(block, f"{path.name}[{index}]", "exec")  # still valid Python
        return
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    exec(compile(block, f"{path.name}[{index}]", "exec"), {"__name__": "__docs__"})


def test_the_numbers_the_docs_state_are_the_codes():
    """A number in the docs that the code can give is checked against it (more in test_sandbox, test_chaos and
    test_stream_rewards, each for its own page)."""
    from trl_scale.seams import SEAMS

    architecture = (DOCS / "architecture.md").read_text()
    assert f"{len(SEAMS)} seams" in " ".join(architecture.split()), len(SEAMS)
