"""Conversation items as rows, on SQLite and PostgreSQL: appends from two connections at once all
land with the counts in step (the conversation's row lock orders them, not a process lock),
items past a cap are refused with nothing added, pages in either order, a deleted item, and the
migration that moves existing item lists into rows (and back)."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime

import pytest
from alembic import command
from sqlalchemy import Engine, text

from cache.ids import TenantId
from sessions.conversations import ConversationRecords
from sessions.errors import ConversationNotFound, ConversationTooLarge, InvalidInput
from storage.conversation_store import ConversationStore
from storage.database import alembic_config, open_database, upgrade
from storage.metadata_store import MetadataStore

TENANT = TenantId("tn_conv")


def _message(number: int, text: str = "hi") -> dict[str, object]:
    return {
        "id": f"msg_{number:04d}",
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    }


def _records(engine: Engine, **caps: int) -> ConversationRecords:
    return ConversationRecords(engine, release_session=lambda tenant, session: None, **caps)


def test_appends_from_two_connections_at_once_all_land_and_the_counts_stay_in_step(
    db_url: str, db_engine: Engine
) -> None:
    MetadataStore(db_engine).create_tenant(tenant_id=TENANT, name="conv")
    other = open_database(db_url)  # another process's pool: no lock of this process orders the two
    try:
        records = [_records(db_engine), _records(other)]
        conversation = records[0].create(TENANT, metadata="{}", items=[])
        threads = [
            threading.Thread(target=records[i % 2].append, args=(TENANT, conversation.id, [_message(i)]))
            for i in range(16)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        other.dispose()
    stored = records[0].items(TENANT, conversation.id)
    assert sorted(item["id"] for item in stored) == [f"msg_{i:04d}" for i in range(16)]
    record = records[0].get(TENANT, conversation.id)
    nbytes = sum(len(json.dumps(item, ensure_ascii=False, separators=(",", ":")).encode()) for item in stored)
    assert (record.item_count, record.item_bytes) == (16, nbytes)
    assert ConversationStore(db_engine).count_items(conversation_id=conversation.id) == 16


def test_items_past_a_cap_are_refused_and_nothing_is_added(db_engine: Engine) -> None:
    MetadataStore(db_engine).create_tenant(tenant_id=TENANT, name="conv")
    one = len(json.dumps(_message(0), separators=(",", ":")).encode())
    records = _records(db_engine, max_items=3, max_bytes=10 * one)
    conversation = records.create(TENANT, metadata="{}", items=[_message(0), _message(1)])
    with pytest.raises(ConversationTooLarge) as refused:
        records.append(TENANT, conversation.id, [_message(2), _message(3)])
    assert "at most 3 items" in str(refused.value) and "it would hold 4 items" in str(refused.value)
    with pytest.raises(ConversationTooLarge):
        records.append(TENANT, conversation.id, [_message(2, "x" * 20 * one)])
    with pytest.raises(ConversationTooLarge):
        records.create(TENANT, metadata="{}", items=[_message(i) for i in range(4)])
    assert [item["id"] for item in records.items(TENANT, conversation.id)] == ["msg_0000", "msg_0001"]
    records.append(TENANT, conversation.id, [_message(2)])
    # A response's input is checked before its turn runs; its reply is appended past the caps.
    with pytest.raises(ConversationTooLarge):
        records.check_room(records.get(TENANT, conversation.id), [_message(3)])
    records.append(TENANT, conversation.id, [_message(3)], capped=False)
    assert records.get(TENANT, conversation.id).item_count == 4


def test_items_are_paged_in_either_order_read_and_deleted_by_id(db_engine: Engine) -> None:
    MetadataStore(db_engine).create_tenant(tenant_id=TENANT, name="conv")
    records = _records(db_engine)
    conversation = records.create(TENANT, metadata="{}", items=[_message(i) for i in range(5)])
    assert records.delete_item(TENANT, conversation.id, "msg_0002") is not None
    assert records.delete_item(TENANT, conversation.id, "msg_0002") is None
    assert records.item(TENANT, conversation.id, "msg_0002") is None
    assert records.item(TENANT, conversation.id, "msg_0003") == _message(3)

    def ids(after: str | None, limit: int, descending: bool) -> tuple[list[str], bool]:
        page, more = records.page(TENANT, conversation.id, after=after, limit=limit, descending=descending)
        return [str(item["id"]) for item in page], more

    assert ids(None, 2, False) == (["msg_0000", "msg_0001"], True)
    assert ids("msg_0001", 2, False) == (["msg_0003", "msg_0004"], False)
    assert ids(None, 3, True) == (["msg_0004", "msg_0003", "msg_0001"], True)
    assert ids("msg_0001", 3, True) == (["msg_0000"], False)
    with pytest.raises(InvalidInput):
        ids("msg_0002", 3, True)
    assert records.get(TENANT, conversation.id).item_count == 4
    for call in (
        lambda: records.items(TenantId("tn_other"), conversation.id),
        lambda: records.item(TenantId("tn_other"), conversation.id, "msg_0003"),
        lambda: records.append(TenantId("tn_other"), conversation.id, [_message(9)]),
        lambda: records.delete_item(TenantId("tn_other"), conversation.id, "msg_0003"),
    ):
        with pytest.raises(ConversationNotFound):
            call()
    records.delete(TENANT, conversation.id)
    assert ConversationStore(db_engine).count_items(conversation_id=conversation.id) == 0


def test_the_migration_moves_each_item_list_into_rows_in_order_and_back(db_url: str) -> None:
    engine = open_database(db_url)
    config = alembic_config(db_url)
    items = [_message(0, "première"), _message(1, "second")]
    try:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "0011")
        now = datetime.now(UTC)
        with engine.begin() as connection:
            connection.execute(
                text("INSERT INTO tenants (id, name, created_at) VALUES ('tn_old', 'old', :now)"), {"now": now}
            )
            for conversation_id, stored in (("conv_full", items), ("conv_empty", [])):
                connection.execute(
                    text(
                        "INSERT INTO conversations (id, tenant_id, session_id, metadata, items, created_at) "
                        "VALUES (:id, 'tn_old', NULL, '{}', :items, :now)"
                    ),
                    {"id": conversation_id, "items": json.dumps(stored), "now": now},
                )
        upgrade(db_url, engine)
        records = _records(engine)
        assert records.items(TenantId("tn_old"), "conv_full") == items
        assert records.items(TenantId("tn_old"), "conv_empty") == []
        assert records.get(TenantId("tn_old"), "conv_full").item_count == 2
        records.append(TenantId("tn_old"), "conv_full", [_message(2)])  # after the migrated ones
        assert [i["id"] for i in records.items(TenantId("tn_old"), "conv_full")] == ["msg_0000", "msg_0001", "msg_0002"]
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.downgrade(config, "0011")
        with engine.connect() as connection:
            listed = connection.execute(text("SELECT items FROM conversations WHERE id = 'conv_full'")).scalar_one()
        assert [item["id"] for item in json.loads(listed)] == ["msg_0000", "msg_0001", "msg_0002"]
    finally:
        engine.dispose()
