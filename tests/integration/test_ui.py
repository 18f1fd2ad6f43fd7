"""The demo page (``python -m blend_integrations.ui``) in a real browser:
Debian's chromium, driven headless by Playwright for Python through its
``executable_path`` (no browser download). The page runs as a user starts it,
on its defaults (the vLLM engine where vLLM is installed, SmolLM2), on a store
another engine warmed first."""

from __future__ import annotations

import dataclasses
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
from blend_integrations.calibration import packaged_calibrations, record_name
from blend_integrations.ui.session import EXAMPLE_DOCUMENTS, load_documents

BACKEND = "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"  # Debian's, Ubuntu's
# As root in a container, with the machine's closed network: no sandbox, no background connections.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
PICKED = ["ada_okafor.txt", "karl_dahl.txt", "harbor_press.txt"]
QUESTION = "In which city was Ada Okafor born?"
# What the page says of a real blend (chunks reused at a ratio below 1): how its time to first token
# compares with full prefill's, either way (tests assert no timings), and what it recomputed.
REAL_BLEND = re.compile(
    r"Blending answered \d+\.\d\dx (?:sooner|later) than full prefill "
    r"\(ratio 0\.15, (\d+) of (\d+) stored tokens recomputed\)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed: `make system-packages` installs it (as root)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page_url(smollm2_gguf, tmp_path_factory):
    """The page, started as ``make ui`` starts it, on a store whose documents the transformers engine
    warmed. Its model: SmolLM2-135M-Instruct, or the packaged model ``$BLEND_UI_MODEL`` names (the
    docs' screenshot is taken on ``make ui``'s, qwen2.5-coder-1.5b)."""
    from blend_integrations.models.packaged import MODELS

    name = os.environ.get("BLEND_UI_MODEL", "smollm2")
    store = tmp_path_factory.mktemp("ui") / "store"
    documents = load_documents(EXAMPLE_DOCUMENTS)
    warmer = load_engine(str(MODELS[name].checkpoint()), store=ChunkStore(store, remote=""))
    warmer.warm([documents[name] for name in PICKED])
    # A calibration of this store that chose full prefill for the page's engine (what
    # "auto" gets; a fixed ratio ignores it), whatever the shipped one chooses.
    shipped = packaged_calibrations()[(warmer.fingerprint, warmer.dtype_name, BACKEND)].record
    full_prefill = dataclasses.replace(shipped, ratio=1.0, guard=None, guard_settings=None, model="the UI test's")
    warmer.store.put_record(record_name(warmer.fingerprint, warmer.dtype_name), full_prefill.to_bytes())
    warmer.store.close()
    port = free_port()
    command = [sys.executable, "-m", "blend_integrations.ui", "--model", name, "--backend", BACKEND]
    command += ["--store", str(store)]
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
    ready(page)  # how long loading takes is the benchmarks' business, not a test's
    for name in PICKED:
        page.get_by_label(name).check()
    order = page.locator("#order")
    sync_api.expect(order).to_contain_text(PICKED[-1])
    page.get_by_role("button", name="Reverse order").click()
    sync_api.expect(order).to_contain_text(re.compile(".*".join(map(re.escape, PICKED[::-1])), re.S))
    page.locator("#question textarea").fill(QUESTION)
    page.get_by_role("button", name="Ask").click()
    message = page.locator("#message")
    sync_api.expect(message).to_contain_text(REAL_BLEND, timeout=120_000)
    assert page.locator("#blend-answer textarea").input_value().strip()
    assert page.locator("#full-answer textarea").input_value().strip()
    blend, full = (page.locator(f"#{side}-stats").inner_text() for side in ("blend", "full"))
    ttft = re.compile(r"TTFT \(ms\)\s+(\d+)")
    assert int(ttft.search(blend).group(1)) > 0 and int(ttft.search(full).group(1)) > 0
    cached = int(re.search(r"tokens read from the store\s+(\d+)", blend).group(1))
    recomputed = int(re.search(r"tokens recomputed\s+(\d+)", blend).group(1))
    assert cached > 0 and 0 < recomputed < cached  # warmed by the transformers engine: every document a hit
    assert REAL_BLEND.search(message.inner_text()).groups() == (str(recomputed), str(cached))
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


def ask(page, expected: str) -> str:
    """Click Ask and wait for the answer's message, which must contain ``expected``; returns the message."""
    page.get_by_role("button", name="Ask").click()
    message = page.locator("#message")
    sync_api.expect(message).to_contain_text(expected, timeout=120_000)
    sync_api.expect(page.locator("#blend-stats")).to_contain_text("TTFT", timeout=30_000)
    return message.inner_text()


def test_full_prefill_on_the_blend_side_is_shown_as_such_never_as_a_gain(browser, page_url):
    """Blending at ratio 1.0, asked for or chosen by the calibration under
    "auto", is full prefill: the page says so and why, and claims no speed-up."""
    page = browser.new_page()
    page.goto(page_url)
    ready(page)
    page.get_by_label(PICKED[0]).check()
    page.locator("#question textarea").fill(QUESTION)
    ratio = page.locator("#fixed-ratio input[type=number]")
    ratio.fill("1")
    ratio.press("Enter")
    said = ask(page, "Blending ran as full prefill: the ratio asked for is 1.0")
    assert "sooner" not in said and "later" not in said
    blend = page.locator("#blend-stats").inner_text()
    assert re.search(r"ratio\s+1\.0\b", blend) and re.search(r"ratio source\s+request", blend)
    assert re.search(r"chunks hit / missed\s+1 / 0", blend)  # the document was read from the store, and recomputed

    page.locator("#ratio-mode").get_by_label("auto").check()
    said = ask(page, "Blending ran as full prefill: the calibration for this model (in this store) chose ratio 1.0")
    assert "sooner" not in said and "later" not in said
    blend = page.locator("#blend-stats").inner_text()
    assert re.search(r"ratio source\s+calibrated", blend) and re.search(r"tokens read from the store\s+0", blend)
    page.close()


def axis_labels(page, axis: str) -> list[str]:
    """The tick labels of the TTFT plot's ``axis`` ("X" or "Y"), its title left out."""
    found = page.locator(f"#ttft-plot g[aria-roledescription='axis'][aria-label^='{axis}-axis']")
    texts = [t.strip() for t in found.first.locator("text").all_text_contents()]
    return [t for t in texts if t and t not in ("question", "TTFT (ms)")]


def test_the_plot_numbers_the_questions_and_rounds_its_times(browser, page_url):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(page_url)
    ready(page)
    page.get_by_label(PICKED[1]).check()
    page.locator("#question textarea").fill("Who is Karl Dahl?")
    ask(page, "Blending answered")
    plot = page.locator("#ttft-plot")
    x_axis = plot.locator("g[aria-roledescription='axis'][aria-label^='X-axis']")
    sync_api.expect(x_axis).to_have_count(1, timeout=30_000)
    asked = len(axis_labels(page, "X"))  # every tab's questions in this session, this one last
    assert asked >= 1
    page.locator("#question textarea").fill("What does Karl Dahl do?")
    ask(page, "Blending answered")
    # one more question: numbered next, the axis's labels the questions' numbers in asking order
    sync_api.expect(x_axis).to_have_attribute("aria-label", re.compile(f"{asked + 1} values"), timeout=30_000)
    assert axis_labels(page, "X") == [str(n) for n in range(1, asked + 2)]
    # each answer's time in ms, to 3 significant digits
    points = [p.get_attribute("aria-label") for p in plot.locator("[aria-roledescription='point']").all()]
    shown = [re.fullmatch(r"question: (\d+); TTFT \(ms\): ([\d.]+); answer: (blend|full)", p) for p in points]
    assert all(shown), points
    assert sorted((int(m[1]), m[3]) for m in shown) == [(n, s) for n in range(1, asked + 2) for s in ("blend", "full")]
    assert all(significant(m[2]) <= 3 for m in shown), points
    page.close()


def significant(number: str) -> int:
    """The significant digits ``number`` (as the plot writes it: "1250", "12.5", "0.0345") shows."""
    return len(number.replace(".", "").strip("0"))


@pytest.mark.timeout(600)
def test_a_blend_that_falls_back_is_shown_with_its_reason(browser, model_dirs, tmp_path):
    """A blend pass that fails for real in vLLM's worker (tests/blend_faults.py)
    is computed in full: the page says that the blend side fell back and why,
    in its message and under the answer, and claims no speed-up."""
    if BACKEND != "vllm":
        pytest.skip("only the vLLM engine falls back to full prefill (Generation.fallback)")
    from blend_integrations.ui.page import build_page, serve
    from blend_integrations.ui.session import DemoSession

    document = "Brimford is a market town in the river valley. Ada Okafor was born there in 1801."
    options = {"max_model_len": 2048, "kv_cache_gib": 1, "worker_extension_cls": "blend_faults.FaultInjection"}
    store = ChunkStore(tmp_path / "store", remote="")
    session = DemoSession(model_dirs("llama"), store=store, max_tokens=4, engine_options=options).start()
    page = build_page(session, {"brimford.txt": document})
    port = free_port()
    serve(page, session, "127.0.0.1", port, quiet=True)
    try:
        assert session.wait(300) and session.engine is not None, session.status()
        engine = session.engine
        engine.warm([document])
        engine.llm.collective_rpc("blend_fail_on", args=(engine.tokenizer.encode(document, add_special_tokens=False),))
        tab = browser.new_page()
        tab.goto(f"http://127.0.0.1:{port}")
        ready(tab)
        tab.get_by_label("brimford.txt").check()
        tab.locator("#question textarea").fill("Where was Ada Okafor born?")
        said = ask(tab, "Blending fell back to full prefill: the blend pass failed: OutOfMemoryError: injected fault")
        assert "sooner" not in said and "later" not in said
        blend = tab.locator("#blend-stats").inner_text()
        assert re.search(r"fell back to full prefill\s+the blend pass failed: OutOfMemoryError: injected fault", blend)
        assert re.search(r"tokens read from the store\s+0", blend)
        tab.close()
    finally:
        if session.engine is not None:
            session.engine.close()
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


def test_the_ticks_and_the_order_box_agree(browser, page_url):
    page = browser.new_page()
    page.goto(page_url)
    ready(page)
    for name in PICKED[:2]:
        page.get_by_label(name).check()
    order = page.locator("#order")
    sync_api.expect(order).to_contain_text(PICKED[1])
    # taking a document out of the order box unticks it: the ticks are what Ask reads
    order.locator(".token", has_text=PICKED[1]).locator(".token-remove").click()
    sync_api.expect(page.get_by_label(PICKED[1])).not_to_be_checked()
    sync_api.expect(page.get_by_label(PICKED[0])).to_be_checked()
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
        sync_api.expect(tab.locator("#message")).to_contain_text(REAL_BLEND, timeout=120_000)
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
