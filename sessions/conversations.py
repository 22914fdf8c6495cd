"""Conversations (OpenAI's Responses API): a session with a durable id. A conversation keeps its
items (messages, oldest first) and metadata, and the session whose turns are those items; a
response created with `conversation` runs its turn on that session and appends its input and its
output to the items.

    items in step with the session (same system prompt, same turns)  -> the turn continues it
    items changed by the client (added, deleted), or the session gone -> a new session holding
                                                                          them (prefilled) runs it

A conversation's session is kept while the conversation or a stored response points into it:
deleting the conversation deletes the session unless a stored response still ends one of its turns.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable

import sqlalchemy

from cache.ids import TenantId
from sessions.errors import ConversationNotFound
from storage.conversation_store import ConversationRecord, ConversationStore

CONVERSATION_ID_PREFIX = "conv_"

__all__ = ["CONVERSATION_ID_PREFIX", "ConversationRecord", "ConversationRecords"]


class ConversationRecords:
    """The conversations of one manager's tenants (see the module docstring). Thread-safe.

    Args:
        database: the metadata database.
        release_session: deletes the tenant's session unless a stored response points into it.
    """

    def __init__(self, database: sqlalchemy.Engine, *, release_session: Callable[[TenantId, str], None]) -> None:
        self._store = ConversationStore(database)
        self._release = release_session
        self._edit_lock = threading.Lock()

    def create(self, tenant_id: TenantId, *, metadata: str, items: str) -> ConversationRecord:
        """A new conversation with `metadata` (a JSON object) and `items` (a JSON list)."""
        conversation_id = CONVERSATION_ID_PREFIX + secrets.token_hex(12)
        return self._store.add(conversation_id=conversation_id, tenant_id=tenant_id, metadata=metadata, items=items)

    def get(self, tenant_id: TenantId, conversation_id: str) -> ConversationRecord:
        """Raises `ConversationNotFound` for a missing id or another tenant's."""
        record = self._store.get(tenant_id=tenant_id, conversation_id=str(conversation_id))
        if record is None:
            raise ConversationNotFound(str(conversation_id))
        return record

    def update(
        self,
        tenant_id: TenantId,
        conversation_id: str,
        *,
        metadata: str | None = None,
        items: str | None = None,
        session_id: str | None = None,
    ) -> ConversationRecord:
        """Change the metadata, the items, or the session holding them. A session replaced by
        another is released. Raises `ConversationNotFound`."""
        before = self.get(tenant_id, conversation_id)
        record = self._store.update(
            tenant_id=tenant_id, conversation_id=before.id, metadata=metadata, items=items, session_id=session_id
        )
        if record is None:
            raise ConversationNotFound(str(conversation_id))
        if session_id is not None and before.session_id not in (None, session_id):
            self._release(tenant_id, before.session_id)
        return record

    def edit_items(
        self, tenant_id: TenantId, conversation_id: str, edit: Callable[[str], str], *, session_id: str | None = None
    ) -> ConversationRecord:
        """Replace the items (a JSON list as text) by `edit(items)`, and the session holding them if
        given, atomically: concurrent edits of one conversation (two item appends, an append and a
        response's turn) apply one after the other, none lost. A session replaced by another is
        released. Raises `ConversationNotFound`, or whatever `edit` raises (nothing changes then)."""
        # One process owns a home; the lock orders its edits (SQLite would refuse the second
        # writer's read-then-write), the row lock orders replicas' edits on PostgreSQL.
        with self._edit_lock:
            changed = self._store.edit_items(
                tenant_id=tenant_id, conversation_id=str(conversation_id), edit=edit, session_id=session_id
            )
        if changed is None:
            raise ConversationNotFound(str(conversation_id))
        before, after = changed
        if session_id is not None and before.session_id not in (None, session_id):
            self._release(tenant_id, before.session_id)
        return after

    def holds(self, tenant_id: TenantId, session_id: str) -> bool:
        """Whether one of the tenant's conversations is held by the session."""
        return self._store.holds(tenant_id=tenant_id, session_id=session_id)

    def delete(self, tenant_id: TenantId, conversation_id: str) -> None:
        """Delete the conversation, and its session unless a stored response points into it.
        Raises `ConversationNotFound`."""
        record = self._store.delete(tenant_id=tenant_id, conversation_id=str(conversation_id))
        if record is None:
            raise ConversationNotFound(str(conversation_id))
        if record.session_id is not None:
            self._release(tenant_id, record.session_id)
