"""The whole storage stack under a `SessionManager` on each database: tenants with wrapped keys,
exact token ids, cache blob rows and a warm restart, then crypto-shredding a tenant. Runs on SQLite
and, when `CHATKV_TEST_POSTGRES_URL` answers, on a fresh PostgreSQL schema."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import inspect

from app.http.admin_api import admin_router
from sessions.admin import AdminOps
from sessions.engine import Engine
from sessions.errors import ChatKVError, InvalidInput, SessionNotFound, TenantNotFound
from sessions.manager import SessionManager
from storage.database import open_database
from tests.conftest import make_settings


def open_manager(home: Path, engine: Engine, db_url: str) -> SessionManager:
    return SessionManager(make_settings(home, database_url=db_url, persist="on_evict"), engine=engine)


def test_sessions_resume_warm_and_tenants_are_shredded(db_url: str, tmp_path: Path, tiny_engine: Engine) -> None:
    home = tmp_path / "home"
    with open_manager(home, tiny_engine, db_url) as manager:
        acme, beta = manager.create_tenant("acme"), manager.create_tenant("beta")
        sid = manager.open_session(acme, system_prompt="You are terse.", title="ünïcödé ✓")
        other = manager.open_session(beta, system_prompt="You are terse.")
        first = manager.chat(acme, sid, "note 0", max_new_tokens=4)
        manager.chat(beta, other, "note 0", max_new_tokens=4)
    with open_manager(home, tiny_engine, db_url) as manager:
        assert {r.name for r in manager.internals.metadata.list_blobs(location=None)} >= {sid, other}
        history = manager.history(acme.id, sid)
        assert [m.token_ids for m in history][1] == first.token_ids
        assert manager.session_info(acme.id, sid).title == "ünïcödé ✓"
        reply = manager.chat(acme.id, sid, "note 1", max_new_tokens=4)
        assert reply.stats.restored_from == "disk"
        manager.delete_tenant(acme.id)
        assert {r.tenant_id for r in manager.internals.metadata.list_blobs(location=None)} == {beta.id}
        assert [t.name for t in manager.list_tenants()] == ["beta"]
    engine = open_database(db_url)
    try:
        assert "cache_blobs" in inspect(engine).get_table_names()
    finally:
        engine.dispose()


def test_a_nul_character_is_refused_before_any_work_and_alike_on_every_database(
    db_url: str, tmp_path: Path, tiny_engine: Engine
) -> None:
    """PostgreSQL cannot store U+0000 in text, SQLite can: text with one is `InvalidInput` before the
    model runs, and an id or a tenant name with one names nothing, on both."""
    home = tmp_path / "home"
    with open_manager(home, tiny_engine, db_url) as manager:
        acme = manager.create_tenant("acme")
        sid = manager.open_session(acme)
        refused: list[tuple[Callable[[], object], type[ChatKVError], str]] = [
            (lambda: manager.chat(acme, sid, "a\x00b", max_new_tokens=2), InvalidInput, "message contains a NUL"),
            (lambda: manager.open_session(acme, title="a\x00b"), InvalidInput, "title contains a NUL"),
            (lambda: manager.open_session(acme, system_prompt="\x00"), InvalidInput, "system_prompt contains a NUL"),
            (lambda: manager.create_tenant("acme\x00"), InvalidInput, "invalid tenant name"),
            (lambda: manager.chat(acme, "s\x00x", "hi", max_new_tokens=2), SessionNotFound, "session not found"),
            (lambda: manager.history(acme, sid + "\x00"), SessionNotFound, "session not found"),
            (lambda: manager.session_info(acme, "s\x00x"), SessionNotFound, "session not found"),
            (lambda: manager.delete_session(acme, "s\x00x"), SessionNotFound, "session not found"),
            (lambda: manager.get_tenant("acme\x00"), TenantNotFound, "tenant not found"),
            (lambda: manager.list_sessions("acme\x00"), TenantNotFound, "tenant not found"),
            (lambda: manager.chat("acme\x00", sid, "hi", max_new_tokens=2), TenantNotFound, "tenant not found"),
        ]
        for call, error, message in refused:
            with pytest.raises(error, match=message):
                call()
        assert manager.stats()["prefill_tokens"] == 0  # the model never ran
        assert [s.id for s in manager.list_sessions(acme)] == [sid] and manager.history(acme, sid) == []

        app = FastAPI()
        app.include_router(admin_router(manager, "t0ken"), prefix="/admin")
        with TestClient(app, headers={"Authorization": "Bearer t0ken"}) as client:
            answers = [
                (client.get("/admin/sessions/s%00x", params={"tenant": "acme"}), 404, "session not found: 's\\x00x'"),
                (client.get("/admin/sessions/s%00x/export", params={"tenant": "acme"}), 404, "session not found"),
                (client.delete("/admin/sessions/s%00x", params={"tenant": "acme"}), 404, "session not found"),
                (client.get("/admin/sessions?tenant=acme%00"), 404, "tenant not found: 'acme\\x00'"),
                (client.get("/admin/tenants/acme%00"), 404, "tenant not found"),
                (client.post("/admin/tenants", json={"name": "a\x00b"}), 400, "invalid tenant name"),
            ]
            for response, status, message in answers:
                assert response.status_code == status and response.json()["error"].startswith(message)

    with AdminOps.open_home(make_settings(home, database_url=db_url)) as ops:  # the CLI without a server
        with pytest.raises(TenantNotFound):
            ops.show_tenant("acme\x00")
        with pytest.raises(TenantNotFound):
            ops.list_sessions(tenant="acme\x00")
        with pytest.raises(SessionNotFound):
            ops.export_session("acme", "s\x00x")
