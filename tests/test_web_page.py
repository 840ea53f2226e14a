"""The web page at `/` in a real browser: Debian's Chromium, headless, driven by Playwright
(its Python package, pointed at the system Chromium), against `python -m luce_jax.serve` with
the embedded model on CPU.

The page must load with no console error, stream a chat reply, show two concurrent chats as
two busy slots in the engine panel and the KV pool empty again after them, and cancel a reply
on Stop (its slot freed). Screenshots of the run go to the test's folder, and to docs/images/
with LUCE_DOCS_SCREENSHOTS=1 (docs/serving.md shows them)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_server import free_port, wait_healthy

CHROMIUM = shutil.which("chromium")
DOCS = Path(__file__).resolve().parents[1] / "docs" / "images"


@pytest.fixture(scope="module")
def url(compile_cache):
    port = free_port()
    cmd = [sys.executable, "-m", "luce_jax.serve", "--port", str(port), "--max-concurrency", "4",
           "--max-ctx", "512", "--kv-pool-tokens", "2048", "--compile-cache-dir", compile_cache,
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base)
    yield base
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def page(url):
    """The page, open in headless Chromium; page.errors: console errors and uncaught ones."""
    if not CHROMIUM:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        pg.errors = []
        pg.on("console", lambda m: m.type == "error" and pg.errors.append(m.text))
        pg.on("pageerror", lambda e: pg.errors.append(str(e)))
        pg.goto(url + "/")
        yield pg
        browser.close()


def wait(what, timeout=60.0, every=0.05):
    """what() until it is truthy; its value."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def text(page, id_: str) -> str:
    return page.locator(f"#{id_}").inner_text()


def chat(page, i: int):
    return page.locator("#chats .chat").nth(i)


def send(c, message: str) -> None:
    c.locator(".input").fill(message)
    c.locator(".send").click()


def status(c) -> str:
    return c.get_attribute("data-status") or ""


def shot(page, tmp_path, name: str) -> None:
    path = tmp_path / name
    page.screenshot(path=str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("LUCE_DOCS_SCREENSHOTS") == "1":
        DOCS.mkdir(exist_ok=True)
        shutil.copyfile(path, DOCS / name)


def test_the_page_loads_with_no_console_error(page):
    wait(lambda: text(page, "model") not in ("", "loading…"))
    assert text(page, "model") == "luce-stdlib-main"
    assert page.locator("#chats .chat").count() == 2 and text(page, "max-slots") == "4"
    assert page.locator("#slots .slot").count() == 4
    assert not page.errors, page.errors


def test_a_chat_reply_streams_in(page, tmp_path):
    page.locator("#max-tokens").fill("32")
    c = chat(page, 0)
    send(c, "def fibonacci(n):")
    wait(lambda: status(c) in ("streaming", "done"), 60, 0.01)
    wait(lambda: status(c) == "done", 120)
    reply = c.locator(".msg.assistant").last
    assert reply.locator(".text").inner_text().strip()
    assert "32 tokens" in reply.locator(".meta").inner_text()
    shot(page, tmp_path, "web_page_chat.png")


def test_two_chats_at_once_are_two_busy_slots_and_leave_the_pool_empty(page, tmp_path):
    page.locator("#max-tokens").fill("120")
    a, b = chat(page, 0), chat(page, 1)
    send(a, "import os")
    send(b, "class Stack:")
    wait(lambda: text(page, "busy") == "2", 60, 0.01)
    assert page.locator("#slots .slot.busy").count() == 2
    shot(page, tmp_path, "web_page_two_chats.png")
    wait(lambda: status(a) == "done" and status(b) == "done", 180)
    wait(lambda: text(page, "busy") == "0" and text(page, "kv-used") == "0", 10)
    assert not page.errors, page.errors


def test_stop_cancels_a_reply_and_frees_its_slot(page, url):
    page.locator("#max-tokens").fill("400")
    c = chat(page, 1)
    send(c, "def main():")
    wait(lambda: status(c) == "streaming", 60, 0.01)
    c.locator(".stop").click()
    wait(lambda: status(c) == "stopped", 10)
    wait(lambda: text(page, "busy") == "0" and text(page, "kv-used") == "0", 10)
    assert "stopped" in c.locator(".msg.assistant .meta").last.inner_text()
    view = httpx.get(url + "/debug/steps").json()
    assert view["slots"] == [] and view["kv"]["used"] == 0 and view["steps"]
    assert not page.errors, page.errors


def test_the_page_is_on_for_loopback_binds_and_off_elsewhere_unless_asked():
    """--web-ui defaults to on where --host is a loopback address only; --no-web-ui turns the
    page and /debug/steps off (404, as any unknown path)."""
    from starlette.testclient import TestClient

    from luce_jax.serve import build_parser, web_ui_on
    from server.app import ServerState, create_app

    parse = build_parser().parse_args
    assert web_ui_on(parse([])) and web_ui_on(parse(["--host", "::1"]))
    assert not web_ui_on(parse(["--host", "0.0.0.0"]))
    assert web_ui_on(parse(["--host", "0.0.0.0", "--web-ui"]))
    assert not web_ui_on(parse(["--no-web-ui"]))
    off = TestClient(create_app(ServerState(model_name="m", web_ui=False)))
    assert off.get("/").status_code == 404 and off.get("/debug/steps").status_code == 404
    on = TestClient(create_app(ServerState(model_name="m", web_ui=True)))
    r = on.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert on.get("/web/app.js").status_code == 200 and on.get("/web/x.js").status_code == 404
    assert on.get("/debug/steps").status_code == 503  # the model is loading
