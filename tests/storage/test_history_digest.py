"""The history digest of sessions (the implicit lookup of the OpenAI API), on SQLite and PostgreSQL:
set at creation, extended in the transaction that records a turn with the texts as the client
saw them, found by one keyed query per tenant, and NULL (never found) for sessions older than it."""

from __future__ import annotations

from alembic import command
from sqlalchemy import Engine, inspect, text

from storage.database import alembic_config, open_database, upgrade
from storage.history_digest import extend_digest, history_digest, start_digest
from storage.metadata_store import MetadataStore


def _session(metadata: MetadataStore, tenant_id: str, session_id: str, system: str | None = "Be terse.") -> None:
    if metadata.get_tenant(tenant_id=tenant_id) is None:
        metadata.create_tenant(tenant_id=tenant_id, name=f"name-{tenant_id}")
    metadata.create_session(
        tenant_id=tenant_id, session_id=session_id, title=None, system_prompt=system, model_fingerprint="fp"
    )


def _turn(metadata: MetadataStore, tenant_id: str, session_id: str, user: str, reply: str, returned: str) -> None:
    metadata.record_turn(
        tenant_id=tenant_id,
        session_id=session_id,
        messages=[("user", user, [1]), ("assistant", reply, [2, 3])],
        token_count=3,
        model_fingerprint="fp",
        ttft_s=None,
        returned_texts=(user, returned),
    )


def test_the_digest_chains_length_prefixed_texts() -> None:
    assert start_digest(None) != start_digest("")
    assert history_digest("S", [("ab", "c")]) != history_digest("S", [("a", "bc")])
    assert history_digest("S", [("u", "a"), ("v", "b")]) == extend_digest(
        extend_digest(start_digest("S"), "u", "a"), "v", "b"
    )
    assert history_digest("S", [("\ud800", "x")])  # a lone surrogate never matches, and never crashes


def test_a_turn_extends_the_digest_with_the_text_the_client_saw(metadata: MetadataStore) -> None:
    _session(metadata, "tn_a", "s_1")
    record = metadata.get_session(tenant_id="tn_a", session_id="s_1")
    assert record is not None and record.history_digest == start_digest("Be terse.")
    # The stored reply runs past its stop string; the client saw it cut.
    _turn(metadata, "tn_a", "s_1", "Hi", "Hello there. STOP and more", "Hello there. ")
    seen = history_digest("Be terse.", [("Hi", "Hello there. ")])
    assert metadata.sessions_by_history(tenant_id="tn_a", history_digest=seen) == ["s_1"]
    stored = history_digest("Be terse.", [("Hi", "Hello there. STOP and more")])
    assert metadata.sessions_by_history(tenant_id="tn_a", history_digest=stored) == []
    messages = metadata.messages(tenant_id="tn_a", session_id="s_1")
    assert messages is not None and messages[1].text == "Hello there. STOP and more"


def test_the_lookup_is_per_tenant_and_most_recent_first(metadata: MetadataStore) -> None:
    for tenant_id, session_id in (("tn_a", "s_1"), ("tn_b", "s_2"), ("tn_a", "s_3")):
        _session(metadata, tenant_id, session_id)
        _turn(metadata, tenant_id, session_id, "Hi", "Hello", "Hello")
    digest = history_digest("Be terse.", [("Hi", "Hello")])
    assert metadata.sessions_by_history(tenant_id="tn_a", history_digest=digest) == ["s_3", "s_1"]
    assert metadata.sessions_by_history(tenant_id="tn_b", history_digest=digest) == ["s_2"]
    assert metadata.sessions_by_history(tenant_id="tn_c", history_digest=digest) == []
    _turn(metadata, "tn_a", "s_1", "More", "Sure", "Sure")  # moved on: no longer at that history
    assert metadata.sessions_by_history(tenant_id="tn_a", history_digest=digest) == ["s_3"]


def test_a_session_created_with_a_history_has_its_digest(metadata: MetadataStore) -> None:
    metadata.create_tenant(tenant_id="tn_a", name="a")
    record = metadata.create_session(
        tenant_id="tn_a",
        session_id="s_1",
        title=None,
        system_prompt=None,
        model_fingerprint="fp",
        messages=[("user", "u1", ()), ("assistant", "a1", (5, 0)), ("user", "u2", ()), ("assistant", "a2", (6,))],
    )
    assert record.message_count == 4
    assert record.history_digest == history_digest(None, [("u1", "a1"), ("u2", "a2")])
    messages = metadata.messages(tenant_id="tn_a", session_id="s_1")
    assert messages is not None and [(m.index, m.role, m.token_ids) for m in messages] == [
        (0, "user", ()),
        (1, "assistant", (5, 0)),
        (2, "user", ()),
        (3, "assistant", (6,)),
    ]


def test_the_migration_indexes_the_digest_and_leaves_older_sessions_null(db_url: str) -> None:
    engine = open_database(db_url)
    try:
        _migrate(db_url, engine, "0003")
        with engine.begin() as connection:
            connection.execute(
                text("INSERT INTO tenants (id, name, created_at) VALUES ('tn_a', 'a', CURRENT_TIMESTAMP)")
            )
            connection.execute(
                text(
                    "INSERT INTO sessions (id, tenant_id, model_fingerprint, token_count, pinned_turns, created_at, "
                    "last_active_at) VALUES ('s_old', 'tn_a', 'fp', 0, '[]', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                )
            )
        upgrade(db_url, engine)
        indexes = {ix["name"]: ix["column_names"] for ix in inspect(engine).get_indexes("sessions")}
        assert indexes["ix_sessions_tenant_history"] == ["tenant_id", "history_digest"]
        metadata = MetadataStore(engine)
        _turn(metadata, "tn_a", "s_old", "Hi", "Hello", "Hello")
        old = metadata.get_session(tenant_id="tn_a", session_id="s_old")
        assert old is not None and old.history_digest is None and old.message_count == 2
        assert (
            metadata.sessions_by_history(tenant_id="tn_a", history_digest=history_digest(None, [("Hi", "Hello")])) == []
        )
    finally:
        engine.dispose()


def _migrate(url: str, engine: Engine, revision: str) -> None:
    config = alembic_config(url)
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)
