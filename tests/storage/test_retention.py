"""Retention of implicit sessions and uncontinued forks (`sessions/retention.py`) under a
controlled clock, with a `SessionManager` on SQLite and, when `CHATKV_TEST_POSTGRES_URL` answers,
PostgreSQL: what expires, what a turn, a tenant's override or a turn in flight keeps, and that
expiry leaves no cache in any tier."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cache.ids import SessionId, TenantId
from cache.tiers import CacheKey
from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.records import Reply
from storage.history_store import HistoryStore
from storage.schema import utcnow
from tests.conftest import make_settings

TTL_S = 3600.0
SYSTEM = "You are terse."
TOKENS = 4


def open_manager(home: Path, engine: Engine, db_url: str, **overrides: Any) -> SessionManager:
    settings = make_settings(home, database_url=db_url, implicit_retention_s=TTL_S, **overrides)
    return SessionManager(settings, engine=engine)


def implicit_session(manager: SessionManager, tenant: str, message: str) -> SessionId:
    """A session made for a posted history (a stateless client's first message), one turn long."""
    turn = manager.continue_history(tenant, SYSTEM, [], message, max_new_tokens=TOKENS)
    assert isinstance(list(turn)[-1], Reply) and turn.action == "new" and turn.session_id is not None
    return turn.session_id


def explicit_session(manager: SessionManager, tenant: str, name: str | None = None) -> SessionId:
    sid = manager.open_session(tenant, SYSTEM, name=name)
    manager.chat(tenant, sid, "Hello", max_new_tokens=TOKENS)
    return sid


def due_at(manager: SessionManager, moment: datetime) -> set[str]:
    manager.internals.histories.retention.clock = lambda: moment
    return {expired.session_id for expired in manager.internals.histories.retention.due()}


def key_of(tenant_id: str, session_id: str) -> CacheKey:
    return CacheKey.for_session(TenantId(tenant_id), SessionId(session_id))


def test_implicit_sessions_and_uncontinued_forks_expire_and_a_turn_keeps_one(
    db_url: str, tmp_path: Path, tiny_engine: Engine
) -> None:
    with open_manager(tmp_path / "home", tiny_engine, db_url) as manager:
        acme = manager.create_tenant("acme").id
        explicit = explicit_session(manager, acme)
        named = explicit_session(manager, acme, name="support-42")
        implicit = implicit_session(manager, acme, "Hi there")
        touched = implicit_session(manager, acme, "Hello again")
        uncontinued = manager.fork(acme, explicit, 1)
        continued = manager.fork(acme, explicit, 0)
        manager.chat(acme, continued, "Something else", max_new_tokens=TOKENS)
        assert {s.id: s.origin for s in manager.list_sessions(acme)} == {
            explicit: "explicit",
            named: "named",
            implicit: "implicit",
            touched: "implicit",
            uncontinued: "fork",
            continued: "fork",
        }
        before_touch = utcnow()
        manager.chat(acme, touched, "Still there?", max_new_tokens=TOKENS)

        assert due_at(manager, before_touch + timedelta(seconds=TTL_S - 1)) == set()  # not idle long enough
        assert due_at(manager, before_touch + timedelta(seconds=TTL_S)) == {implicit, uncontinued}
        assert manager.expire_sessions() == 2
        assert {s.id for s in manager.list_sessions(acme)} == {explicit, named, touched, continued}

        assert due_at(manager, utcnow() + timedelta(seconds=TTL_S)) == {touched}  # its TTL slid with the turn
        assert manager.expire_sessions() == 1
        manager.internals.histories.retention.clock = lambda: utcnow() + timedelta(days=3650)
        assert manager.expire_sessions() == 0
        assert {s.id for s in manager.list_sessions(acme)} == {explicit, named, continued}


def test_a_tenants_own_retention_wins_over_the_default(db_url: str, tmp_path: Path, tiny_engine: Engine) -> None:
    with open_manager(tmp_path / "home", tiny_engine, db_url) as manager:
        sessions = {}
        for name in ("acme", "globex", "initech"):
            manager.create_tenant(name)
            sessions[name] = implicit_session(manager, name, f"Hello from {name}")
        manager.set_tenant_retention("globex", 10 * TTL_S)
        manager.set_tenant_retention("initech", TTL_S / 6)
        created = utcnow()

        assert due_at(manager, created + timedelta(seconds=TTL_S / 2)) == {sessions["initech"]}
        assert due_at(manager, created + timedelta(seconds=TTL_S)) == {sessions["acme"], sessions["initech"]}
        assert due_at(manager, created + timedelta(seconds=10 * TTL_S)) == set(sessions.values())
        manager.set_tenant_retention("globex", None)  # back to the default
        assert due_at(manager, created + timedelta(seconds=TTL_S)) == set(sessions.values())


def test_expiry_removes_the_cache_from_every_tier(db_url: str, tmp_path: Path, tiny_engine: Engine) -> None:
    with open_manager(tmp_path / "home", tiny_engine, db_url) as manager:
        tenant = manager.create_tenant("acme").id
        placed = {tier: implicit_session(manager, tenant, f"Hello, {tier}") for tier in ("device", "host", "disk")}
        manager.internals.tiers.flush()  # every cache is on disk as well now (write-back)
        manager.evict_session(tenant, placed["host"], "host")
        manager.evict_session(tenant, placed["disk"], "disk")
        assert {tier: manager.session_info(tenant, sid).tier for tier, sid in placed.items()} == {
            "device": "device",
            "host": "host",
            "disk": "disk",
        }
        files = {sid: manager.internals.disk_store.path_for(key_of(tenant, sid)) for sid in placed.values()}
        assert files[placed["disk"]].exists()

        manager.internals.histories.retention.clock = lambda: utcnow() + timedelta(seconds=TTL_S)
        assert manager.expire_sessions() == 3
        assert manager.list_sessions(tenant) == []
        assert all(manager.internals.tiers.placement(key_of(tenant, sid)) is None for sid in placed.values())
        assert not any(path.exists() for path in files.values())
        # Only the tenant's shared base layer (no session) may stay.
        assert [
            blob.session_id for blob in manager.internals.metadata.list_blobs(location=None) if blob.session_id
        ] == []
        tiers = manager.stats()["tiers"]
        assert [tiers[t]["sessions"] for t in ("device", "host", "disk")] == [0, 0, 0]


def test_expiry_removes_the_shared_redis_copy(
    tmp_path: Path, tiny_engine: Engine, redis_url: str, redis_prefix: str
) -> None:
    db_url = f"sqlite:///{tmp_path / 'chatkv.db'}"
    with open_manager(tmp_path / "home", tiny_engine, db_url, redis_url=redis_url, redis_prefix=redis_prefix) as m:
        tenant = m.create_tenant("acme").id
        sid = implicit_session(m, tenant, "Hello")
        m.internals.tiers.flush()
        assert m.internals.shared_store is not None and m.internals.shared_store.contains(key_of(tenant, sid))
        m.internals.histories.retention.clock = lambda: utcnow() + timedelta(seconds=TTL_S)
        assert m.expire_sessions() == 1
        assert not m.internals.shared_store.contains(key_of(tenant, sid))


def test_a_session_that_came_back_to_life_since_it_was_listed_is_kept(
    db_url: str, tmp_path: Path, tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open_manager(tmp_path / "home", tiny_engine, db_url) as manager:
        tenant = manager.create_tenant("acme").id
        revived, idle = implicit_session(manager, tenant, "Hello"), implicit_session(manager, tenant, "Hi")
        listed = HistoryStore.expired

        def listed_then_revived(store: HistoryStore, **kwargs: Any) -> Any:
            found = listed(store, **kwargs)
            manager.chat(tenant, revived, "I'm back", max_new_tokens=TOKENS)  # between listing and deleting
            return found

        monkeypatch.setattr(HistoryStore, "expired", listed_then_revived)
        manager.internals.histories.retention.clock = lambda: utcnow() + timedelta(seconds=TTL_S)
        assert [e.session_id for e in manager.internals.histories.retention.expire()] == [idle]
        assert [s.id for s in manager.list_sessions(tenant)] == [revived]


def test_a_session_with_a_turn_in_flight_is_kept(db_url: str, tmp_path: Path, tiny_engine: Engine) -> None:
    with open_manager(tmp_path / "home", tiny_engine, db_url) as manager:
        tenant = manager.create_tenant("acme").id
        sid = implicit_session(manager, tenant, "Hello")
        manager.internals.histories.retention.clock = lambda: utcnow() + timedelta(seconds=TTL_S)
        with manager.internals.tiers.lease(key_of(tenant, sid)):  # what a turn holds while it runs
            assert manager.expire_sessions() == 0
        assert manager.expire_sessions() == 1
