"""The admin CLI for retention, forks and per-tenant counters: offline on a home, and with
`--server` answered by the admin API over a live manager in this process (a `TestClient` in place
of the HTTP connection, so the server's turn counters and clock are the test's)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import update

from app.cli.admin_client import AdminClient
from app.http.admin_api import admin_router
from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.records import Reply
from storage.database import open_database
from storage.schema import SessionRow
from tests.app.test_cli import Cli, assert_one_line_error
from tests.conftest import MASTER_KEY, MODEL_CACHE, cli_environment, make_settings

TOKEN = "cli-live-token"
SERVER = ("--server", "http://chatkv.test", "--admin-token", TOKEN)
SYSTEM = "You are terse."
DAY_S = 86400.0


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def cli(home: Path, tiny_model_dir: Path) -> Cli:
    return Cli(
        cli_environment(
            CHATKV_HOME=str(home),
            CHATKV_MODEL=str(tiny_model_dir),
            CHATKV_MODEL_CACHE_DIR=str(MODEL_CACHE),
            CHATKV_MASTER_KEY=MASTER_KEY,
        )
    )


@pytest.fixture
def served(home: Path, tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[SessionManager]:
    """A live manager on `home` whose admin API answers the CLI's `--server` (see `SERVER`)."""
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        api = FastAPI()
        api.include_router(admin_router(manager, TOKEN), prefix="/admin")

        def connect(cls: type[AdminClient], base_url: str, token: str, **_: Any) -> AdminClient:
            http = TestClient(api, base_url=base_url, headers={"Authorization": f"Bearer {token}"})
            return cls(http)  # type: ignore[arg-type]  # an httpx.Client

        monkeypatch.setattr(AdminClient, "connect", classmethod(connect))
        yield manager


def implicit_session(manager: SessionManager, tenant: str, message: str) -> str:
    turn = manager.continue_history(tenant, SYSTEM, [], message, max_new_tokens=4)
    assert isinstance(list(turn)[-1], Reply) and turn.session_id is not None
    return turn.session_id


def offline(cli: Cli, home: Path, *args: str) -> str:
    """Run a command that must not load the model (the model path names nothing)."""
    result = cli(*args, CHATKV_MODEL=str(home / "no-model"))
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr)
    return result.stdout


# -- chatkv stats ------------------------------------------------------------------------------


def test_stats_show_each_tenants_prompt_tokens_by_name_and_forks_by_source(cli: Cli, served: SessionManager) -> None:
    acme, globex = served.create_tenant("acme"), served.create_tenant("globex")
    replies: dict[str, list[Reply]] = {acme.id: [], globex.id: []}
    sid = served.open_session(acme, SYSTEM)
    for message in ("Hello", "Again"):
        replies[acme.id].append(served.chat(acme, sid, message, max_new_tokens=4))
    fork = served.fork(acme, sid, 1)
    replies[acme.id].append(served.chat(acme, fork, "Something else", max_new_tokens=4))
    replies[globex.id].append(served.chat(globex, served.open_session(globex, SYSTEM), "Hi", max_new_tokens=4))

    stats = cli.json(*SERVER, "stats")
    assert stats["tenants"] == 2 and stats["forks"] == {"device": 1.0}
    for tenant in (acme, globex):
        cached = sum(r.stats.reused_tokens for r in replies[tenant.id])
        prefilled = sum(r.stats.prefill_tokens for r in replies[tenant.id])
        assert stats["prompt_tokens_by_tenant"][tenant.id] == {
            "tenant": tenant.name,
            "cached_tokens": cached,
            "prefilled_tokens": prefilled,
            "hit_rate_tokens": cached / (cached + prefilled),
        }
    plain = cli.ok(*SERVER, "stats").stdout
    assert re.search(r"^forks by source +device 1$", plain, re.MULTILINE), plain
    assert "prompt tokens by tenant" in plain
    for tenant in (acme, globex):
        t = stats["prompt_tokens_by_tenant"][tenant.id]
        row = rf"^ *{tenant.name} +{t['cached_tokens']} +{t['prefilled_tokens']} +{t['hit_rate_tokens']:.1%} *$"
        assert re.search(row, plain, re.MULTILINE), plain


def test_stats_count_the_write_back_copies_on_disk_apart_from_the_sessions_placed_there(
    cli: Cli, served: SessionManager
) -> None:
    tenant = served.create_tenant("acme")
    for _ in range(2):
        served.chat(tenant, served.open_session(tenant, SYSTEM), "Hello", max_new_tokens=4)
    served.internals.tiers.flush()  # the write-back stored both caches on disk; both stay placed on the device
    stats = cli.json(*SERVER, "stats")
    disk, device = stats["tiers"]["disk"], stats["tiers"]["device"]
    assert (device["sessions"], device["copies"]) == (2, 0)
    assert (disk["sessions"], disk["copies"]) == (0, 2) and disk[
        "bytes"
    ] == served.internals.disk_store.used_bytes() > 0
    plain = cli.ok(*SERVER, "stats").stdout
    assert re.search(rf"^ *disk +0 +2 +{disk['bytes']} +{disk['budget_bytes']} ", plain, re.MULTILINE), plain
    assert re.search(r"^ *tier +sessions +\+ copies +bytes +budget +used *$", plain, re.MULTILINE), plain
    assert (
        "sessions: placed in the tier; + copies: write-back copies of sessions placed higher; "
        "bytes: both, and base layers\n"
    ) in plain


# -- chatkv tenants retention ------------------------------------------------------------------


def test_a_tenants_retention_is_set_shown_and_cleared_offline(cli: Cli, home: Path) -> None:
    cli.ok("tenants", "create", "acme")
    week = cli(*("tenants", "retention", "acme", "7d", "--json"), CHATKV_MODEL=str(home / "no-model"))
    assert week.exit_code == 0, week.stderr
    assert json.loads(week.stdout)["implicit_retention_s"] == 7 * DAY_S
    assert json.loads(offline(cli, home, "tenants", "show", "acme", "--json"))["implicit_retention_s"] == 7 * DAY_S
    assert re.search(
        r"^retention +implicit sessions 7d idle \(the tenant's own\)$",
        offline(cli, home, "tenants", "show", "acme"),
        re.M,
    )

    assert (
        offline(cli, home, "tenants", "retention", "acme", "default")
        == "acme: implicit sessions 30d idle (the default)\n"
    )
    shown = cli("tenants", "show", "acme", CHATKV_IMPLICIT_RETENTION_S="12h", CHATKV_MODEL=str(home / "no-model"))
    assert "implicit sessions 12h idle (the default)" in shown.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("acme", "soon"), "error: not a duration: 'soon' (examples: 90, 30m, 12h, 7d), or 'default'"),
        (("acme", "0"), "error: a retention must be in (0, 100 years] seconds, got 0"),
        (("acme", "99999999999d"), "error: duration too long"),
        (("nobody", "7d"), "error: tenant not found: nobody"),
        (("acme",), "error: Missing argument 'DURATION|default'"),
    ],
)
def test_a_bad_retention_exits_2_with_one_line(cli: Cli, home: Path, args: tuple[str, ...], message: str) -> None:
    cli.ok("tenants", "create", "acme")
    result = cli("tenants", "retention", *args, CHATKV_MODEL=str(home / "no-model"))
    assert assert_one_line_error(result).startswith(message)
    assert cli.json("tenants", "show", "acme")["implicit_retention_s"] is None


def test_a_tenants_retention_through_the_server_applies_at_its_next_sweep(cli: Cli, served: SessionManager) -> None:
    served.create_tenant("acme")
    sid = implicit_session(served, "acme", "Hello")
    assert (
        cli.ok(*SERVER, "tenants", "retention", "acme", "1h").stdout
        == "acme: implicit sessions 1h idle (the tenant's own)\n"
    )
    record = served.internals.metadata.get_tenant(tenant_id=served.get_tenant("acme").id)
    assert record is not None and record.implicit_retention_s == 3600.0
    for args, message in (
        (("acme", "soon"), "not a duration"),
        (("acme", "0"), "a retention must be in"),
        (("x", "1h"), "tenant not found: x"),
    ):
        assert message in assert_one_line_error(cli(*SERVER, "tenants", "retention", *args))

    served.internals.histories.retention.clock = lambda: (
        datetime.now(UTC) + timedelta(hours=1)
    )  # an hour idle, for the server
    dry = cli.json(*SERVER, "gc", "--dry-run")
    assert [s["id"] for s in dry["expired_implicit_sessions"]] == [sid] and served.list_sessions("acme")
    report = cli.json(*SERVER, "gc")
    assert [(s["id"], s["tenant"]) for s in report["expired_implicit_sessions"]] == [(sid, "acme")]
    assert served.list_sessions("acme") == []


# -- chatkv gc ---------------------------------------------------------------------------------


def test_gc_expires_implicit_sessions_and_keeps_explicit_ones(cli: Cli, home: Path, tiny_engine: Engine) -> None:
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        manager.create_tenant("acme")
        implicit = implicit_session(manager, "acme", "Hello")
        explicit = manager.open_session("acme", SYSTEM)
        manager.chat("acme", explicit, "Hello", max_new_tokens=4)
    engine = open_database(f"sqlite:///{home / 'chatkv.db'}")
    with engine.begin() as db:
        month_ago = datetime.now(UTC) - timedelta(days=31)
        db.execute(update(SessionRow).values(last_active_at=month_ago))  # both idle longer than 30d
    engine.dispose()

    dry = cli.json("gc", "--dry-run")
    assert [s["id"] for s in dry["expired_implicit_sessions"]] == [implicit]
    assert dry["implicit_retention_s"] == 30 * DAY_S and len(cli.json("sessions", "list")) == 2
    report = cli.ok("gc").stdout
    assert (
        "removed 1 implicit session or uncontinued forks idle longer than their tenant's retention (default 30d)"
        in report
    )
    assert f"  {implicit}  tenant acme  last active " in report
    assert "no retention set (CHATKV_SESSION_RETENTION_S, e.g. 30d): other sessions are kept" in report
    assert [s["id"] for s in cli.json("sessions", "list")] == [explicit]
    assert not list((home / "blobs").rglob(f"{implicit}.ckv"))
    assert "removed 0 implicit sessions" in cli.ok("gc").stdout


# -- sessions list and inspect -----------------------------------------------------------------


def test_list_and_inspect_show_name_origin_and_fork(cli: Cli, home: Path, tiny_engine: Engine) -> None:
    with SessionManager(make_settings(home), engine=tiny_engine) as manager:
        manager.create_tenant("acme")
        named = manager.open_session("acme", SYSTEM, name="support-42")
        for message in ("Hello", "Again"):
            manager.chat("acme", named, message, max_new_tokens=4)
        fork = manager.fork("acme", named, 1)
        implicit = implicit_session(manager, "acme", "Hi")

    listed = {s["id"]: s for s in cli.json("sessions", "list")}
    assert {sid: (s["name"], s["origin"], s["parent_id"], s["fork_turns"]) for sid, s in listed.items()} == {
        named: ("support-42", "named", None, None),
        fork: (None, "fork", named, 1),
        implicit: (None, "implicit", None, None),
    }
    table = cli.ok("sessions", "list").stdout
    assert re.search(rf"^ *{named} +acme +support-42 +named ", table, re.MULTILINE), table
    # A fork is listed by where it comes from, whichever face made it (its origin may be `implicit`).
    assert re.search(rf"^ *{fork} +acme +- +fork of {named} at turn 2 ", table, re.MULTILINE), table

    detail = cli.json("sessions", "inspect", fork, "--tenant", "acme")["session"]
    assert (detail["origin"], detail["parent_id"], detail["fork_turns"], detail["name"]) == ("fork", named, 1, None)
    last_active = datetime.fromisoformat(detail["last_active_at"])
    assert datetime.fromisoformat(detail["expires_at"]) == last_active + timedelta(days=30)
    plain = cli.ok("sessions", "inspect", fork, "--tenant", "acme").stdout
    assert re.search(rf"^origin +fork of {named} at turn 2$", plain, re.MULTILINE), plain
    assert re.search(r"^expires +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d if idle$", plain, re.MULTILINE), plain

    named_plain = cli.ok("sessions", "inspect", "support-42", "--tenant", "acme").stdout
    assert re.search(r"^name +support-42$", named_plain, re.MULTILINE), named_plain
    assert re.search(r"^origin +named \(its client chose the id\)$", named_plain, re.MULTILINE), named_plain
    assert re.search(r"^expires +no idle TTL \(explicit, named or a continued fork\)$", named_plain, re.MULTILINE), (
        named_plain
    )
    assert cli.json("sessions", "inspect", implicit, "--tenant", "acme")["session"]["expires_at"] is not None
