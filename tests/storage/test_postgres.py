"""The whole storage stack under a `SessionManager` on each database: tenants with wrapped keys,
exact token ids, cache blob rows and a warm restart, then crypto-shredding a tenant. Runs on SQLite
and, when `CHATKV_TEST_POSTGRES_URL` answers, on a fresh PostgreSQL schema."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import inspect

from sessions.engine import Engine
from sessions.manager import SessionManager
from storage.database import make_engine
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
        assert {r.name for r in manager.metadata.list_blobs()} >= {sid, other}
        history = manager.history(acme.id, sid)
        assert [m.token_ids for m in history][1] == first.token_ids
        assert manager.session_info(acme.id, sid).title == "ünïcödé ✓"
        reply = manager.chat(acme.id, sid, "note 1", max_new_tokens=4)
        assert reply.stats.restored_from == "disk"
        manager.delete_tenant(acme.id)
        assert {r.tenant_id for r in manager.metadata.list_blobs()} == {beta.id}
        assert [t.name for t in manager.list_tenants()] == ["beta"]
    engine = make_engine(db_url)
    try:
        assert "cache_blobs" in inspect(engine).get_table_names()
    finally:
        engine.dispose()
