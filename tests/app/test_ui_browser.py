"""The real page in headless Chromium against a real server process (tiny model, local mode): two
turns, and the second one's stats on the page show the cache was reused; Stop cancels a long reply
and the session takes the next message at once; a reload opens the same session again; the retry
button on the last reply at Temperature 0 repeats the reply and keeps no fork, above 0 opens a
fork listed under the original, and deleting the fork (after the page asks, naming it) leaves only
the original; the stats table fits a 1400 px page.

Chromium is the system browser (Debian `chromium`, installed by `.ci/run`); Playwright drives it by
path and never downloads one. Without it the test is skipped with the reason shown by `-ra`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright

from app.ui import CLEAR_LABEL
from sessions.engine import Engine
from sessions.manager import SessionManager
from tests.conftest import MASTER_KEY, MODEL_CACHE, make_settings

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
START_TIMEOUT_S = 120.0
TURN_TIMEOUT_MS = 60_000
SERVE = (
    "from sessions import open_services; from app.http.server import serve; "
    "serve(open_services(), port={port}, local={local})"
)


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    home: Path
    log: Path

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 30 s; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        return self.process.returncode


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"server exited with {server.process.returncode}:\n{server.log.read_text()}")
        try:
            if httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    pytest.fail(f"server not healthy after {START_TIMEOUT_S} s:\n{server.log.read_text()}")


@pytest.fixture
def chromium() -> Path:
    """The system Chromium; the test is skipped (before a server starts) when it is missing."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} missing: chromium not installed; .ci/run installs it (apt-get install chromium)")
    return CHROMIUM


@contextlib.contextmanager
def _running_server(home: Path, model_dir: Path, log: Path, *, local: bool) -> Iterator[Server]:
    """A `serve()` subprocess on a free port, healthy; stopped (and killed if need be) on exit."""
    port = _free_port()
    env = {
        **os.environ,
        "CHATKV_HOME": str(home),
        "CHATKV_MODEL": str(model_dir),
        "CHATKV_MODEL_CACHE_DIR": str(MODEL_CACHE),
        "CHATKV_MASTER_KEY": MASTER_KEY,
        "CHATKV_THREADS": "1",
        "GRADIO_ANALYTICS_ENABLED": "False",
    }
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVE.format(port=port, local=local)],
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    running = Server(process, f"http://127.0.0.1:{port}", home, log)
    try:
        _wait_healthy(running)
        yield running
    finally:
        running.stop()


@pytest.fixture
def local_server(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Server]:
    with _running_server(tmp_path / "home", tiny_model_dir, tmp_path / "server.log", local=True) as server:
        yield server


@pytest.fixture
def keyed_server(tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine) -> Iterator[tuple[Server, dict[str, str]]]:
    """A server that asks for API keys, over a home with tenants `acme` and `beta` (one titled
    session each); yields it with their keys."""
    home = tmp_path / "home"
    keys = {}
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        for name in ("acme", "beta"):
            tenant = manager.create_tenant(name)
            manager.open_session(tenant, title=f"{name} notes")
            keys[name] = manager.issue_api_key(tenant)
    with _running_server(home, tiny_model_dir, tmp_path / "server.log", local=False) as server:
        yield server, keys


def _stats(page: Page, turn: int) -> dict[str, str]:
    """The figures of the stats line once it shows `turn` (a figure's `data-value` if it has one)."""
    page.locator(f'#turn-stats [data-stat="turn"]:text-is("{turn}")').wait_for(timeout=TURN_TIMEOUT_MS)
    figures = page.locator("#turn-stats [data-stat]")
    return {
        figures.nth(i).get_attribute("data-stat") or "": figures.nth(i).get_attribute("data-value")
        or figures.nth(i).inner_text()
        for i in range(figures.count())
    }


def _send(page: Page, text: str) -> None:
    box = page.locator("#message textarea")
    box.fill(text)
    box.press("Enter")


def _options(page: Page) -> list[str]:
    """The picker's options, each its label's name (before ` · `, after a check mark on the chosen
    one), with the tree's indent stripped; the list is closed again."""
    page.locator("#session-picker input").click()
    texts = page.get_by_role("option").all_inner_texts()
    page.keyboard.press("Escape")
    page.get_by_role("option").first.wait_for(state="hidden", timeout=TURN_TIMEOUT_MS)
    return [text.splitlines()[-1].split(" · ")[0].strip() for text in texts]


def _set_number(page: Page, elem_id: str, value: str) -> None:
    """Type `value` into a slider's number box."""
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(value)
    box.press("Enter")


def test_second_turn_in_the_browser_reuses_the_cache(chromium: Path, local_server: Server) -> None:
    server = local_server
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(server.url)
            page.locator("#message textarea").wait_for(state="visible", timeout=TURN_TIMEOUT_MS)
            assert "local" in page.locator("#tenant-line").inner_text()
            max_new_tokens = page.locator("#max-new-tokens input[type=number]")
            max_new_tokens.fill("6")
            max_new_tokens.press("Enter")

            _send(page, "Hello there")
            first = _stats(page, 1)
            _send(page, "And then?")
            second = _stats(page, 2)

            assert first["restored_from"] == "new"
            assert first["reused_tokens"] == "0"
            assert second["restored_from"] == "device"
            assert int(second["reused_tokens"]) == int(first["context_tokens"]) > 0
            assert int(second["prefill_tokens"]) < int(first["context_tokens"])
            assert float(second["ttft_ms"]) > 0
            assert page.locator("#chat").get_by_text("And then?").count() == 1
            assert page.locator("#chat-error").inner_text().strip() == ""
            # Send and the message box are usable again once the reply is done.
            assert page.locator("#send").is_enabled() and page.locator("#message textarea").is_enabled()
            # The chat's clear button says what it does: a new conversation, nothing deleted.
            assert page.locator(f'#chat button[title="{CLEAR_LABEL}"]').count() == 1
            # The stats table fits its box on a 1400 px page: the last column is inside it.
            page.get_by_text("Turn stats", exact=True).click()
            last = page.locator("#stats-table").get_by_role("columnheader", name="context tokens")
            last.wait_for(timeout=TURN_TIMEOUT_MS)
            table, column = page.locator("#stats-table").bounding_box(), last.bounding_box()
            assert table is not None and column is not None
            assert column["x"] + column["width"] <= table["x"] + table["width"]
        finally:
            browser.close()

    # SIGTERM shuts the server down cleanly (exit code 0): caches persisted, home lock released.
    assert server.stop() == 0, server.log.read_text()
    assert not (server.home / "server.lock").exists()


def test_stop_cancels_a_long_reply_and_the_session_takes_the_next_message(chromium: Path, local_server: Server) -> None:
    server = local_server
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(server.url)
            page.locator("#message textarea").wait_for(state="visible", timeout=TURN_TIMEOUT_MS)
            _set_number(page, "max-new-tokens", "6")
            _send(page, "Hello there")
            first = _stats(page, 1)

            # A long reply: the slider's largest limit, sampled at temperature 1 (the tiny model's
            # near-uniform distribution makes an early stop token very unlikely).
            limit = page.locator("#max-new-tokens input[type=number]").get_attribute("max")
            assert limit is not None and int(limit) > 1000
            _set_number(page, "max-new-tokens", limit)
            _set_number(page, "temperature", "1")
            assert not page.locator("#stop").is_visible()  # only while a reply streams
            _send(page, "Tell me a very long story")
            stop = page.locator("#stop")
            stop.wait_for(state="visible", timeout=TURN_TIMEOUT_MS)
            page.locator("#chat").get_by_text("Tell me a very long story").wait_for(timeout=TURN_TIMEOUT_MS)
            stop.click()

            note = page.locator('#reply-note [data-note="stopped"]')
            note.wait_for(timeout=TURN_TIMEOUT_MS)
            assert note.inner_text().startswith("Stopped. The partial reply was discarded")
            # Discarded: the message is back in the box, not in the conversation.
            assert page.locator("#message textarea").input_value() == "Tell me a very long story"
            assert page.locator("#chat").get_by_text("Tell me a very long story").count() == 0
            # Gradio applies the updates of one event one after another: the note can show before the
            # button hides.
            stop.wait_for(state="hidden", timeout=TURN_TIMEOUT_MS)
            assert page.locator("#send").is_enabled()

            _set_number(page, "max-new-tokens", "6")
            _send(page, "And then?")  # at once: the stopped turn left the session free and its cache as it was
            second = _stats(page, 2)
            assert page.locator("#chat-error").inner_text().strip() == ""
            assert second["restored_from"] == "device"
            assert int(second["reused_tokens"]) == int(first["context_tokens"])
            assert page.locator('#reply-note [data-note="stopped"]').count() == 0

            page.reload()  # the open session is remembered in the browser
            page.locator("#chat").get_by_text("And then?").wait_for(timeout=TURN_TIMEOUT_MS)
            assert page.locator("#session-picker input").input_value().startswith("Hello there · ")
        finally:
            browser.close()


def fill_once_hydrated(page: Any, box: Any, text: str) -> None:
    """Fill `box` and make sure the text stays: the input is visible before the page's scripts
    take it over, and their start-up resets a value typed earlier (a test types far sooner than a
    person)."""
    for _ in range(50):
        box.fill(text)
        page.wait_for_timeout(200)
        if box.input_value() == text:
            return
    raise AssertionError("the API key box never kept its text")


def test_the_page_asks_for_a_key_and_shows_only_that_tenants_sessions(
    chromium: Path, keyed_server: tuple[Server, dict[str, str]]
) -> None:
    server, keys = keyed_server
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(server.url)
            key_box = page.locator("#api-key input")
            key_box.wait_for(state="visible", timeout=TURN_TIMEOUT_MS)
            assert not page.locator("#message textarea").is_visible()
            assert "chatkv tenants create <name>" in page.locator("#login-help").inner_text()

            fill_once_hydrated(page, key_box, keys["acme"][:-4] + "AAAA")
            key_box.press("Enter")
            page.locator("#login-message .chatkv-error").wait_for(timeout=TURN_TIMEOUT_MS)
            assert page.locator("#login-message").inner_text().strip() == "unknown API key"

            key_box.fill(keys["acme"])
            key_box.press("Enter")
            page.locator("#message textarea").wait_for(state="visible", timeout=TURN_TIMEOUT_MS)
            assert "acme" in page.locator("#tenant-line").inner_text()
            page.locator("#session-picker input").click()
            options = [text.split(" · ")[0] for text in page.get_by_role("option").all_inner_texts()]
            assert options == ["acme notes"]
        finally:
            browser.close()


def test_retry_on_the_last_reply_opens_a_fork_and_keeps_the_original(chromium: Path, local_server: Server) -> None:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(local_server.url)
            page.locator("#message textarea").wait_for(state="visible", timeout=TURN_TIMEOUT_MS)
            _set_number(page, "max-new-tokens", "6")
            _send(page, "Hello there")
            _stats(page, 1)

            retry = page.locator('#chat button[aria-label="Retry"]')
            retry.click()
            # Greedy decoding gives the same reply again: the page says so and keeps no fork.
            page.locator('#reply-note [data-note="same"]').wait_for(timeout=TURN_TIMEOUT_MS)
            assert page.locator("#session-picker input").input_value().startswith("Hello there · ")
            assert page.locator("#chat-error").inner_text().strip() == ""
            assert _options(page) == ["Hello there"]

            # Sampled: another reply, on a fork listed under the original by its own reply.
            _set_number(page, "temperature", "1")
            retry.click()
            fork_label = "↳ fork at turn 1: new reply “"
            picker = page.locator("#session-picker input")
            page.wait_for_function(
                "prefix => document.querySelector('#session-picker input').value.trim().startsWith(prefix)",
                arg=fork_label,
                timeout=TURN_TIMEOUT_MS,
            )
            assert picker.input_value().startswith(f"\u2003{fork_label}")  # indented under its parent
            options = _options(page)
            assert options[0] == "Hello there" and options[1].startswith(fork_label) and len(options) == 2

            # Delete the fork (open): the question names it, and the original that stays.
            page.locator("#delete-session").click()
            question = page.locator("#delete-question")
            question.wait_for(state="visible", timeout=TURN_TIMEOUT_MS)
            assert question.inner_text().startswith(f"Delete the {fork_label[2:]}")
            assert "“Hello there”, the session it was forked from, stays as it is." in question.inner_text()
            page.locator("#confirm-delete").click()
            page.locator("#delete-panel").wait_for(state="hidden", timeout=TURN_TIMEOUT_MS)
            assert page.locator("#session-info").inner_text().startswith("Deleted session s_")
            assert _options(page) == ["Hello there"]
        finally:
            browser.close()
