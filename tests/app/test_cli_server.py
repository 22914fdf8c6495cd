"""The `chatkv` CLI as real processes against a real `chatkv serve` process: a tiny model, a temporary
home that a test-process manager filled and closed (its caches persisted to disk), a free port, and the
admin token the server generated into its home."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import update

from sessions.engine import Engine
from sessions.manager import SessionManager
from storage.database import open_database
from storage.schema import SessionRow
from tests.conftest import MASTER_KEY, MODEL_CACHE, make_settings

CHATKV = Path(sys.executable).with_name("chatkv")
START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Server:
    url: str
    home: Path
    pid: int
    session_id: str
    empty_session_id: str
    """A session without turns, so without a cache."""
    expired_session_id: str
    """An implicit session idle for 31 days when the server started: its first sweep deletes it."""
    env: dict[str, str]
    """The CLI's environment: the server's home, no admin token (it is read from the home)."""
    log: Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_until_up(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"chatkv serve exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"chatkv serve did not answer within {START_TIMEOUT_S} s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_engine: Engine) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("cli-server")
    home = root / "home"
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        session_id = manager.open_session(tenant, system_prompt="You are terse.")
        manager.chat(tenant, session_id, "Hello", max_new_tokens=6)
        empty_session_id = manager.open_session(tenant)
        posted = manager.continue_history(tenant, "You are terse.", [], "Hello", max_new_tokens=4)
        list(posted)
        assert posted.session_id is not None
        expired_session_id = posted.session_id
    database = open_database(f"sqlite:///{home / 'chatkv.db'}")
    with database.begin() as db:
        month_ago = datetime.now(UTC) - timedelta(days=31)
        db.execute(update(SessionRow).where(SessionRow.id == expired_session_id).values(last_active_at=month_ago))
    database.dispose()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("CHATKV_")}
    env = {
        **base_env,
        "CHATKV_HOME": str(home),
        "CHATKV_MODEL": str(tiny_model_dir),
        "CHATKV_MODEL_CACHE_DIR": str(MODEL_CACHE),
        "CHATKV_MASTER_KEY": MASTER_KEY,
        "GRADIO_ANALYTICS_ENABLED": "False",
    }
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = root / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen([str(CHATKV), "serve", "--port", str(port)], env=env, stdout=out, stderr=out)
    try:
        _wait_until_up(url, process, log)
        yield Server(url, home, process.pid, session_id, empty_session_id, expired_session_id, env, log)
    finally:
        process.send_signal(signal.SIGTERM)  # uvicorn shuts down; `serve` closes the manager and the lock
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    # A requested shutdown is a success; caches persisted and the lock released.
    assert process.returncode == 0, log.read_text()
    assert not (home / "server.lock").exists(), log.read_text()
    # The operator sees the shutdown in the log, not just the process gone.
    assert [line.split(" ", 1)[1] for line in log.read_text().splitlines()[-2:]] == [
        "INFO app.http.server: chatkv stopping: finishing the turns in flight, then persisting caches",
        "INFO app.http.server: chatkv stopped",
    ], log.read_text()


def chatkv(server: Server, *args: str, via_server: bool = True) -> subprocess.CompletedProcess[str]:
    command = [str(CHATKV), *(("--server", server.url) if via_server else ()), *args]
    return subprocess.run(command, env=server.env, capture_output=True, text=True, timeout=120)


def ok(server: Server, *args: str) -> str:
    result = chatkv(server, *args)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    return result.stdout


def as_json(server: Server, *args: str) -> Any:
    return json.loads(ok(server, *args, "--json"))


def one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ")
    return line


def metrics(server: Server) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def test_the_server_generated_its_admin_token_into_its_home(server: Server) -> None:
    token_file = server.home / "admin.token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert len(token_file.read_text().strip()) >= 32
    assert "chatkv serving" in server.log.read_text() and f"(admin token in {token_file})" in server.log.read_text()


def test_serve_on_a_taken_port_fails_at_once(server: Server, tmp_path: Path) -> None:
    port = server.url.rsplit(":", 1)[1]
    started = time.monotonic()
    taken = subprocess.run(
        [str(CHATKV), "serve", "--port", port],
        env={**server.env, "CHATKV_HOME": str(tmp_path / "other-home")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert one_line_error(taken, 1) == f"error: port {port} on 127.0.0.1 is in use (is `make run` still running?)"
    assert time.monotonic() - started < 30  # no model was loaded
    assert not (tmp_path / "other-home").exists()


def test_serve_on_a_home_held_by_a_server_says_so(server: Server) -> None:
    held = subprocess.run(
        [str(CHATKV), "serve", "--port", str(_free_port())], env=server.env, capture_output=True, text=True, timeout=120
    )
    assert one_line_error(held, 2) == (
        f"error: the chatkv server at {server.url} (pid {server.pid}, chatkv serve) holds this home; "
        f"stop it or use another CHATKV_HOME (if pid {server.pid} is not a chatkv process, "
        f"delete {server.home / 'server.lock'})"
    )


def test_evicting_a_hot_session_frees_the_servers_device(server: Server) -> None:
    sid = server.session_id

    def tier() -> str | None:
        [session] = [s for s in as_json(server, "sessions", "list", "--tenant", "acme") if s["id"] == sid]
        return session["tier"]

    assert tier() == "disk"  # the server adopted the cache its predecessor persisted
    assert ok(server, "sessions", "restore", sid, "--tenant", "acme").startswith(f"{sid}: device (from disk,")
    assert tier() == "device"
    before = metrics(server)
    assert before[("chatkv_tier_sessions", frozenset({("tier", "device")}))] == 1

    assert ok(server, "sessions", "evict", sid, "--tenant", "acme", "--to", "disk") == f"{sid}: disk\n"
    empty = server.empty_session_id
    nothing = ok(server, "sessions", "restore", empty, "--tenant", "acme")
    assert nothing == f"{empty}: nothing stored; the next turn rebuilds it from the transcript\n"
    assert tier() == "disk"
    after = metrics(server)
    assert after[("chatkv_tier_sessions", frozenset({("tier", "device")}))] == 0
    assert after[("chatkv_tier_sessions", frozenset({("tier", "disk")}))] == 1
    moves = "chatkv_evictions_total"
    # The version restored from disk is still stored there: the eviction goes straight to disk.
    assert after[(moves, frozenset({("source", "device"), ("target", "disk")}))] == 1
    detail = as_json(server, "sessions", "inspect", sid, "--tenant", "acme")
    assert detail["session"]["tier"] == "disk" and [row["turn_index"] for row in detail["layers"]] == [None, 0]


def test_the_server_expires_idle_implicit_sessions_by_itself(server: Server) -> None:
    """The sweep runs when the server starts, then every 10 minutes."""
    deadline = time.monotonic() + 30
    while server.expired_session_id in {s["id"] for s in as_json(server, "sessions", "list")}:
        assert time.monotonic() < deadline, "the server did not expire the implicit session"
        time.sleep(0.5)
    assert server.session_id in {s["id"] for s in as_json(server, "sessions", "list")}  # explicit: kept


def test_admin_commands_through_the_server(server: Server) -> None:
    created = as_json(server, "tenants", "create", "globex")
    assert created["api_key"].startswith(f"ckv_{created['id']}_")
    assert {t["name"] for t in as_json(server, "tenants", "list")} >= {"acme", "globex"}
    assert as_json(server, "tenants", "show", "globex")["sessions"] == 0
    assert (
        ok(server, "tenants", "retention", "globex", "7d") == "globex: implicit sessions 7d idle (the tenant's own)\n"
    )
    assert as_json(server, "tenants", "show", "globex")["implicit_retention_s"] == 7 * 86400
    bad = one_line_error(chatkv(server, "tenants", "retention", "globex", "0"), 2)
    assert bad == "error: a retention must be in (0, 100 years] seconds, got 0.0"
    assert as_json(server, "tenants", "rotate-api-key", "globex")["api_key"] != created["api_key"]

    exported = json.loads(ok(server, "sessions", "export", server.session_id, "--tenant", "acme"))
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    assert exported["messages"][0]["text"] == "Hello"
    shown = ok(server, "sessions", "show", server.session_id, "--tenant", "acme")
    assert shown.startswith(f"session {server.session_id} (tenant acme), 1 turn, cache ")
    assert "\n[user · " in shown and "]\nHello\n\n[assistant · " in shown
    stats = as_json(server, "stats")
    assert stats["tenants"] >= 2 and set(stats["tiers"]) == {"device", "host", "disk"}
    assert stats["live"] is True and stats["prefill_tokens"] >= 0
    assert "cache hit rate" in ok(server, "stats") and "note:" not in ok(server, "stats")
    assert as_json(server, "gc", "--dry-run")["expired_sessions"] == []

    assert "deleted tenant globex" in ok(server, "tenants", "delete", "globex", "--yes")
    assert "globex" not in {t["name"] for t in as_json(server, "tenants", "list")}


def test_errors_through_the_server_are_one_line(server: Server) -> None:
    missing = chatkv(server, "sessions", "inspect", "s_missing", "--tenant", "acme")
    assert one_line_error(missing, 2) == "error: session not found: s_missing"
    assert one_line_error(chatkv(server, "tenants", "show", "nobody"), 2) == "error: tenant not found: nobody"
    wrong = chatkv(server, "--admin-token", "wrong", "tenants", "list")
    assert one_line_error(wrong, 2) == "error: missing or wrong admin token"
    bad_flag = chatkv(server, "sessions", "evict", server.session_id, "--tenant", "acme", "--to", "moon")
    assert one_line_error(bad_flag, 2) == "error: --to must be host, disk or drop"
    nobody = f"http://127.0.0.1:{_free_port()}"
    closed = subprocess.run(
        [str(CHATKV), "--server", nobody, "tenants", "list"],
        env=server.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert one_line_error(closed, 1).startswith(f"error: the server at {nobody} cannot be reached: ")


def test_commands_without_server_refuse_while_it_runs(server: Server) -> None:
    for args in (("tenants", "list"), ("sessions", "evict", server.session_id, "--tenant", "acme", "--to", "drop")):
        line = one_line_error(chatkv(server, *args, via_server=False), 2)
        assert f"pid {server.pid}" in line and server.url in line and "--server" in line


def test_server_option_after_the_subcommand(server: Server) -> None:
    """`chatkv sessions list --tenant acme --server URL` works like `chatkv --server URL sessions list ...`
    (without a server the home is refused: a server holds it), and wins over the global option."""
    before = as_json(server, "sessions", "list", "--tenant", "acme")
    after = chatkv(server, "sessions", "list", "--tenant", "acme", "--json", "--server", server.url, via_server=False)
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout) == before
    unreachable = f"http://127.0.0.1:{_free_port()}"
    wins = chatkv(server, "--server", unreachable, "stats", "--json", "--server", server.url, via_server=False)
    assert wins.returncode == 0, wins.stderr
    assert json.loads(wins.stdout)["live"] is True
    for args in (("tenants", "list"), ("sessions", "restore", server.empty_session_id, "--tenant", "acme")):
        result = chatkv(server, *args, "--server", server.url, via_server=False)
        assert result.returncode == 0, (args, result.stderr)
    assert "--server" in chatkv(server, "sessions", "list", "--help", via_server=False).stdout
