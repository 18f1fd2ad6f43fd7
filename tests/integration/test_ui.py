"""The demo page (``python -m blend_integrations.ui``) in a real browser:
Debian's chromium, driven headless by Playwright for Python through its
``executable_path`` (no browser download). The page runs as a user starts it,
on its defaults (the vLLM engine where vLLM is installed, SmolLM2), on a store
another engine warmed first."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from playwright import sync_api

from blend_integrations import ChunkStore, load_engine
from blend_integrations.ui.session import EXAMPLE_DOCUMENTS, load_documents

BACKEND = "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# As root in a container, with the machine's closed network: no sandbox, no background connections.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
PICKED = ["ada_okafor.txt", "karl_dahl.txt", "harbor_press.txt"]
QUESTION = "In which city was Ada Okafor born?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed: `apt-get install chromium` (.ci/run does)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page_url(smollm2_gguf, tmp_path_factory):
    """The page, started as ``make ui`` starts it, on a store whose documents the transformers engine warmed."""
    from blend_integrations.models.smollm2 import smollm2_dir

    store = tmp_path_factory.mktemp("ui") / "store"
    documents = load_documents(EXAMPLE_DOCUMENTS)
    warmer = load_engine(str(smollm2_dir()), store=ChunkStore(store, remote=""))
    warmer.warm([documents[name] for name in PICKED])
    warmer.store.close()
    port = free_port()
    command = [sys.executable, "-m", "blend_integrations.ui", "--backend", BACKEND, "--store", str(store)]
    command += ["--max-tokens", "16", "--port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "BLEND_STORE_REMOTE": ""}
    log = (tmp_path_factory.mktemp("ui-log") / "page.log").open("w+")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    pytest.fail(f"the page did not come up (exit {server.poll()}):\n{log.read()[-4000:]}")
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the page and vLLM's processes
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def ready(page) -> float:
    """Waits for the model to load; the seconds it took from the page's start."""
    status = page.locator("#status")
    sync_api.expect(status).to_contain_text("Ready", timeout=150_000)
    return float(re.search(r"loaded in (\d+) s", status.inner_text()).group(1))


def test_the_page_answers_both_ways_and_shows_what_blending_recomputed(browser, page_url, tmp_path):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(page_url)
    assert ready(page) < 90  # the model loads in under 90 s on 2 CPUs
    for name in PICKED:
        page.get_by_label(name).check()
    order = page.locator("#order")
    sync_api.expect(order).to_contain_text(PICKED[-1])
    page.get_by_role("button", name="Reverse order").click()
    sync_api.expect(order).to_contain_text(re.compile(".*".join(map(re.escape, PICKED[::-1])), re.S))
    page.locator("#question textarea").fill(QUESTION)
    page.get_by_role("button", name="Ask").click()
    message = page.locator("#message")
    sync_api.expect(message).to_contain_text("sooner than full prefill", timeout=120_000)
    assert page.locator("#blend-answer textarea").input_value().strip()
    assert page.locator("#full-answer textarea").input_value().strip()
    blend, full = (page.locator(f"#{side}-stats").inner_text() for side in ("blend", "full"))
    ttft = re.compile(r"TTFT \(ms\)\s+(\d+)")
    assert int(ttft.search(blend).group(1)) > 0 and int(ttft.search(full).group(1)) > 0
    cached = int(re.search(r"tokens read from the store\s+(\d+)", blend).group(1))
    recomputed = int(re.search(r"tokens recomputed\s+(\d+)", blend).group(1))
    assert cached > 0 and 0 < recomputed < cached  # warmed by the transformers engine: every document a hit
    assert re.search(r"chunks hit / missed\s+3 / 0", blend)
    assert re.search(r"tokens read from the store\s+0", full)
    marks = page.locator("#marks")
    sync_api.expect(marks.get_by_role("button", name="recomputed", exact=True)).to_be_visible()  # the legend
    # one highlighted token per recomputed token, in the legend's colour (page.COLORS)
    orange = marks.locator("span.token.highlighted[style*='249, 115, 22']")
    assert orange.count() == recomputed
    page.screenshot(path=str(tmp_path / "ui.png"), full_page=True)
    if os.environ.get("BLEND_UI_SCREENSHOT"):  # for docs/: BLEND_UI_SCREENSHOT=docs/images/ui.png
        page.screenshot(path=os.environ["BLEND_UI_SCREENSHOT"], full_page=True)
    page.close()


def test_bad_input_keeps_the_page_up_with_a_clear_message(browser, page_url):
    page = browser.new_page()
    page.goto(page_url)
    ready(page)
    message = page.locator("#message")
    page.locator("#question textarea").fill(QUESTION)
    page.get_by_role("button", name="Ask").click()
    sync_api.expect(message).to_contain_text("choose or paste at least one document")
    page.get_by_label(PICKED[0]).check()
    page.locator("#question textarea").fill("   ")
    page.get_by_role("button", name="Ask").click()
    sync_api.expect(message).to_contain_text("the question is empty")
    page.locator("#pasted textarea").fill("A very long document. " * 2000)
    page.get_by_role("button", name="Add pasted document").click()
    sync_api.expect(message).to_contain_text("Added pasted 1")
    page.locator("#question textarea").fill(QUESTION)
    page.get_by_role("button", name="Ask").click()
    sync_api.expect(message).to_contain_text("choose fewer or shorter documents")
    page.close()


def test_two_tabs_asking_at_once_both_get_answers(browser, page_url):
    tabs = [browser.new_page() for _ in range(2)]
    for tab in tabs:
        tab.goto(page_url)
        ready(tab)
        tab.get_by_label(PICKED[1]).check()
        tab.locator("#question textarea").fill("Who is Karl Dahl?")
    for tab in tabs:
        tab.get_by_role("button", name="Ask").click()
    for tab in tabs:  # the second waits in the queue for the first, then answers
        sync_api.expect(tab.locator("#message")).to_contain_text("sooner than full prefill", timeout=120_000)
        tab.close()


def test_a_model_that_fails_to_load_keeps_the_page_up(browser, tmp_path):
    from blend_integrations.ui.page import build_page, serve
    from blend_integrations.ui.session import DemoSession

    session = DemoSession(str(tmp_path / "no-such-model"), backend="transformers").start()
    page = build_page(session, {"a.txt": "Brimford is a city by the sea."})
    port = free_port()
    serve(page, session, "127.0.0.1", port, quiet=True)
    try:
        assert session.wait(30)
        with pytest.raises(urllib.error.HTTPError, match="503"):  # GET /health: not ready, and says why
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health")
        tab = browser.new_page()
        tab.goto(f"http://127.0.0.1:{port}")
        sync_api.expect(tab.locator("#status")).to_contain_text("failed to load", timeout=30_000)
        tab.get_by_label("a.txt").check()
        tab.locator("#question textarea").fill("Which city?")
        tab.get_by_role("button", name="Ask").click()
        sync_api.expect(tab.locator("#message")).to_contain_text("failed to load")
        tab.close()
    finally:
        page.close()
