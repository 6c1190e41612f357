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


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    """The site as `mkdocs build --strict` builds it (a warning, such as a broken link, fails the build)."""
    pytest.importorskip("mkdocs")
    out = tmp_path_factory.mktemp("docs") / "site"
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    result = subprocess.run(
        command, cwd=ROOT, env=subprocess_env(NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_the_site_builds_strictly(site):
    assert (site / "reference" / "index.html").read_text().count("GRPOConfig") > 1
    assert (site / "search" / "search_index.json").exists()


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
    import json

    demo = json.loads((ROOT / "benchmarks" / "results" / "demo_cpu.json").read_text())
    quickstart = " ".join((DOCS / "quickstart.md").read_text().split())
    said = f"{demo['reward_before']:.3f} → {demo['reward_after']:.3f} in {len(demo['train_rewards'])} steps"
    assert said in quickstart, said
    from trl_scale.rewards.server import HANDSHAKE_TIMEOUT

    bad_input = " ".join((DOCS / "bad-input.md").read_text().split())
    assert f"{HANDSHAKE_TIMEOUT:g} s at most" in bad_input, HANDSHAKE_TIMEOUT


CHROMIUM_HINT = "Debian's chromium (apt-get install chromium)"
PICTURED = (
    "gpu",
    "agents",
    "quickstart",
    "timeline",
    "mismatch",
)  # the pages showing pictures drawn at the build (benchmarks/charts.py)


def _chromium() -> str | None:
    import shutil

    return shutil.which("chromium") or shutil.which("chromium-browser")


class _Page:
    """One page of a headless Chromium, driven over the DevTools protocol (a WebSocket): what it logged as errors
    (console errors, uncaught exceptions, failed loads) is kept in `errors`."""

    def __init__(self, socket):
        self.socket, self.next_id, self.errors, self.events = socket, 0, [], []

    async def call(self, method: str, **params):
        import json

        self.next_id += 1
        await self.socket.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(await self.socket.recv())
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message.get("result", {})
            self._note(message)

    def _note(self, message: dict) -> None:
        method, params = message.get("method"), message.get("params", {})
        self.events.append(method)
        if method == "Runtime.exceptionThrown":
            self.errors.append(params["exceptionDetails"].get("text"))
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.errors.append(str(params.get("args")))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.errors.append(params["entry"].get("text"))

    async def value(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result["result"].get("value")

    # A bound, not a wait: it returns as soon as the page says so (12 s for the whole test on an idle machine). 30 s
    # ran out twice on a loaded 2-core machine (a run of ~40 s); 35 s was measured beside three busy processes.
    async def until(self, expression: str, timeout: float = 90.0):
        import asyncio
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = await self.value(expression)
            if value:
                return value
            await asyncio.sleep(0.2)
        raise AssertionError(f"never true in the page: {expression}")


def test_the_built_site_renders_and_its_search_finds_staleness_in_a_real_browser(site, tmp_path):
    """The built site served over HTTP and opened in headless Chromium: the index renders (its title and the pages
    table), the search box finds "staleness" (Material's client-side search over the built index), and nothing is
    logged as an error on the way."""
    import asyncio
    import functools
    import http.server
    import threading
    import time

    import requests

    websockets = pytest.importorskip("websockets")
    chromium = _chromium()
    if chromium is None:
        pytest.skip(f"needs {CHROMIUM_HINT}")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    from .helpers import free_port

    port = free_port()
    browser = subprocess.Popen(
        [
            chromium,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            f"--remote-debugging-port={port}",
            f"--user-data-dir={tmp_path / 'profile'}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                targets = requests.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json()
                target = next(t for t in targets if t["type"] == "page")
                break
            except (requests.RequestException, StopIteration):
                assert time.monotonic() < deadline, "chromium never listened"
                time.sleep(0.2)

        async def visit():
            async with websockets.connect(target["webSocketDebuggerUrl"], max_size=None) as socket:
                page = _Page(socket)
                for domain in ("Runtime", "Log", "Page"):
                    await page.call(f"{domain}.enable")
                await page.call("Page.navigate", url=f"http://127.0.0.1:{server.server_address[1]}/")
                await page.until("document.readyState === 'complete' && !!document.querySelector('.md-search__input')")
                title = await page.value("document.title")
                pages = await page.value("document.querySelectorAll('article table a').length")
                await page.value(
                    "(() => { const box = document.querySelector('.md-search__input'); box.focus();"
                    " box.value = 'staleness'; box.dispatchEvent(new Event('input', {bubbles: true})); })()"
                )
                found = await page.until(
                    "Array.from(document.querySelectorAll('.md-search-result__item')).map(i => i.innerText)"
                    ".filter(t => /staleness/i.test(t))"
                )
                pictures = {}
                for name in PICTURED:  # the pictures drawn at the build, each loaded and decoded
                    await page.call("Page.navigate", url=f"http://127.0.0.1:{server.server_address[1]}/{name}/")
                    await page.until("document.readyState === 'complete'")
                    pictures[name] = await page.until(
                        "(() => { const images = Array.from(document.querySelectorAll('article img'));"
                        " return images.length && images.every(i => i.complete) &&"
                        " images.map(i => [i.getAttribute('src'), i.naturalWidth]); })()"
                    )
                return title, pages, found, pictures, page.errors

        title, pages, found, pictures, errors = asyncio.run(visit())
    finally:
        browser.kill()
        browser.wait(timeout=30)
        server.shutdown()
    assert title.startswith("trl-scale") and pages >= len(list(DOCS.glob("*.md"))) - 1, (title, pages)
    assert found, "the search found nothing for 'staleness'"
    for name, images in pictures.items():
        assert images and all(src.startswith("../figures/") and width > 300 for src, width in images), (name, images)
    assert not errors, errors


def test_the_reference_documents_every_field_trl_scale_adds(site):
    """The API reference renders each config's docstring as Python gives it (TRL's fields, then trl-scale's): every
    field of every trl-scale arguments class a config inherits is on the page, with its type and default."""
    import dataclasses
    import html

    import trl_scale

    page = html.unescape(re.sub(r"<[^>]+>", " ", (site / "reference" / "index.html").read_text()))
    text = " ".join(page.split())
    arguments = {
        base
        for config in (trl_scale.GRPOConfig, trl_scale.RLOOConfig, trl_scale.DPOConfig, trl_scale.PPOConfig)
        for base in config.__mro__
        if base.__module__.startswith("trl_scale") and base.__name__.endswith("Arguments")
    }
    assert len(arguments) >= 4, arguments
    for cls in arguments:
        own = [f.name for f in dataclasses.fields(cls) if f.name in vars(cls).get("__annotations__", {})]
        # "name (`type` ...)", or a group "a, b, c (`type`)"
        missing = [name for name in own if not re.search(rf"\b{name}(?:, \w+)* \( ?\S", text)]
        assert own and not missing, (cls.__name__, missing)


def test_the_architecture_page_names_every_module_and_every_layer():
    """Its module index is the code's (scripts/update_architecture_docs.py rewrites it), and its layer table names
    every entry of the layers test's table (a package or module missing from it was missing from the page)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("update", ROOT / "scripts" / "update_architecture_docs.py")
    update = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(update)
    page = (DOCS / "architecture.md").read_text()
    assert update.updated(page) == page, "stale: python scripts/update_architecture_docs.py"
    from .test_layers import LAYERS

    table = page.split("| layer | modules | may import |")[1].split("\n\n")[0]
    for module in LAYERS:
        name = module.removeprefix("trl_scale").lstrip(".")
        if name and name != "cli":
            shown = f"`{name}/`" if (ROOT / "trl_scale" / name).is_dir() else f"`{name}.py`"
            assert shown in table, shown
