"""Stored responses on SQLite and PostgreSQL: `locate` answers where a response is, and how many
turns its session holds now, in one query, and answers `None` wherever `get` would."""

from __future__ import annotations

from sqlalchemy import Engine, event

from storage.metadata_store import MetadataStore
from storage.response_store import ResponseLocation, ResponseRecord, ResponseStore
from storage.schema import utcnow
from tests.storage.conftest import add_session


def _turn(metadata: MetadataStore, session_id: str) -> None:
    metadata.record_turn(
        tenant_id="tn_a",
        session_id=session_id,
        messages=[("user", "hi", [1]), ("assistant", "hello", [2])],
        token_count=2,
        model_fingerprint="fp-a",
        ttft_s=None,
    )


def _response(response_id: str, tenant_id: str, session_id: str, turn_index: int) -> ResponseRecord:
    return ResponseRecord(response_id, tenant_id, session_id, turn_index, None, '{"id": 1}', "[]", utcnow())


def test_locate_counts_the_sessions_turns_in_one_query_and_only_for_the_tenant(
    db_engine: Engine, metadata: MetadataStore
) -> None:
    add_session(metadata, "tn_a", "s_1")
    add_session(metadata, "tn_b", "s_2")
    store = ResponseStore(db_engine)
    for _ in range(3):
        _turn(metadata, "s_1")
    store.add(_response("resp_1", "tn_a", "s_1", 0))
    store.add(_response("resp_3", "tn_a", "s_1", 2))
    statements: list[str] = []
    event.listen(db_engine, "before_cursor_execute", lambda *args: statements.append(args[2]))

    assert store.locate(tenant_id="tn_a", response_id="resp_1") == ResponseLocation("s_1", 0, 3)
    assert len(statements) == 1
    assert "input_items" not in statements[0]  # the JSON texts stay on disk
    assert store.locate(tenant_id="tn_a", response_id="resp_3") == ResponseLocation("s_1", 2, 3)
    assert store.locate(tenant_id="tn_b", response_id="resp_1") is None
    assert store.locate(tenant_id="tn_a", response_id="resp_9") is None
    metadata.delete_session(tenant_id="tn_a", session_id="s_1")
    assert store.locate(tenant_id="tn_a", response_id="resp_1") is None
    assert store.get(tenant_id="tn_a", response_id="resp_1") is None
