"""Conversation items under concurrent edits: every append lands, on SQLite (one process, its
edits ordered by `ConversationRecords`) and on PostgreSQL (two replicas' records, ordered by the
row lock)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest
from sqlalchemy import Engine

from cache.ids import TenantId
from sessions.conversations import ConversationRecords
from sessions.errors import ConversationNotFound
from storage.database import open_database
from storage.metadata_store import MetadataStore

TENANT = TenantId("tn_conv")


def _append(value: int) -> Callable[[str], str]:
    def edit(items: str) -> str:
        read = json.loads(items)
        time.sleep(0.02)  # widen the read-then-write window a lost update needs
        return json.dumps([*read, value])

    return edit


def test_appends_to_one_conversation_at_once_all_land(db_url: str, db_engine: Engine) -> None:
    MetadataStore(db_engine).create_tenant(tenant_id=TENANT, name="conv")
    replicas = 2 if db_url.startswith("postgresql") else 1  # SQLite: one process owns a home
    engines = [db_engine] + [open_database(db_url) for _ in range(replicas - 1)]
    records = [ConversationRecords(engine, release_session=lambda tenant, session: None) for engine in engines]
    conversation = records[0].create(TENANT, metadata="{}", items="[]")

    threads = [
        threading.Thread(target=records[i % replicas].edit_items, args=(TENANT, conversation.id, _append(i)))
        for i in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for engine in engines[1:]:
        engine.dispose()

    assert sorted(json.loads(records[0].get(TENANT, conversation.id).items)) == list(range(8))


def test_an_edit_that_raises_changes_nothing_and_a_missing_conversation_is_not_found(db_engine: Engine) -> None:
    MetadataStore(db_engine).create_tenant(tenant_id=TENANT, name="conv")
    records = ConversationRecords(db_engine, release_session=lambda tenant, session: None)
    conversation = records.create(TENANT, metadata="{}", items="[1]")

    def refuse(items: str) -> str:
        raise LookupError("no such item")

    with pytest.raises(LookupError):
        records.edit_items(TENANT, conversation.id, refuse)
    assert records.get(TENANT, conversation.id).items == "[1]"
    with pytest.raises(ConversationNotFound):
        records.edit_items(TenantId("tn_other"), conversation.id, _append(2))
