"""The metadata database on SQLite and PostgreSQL: migrations give the models' schema, and the
repository keeps tenants apart, stores exact token ids and cache blob rows, and cascades deletes."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect, text

from storage.database import alembic_config, current_revision, head_revision, open_database, upgrade
from storage.errors import AlreadyExists, SessionGone
from storage.metadata_store import MetadataStore
from storage.schema import Base
from tests.storage.conftest import add_session

TABLES = {
    "alembic_version",
    "tenants",
    "sessions",
    "messages",
    "cache_blobs",
    "replicas",
    "session_owners",
    "idempotency_keys",
    "turn_digests",
    "responses",
    "conversations",
    "conversation_items",
}


def schema_diff(engine: Engine) -> list[object]:
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        return list(compare_metadata(context, Base.metadata))


# -- migrations ------------------------------------------------------------------------------------


def test_upgrade_on_an_empty_database_gives_the_models_schema(db_url: str) -> None:
    engine = open_database(db_url)
    try:
        assert current_revision(engine) is None
        upgrade(db_url, engine)
        assert set(inspect(engine).get_table_names()) == TABLES
        assert current_revision(engine) == head_revision() == "0012"
        assert schema_diff(engine) == []
        upgrade(db_url, engine)  # a second start-up is a no-op
        assert current_revision(engine) == "0012"
    finally:
        engine.dispose()


def test_downgrade_to_base_and_upgrade_again_round_trips(db_url: str) -> None:
    engine = open_database(db_url)
    try:
        upgrade(db_url, engine)
        config = alembic_config(db_url)
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.downgrade(config, "base")
        assert set(inspect(engine).get_table_names()) == {"alembic_version"}
        upgrade(db_url, engine)
        assert schema_diff(engine) == []
    finally:
        engine.dispose()


def test_sqlite_runs_in_wal_mode_with_foreign_keys_on(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'nested' / 'chatkv.db'}"
    engine = open_database(url)
    try:
        upgrade(url, engine)
        with engine.connect() as connection:
            assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert connection.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert (tmp_path / "nested" / "chatkv.db").is_file()
    finally:
        engine.dispose()


def test_open_database_rejects_a_malformed_url() -> None:
    with pytest.raises(ValueError, match="not a database URL"):
        open_database("no such url")


def test_open_database_rejects_a_database_other_than_sqlite_or_postgresql() -> None:
    with pytest.raises(ValueError, match="SQLite or PostgreSQL, not mysql"):
        open_database("mysql+pymysql://user@127.0.0.1/chatkv")


# -- tenants and sessions --------------------------------------------------------------------------


def test_tenant_names_are_unique(metadata: MetadataStore) -> None:
    metadata.create_tenant(tenant_id="tn_1", name="acme", wrapped_data_key=b"k1", master_key_id="m1")
    with pytest.raises(AlreadyExists):
        metadata.create_tenant(tenant_id="tn_2", name="acme")
    record = metadata.get_tenant(name="acme")
    assert record is not None
    assert (record.id, record.wrapped_data_key, record.master_key_id) == ("tn_1", b"k1", "m1")
    assert record.created_at.tzinfo is UTC
    assert [t.id for t in metadata.list_tenants()] == ["tn_1"]


def test_a_session_of_another_tenant_is_not_found(metadata: MetadataStore) -> None:
    add_session(metadata, "tn_a", "s_1")
    add_session(metadata, "tn_b", "s_2")
    assert metadata.get_session(tenant_id="tn_b", session_id="s_1") is None
    assert metadata.messages(tenant_id="tn_b", session_id="s_1") is None
    assert metadata.delete_session(tenant_id="tn_b", session_id="s_1") is False
    with pytest.raises(SessionGone):
        metadata.record_turn(
            tenant_id="tn_b",
            session_id="s_1",
            messages=[("user", "hi", [1])],
            token_count=1,
            model_fingerprint="fp-a",
            ttft_s=None,
        )
    assert [s.id for s in metadata.list_sessions(tenant_id="tn_a")] == ["s_1"]
    assert {s.id for s in metadata.list_sessions()} == {"s_1", "s_2"}


def test_record_turn_stores_exact_token_ids_in_order(metadata: MetadataStore) -> None:
    add_session(metadata, "tn_a", "s_1")
    first = metadata.record_turn(
        tenant_id="tn_a",
        session_id="s_1",
        messages=[("user", "hi", [1, 2, 49151]), ("assistant", "yo", [7, 0])],
        token_count=5,
        model_fingerprint="fp-a",
        ttft_s=0.25,
    )
    second = metadata.record_turn(
        tenant_id="tn_a",
        session_id="s_1",
        messages=[("user", "more", [3]), ("assistant", "ok", [8, 2])],
        token_count=8,
        model_fingerprint="fp-b",
        ttft_s=None,
    )
    assert (first, second) == (0, 2)
    messages = metadata.messages(tenant_id="tn_a", session_id="s_1")
    assert messages is not None
    assert [(m.index, m.role, m.text, m.token_ids) for m in messages] == [
        (0, "user", "hi", (1, 2, 49151)),
        (1, "assistant", "yo", (7, 0)),
        (2, "user", "more", (3,)),
        (3, "assistant", "ok", (8, 2)),
    ]
    session = metadata.get_session(tenant_id="tn_a", session_id="s_1")
    assert session is not None
    assert (session.token_count, session.message_count, session.model_fingerprint, session.last_ttft_s) == (
        8,
        4,
        "fp-b",
        0.25,
    )


def test_set_tenant_keys_replaces_every_wrapped_key(metadata: MetadataStore) -> None:
    metadata.create_tenant(tenant_id="tn_1", name="one", wrapped_data_key=b"old1", master_key_id="m-old")
    metadata.create_tenant(tenant_id="tn_2", name="two", wrapped_data_key=b"old2", master_key_id="m-old")
    metadata.set_tenant_keys(wrapped={"tn_1": (b"new1", "m-new"), "tn_2": (b"new2", "m-new")})
    assert [(t.id, t.wrapped_data_key, t.master_key_id) for t in metadata.list_tenants()] == [
        ("tn_1", b"new1", "m-new"),
        ("tn_2", b"new2", "m-new"),
    ]


# -- cache blob rows -------------------------------------------------------------------------------


def put_row(metadata: MetadataStore, tenant_id: str, name: str, nbytes: int, session_id: str | None = None) -> bool:
    return metadata.put_blob(
        tenant_id=tenant_id,
        session_id=session_id,
        name=name,
        tier="disk",
        path=f"{tenant_id}/{name}.ckv",
        nbytes=nbytes,
        checksum="0" * 64,
        model_fingerprint="fp-a",
    )


def test_put_blob_replaces_the_row_of_the_same_name(metadata: MetadataStore) -> None:
    add_session(metadata, "tn_a", "s_1")
    put_row(metadata, "tn_a", "s_1", 10, "s_1")
    put_row(metadata, "tn_a", "s_1", 20, "s_1")
    put_row(metadata, "tn_a", "base-abc", 30)
    rows = metadata.list_blobs(tenant_id="tn_a")
    assert sorted((r.name, r.session_id, r.nbytes) for r in rows) == [("base-abc", None, 30), ("s_1", "s_1", 20)]
    metadata.delete_blob(tenant_id="tn_a", name="base-abc")
    assert [r.name for r in metadata.list_blobs()] == ["s_1"]


def test_blob_rows_cascade_with_their_session_and_tenant(metadata: MetadataStore) -> None:
    add_session(metadata, "tn_a", "s_1")
    add_session(metadata, "tn_a", "s_2")
    add_session(metadata, "tn_b", "s_3")
    for tenant, session in (("tn_a", "s_1"), ("tn_a", "s_2"), ("tn_b", "s_3")):
        put_row(metadata, tenant, session, 1, session)
    put_row(metadata, "tn_a", "base-x", 1)
    assert metadata.delete_session(tenant_id="tn_a", session_id="s_1") is True
    assert sorted(r.name for r in metadata.list_blobs()) == ["base-x", "s_2", "s_3"]
    assert metadata.delete_tenant(tenant_id="tn_a") is True
    assert [r.name for r in metadata.list_blobs()] == ["s_3"]
    assert metadata.list_sessions(tenant_id="tn_a") == []


def test_writers_of_one_blob_row_at_once_all_succeed(metadata: MetadataStore) -> None:
    # A write-back and a hand-over publish one session's blob at the same instant. With a delete
    # and an insert, PostgreSQL failed the later insert on the unique key, which read as "the
    # session is gone" and made the Redis tier delete the value the other had just recorded.
    add_session(metadata, "tn_a", "s_1")
    writers = 4
    for attempt in range(10):
        start = threading.Barrier(writers)

        def write(nbytes: int, start: threading.Barrier = start) -> bool:
            start.wait()
            return put_row(metadata, "tn_a", "s_1", nbytes, "s_1")

        with ThreadPoolExecutor(writers) as pool:
            results = list(pool.map(write, [100 * attempt + i for i in range(writers)]))
        assert results == [True] * writers, f"attempt {attempt}"
        rows = metadata.list_blobs(tenant_id="tn_a")
        assert len(rows) == 1 and rows[0].nbytes in [100 * attempt + i for i in range(writers)]


def test_delete_blob_with_a_checksum_deletes_only_that_blobs_row(metadata: MetadataStore) -> None:
    add_session(metadata, "tn_a", "s_1")
    put_row(metadata, "tn_a", "s_1", 10, "s_1")  # checksum "0" * 64
    assert metadata.delete_blob(tenant_id="tn_a", name="s_1", checksum="1" * 64) is False
    assert [r.name for r in metadata.list_blobs()] == ["s_1"]
    assert metadata.delete_blob(tenant_id="tn_a", name="s_1", checksum="0" * 64) is True
    assert metadata.list_blobs() == []
    assert metadata.delete_blob(tenant_id="tn_a", name="s_1") is False


def test_a_blob_row_needs_an_existing_tenant(metadata: MetadataStore) -> None:
    assert put_row(metadata, "tn_missing", "base-x", 1) is False  # refused by the foreign key
    assert metadata.list_blobs() == []
