"""Conversations (OpenAI's Responses API): a durable id over a session, with the conversation's
items and metadata as JSON text and the session that holds the items' turns.

    conversations   id (conv_...), tenant, session (NULL once it is gone), metadata, items
                    the row goes with its tenant; its session's deletion only clears session_id

Every read is keyed by tenant and id: another tenant's id reads like a missing one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from storage.database import Repository
from storage.schema import ConversationRow, utcnow


@dataclass(frozen=True)
class ConversationRecord:
    id: str
    tenant_id: str
    session_id: str | None
    metadata: str
    """A JSON object."""
    items: str
    """A JSON list of items, oldest first."""
    created_at: datetime


class ConversationStore(Repository):
    """Rows of `conversations`, one unit of work per method."""

    def add(self, *, conversation_id: str, tenant_id: str, metadata: str, items: str) -> ConversationRecord:
        """Store a new conversation (no session yet)."""
        with self._unit() as db:
            row = ConversationRow(
                id=conversation_id,
                tenant_id=tenant_id,
                session_id=None,
                metadata_json=metadata,
                items=items,
                created_at=utcnow(),
            )
            db.add(row)
            db.flush()
            return _record(row)

    def get(self, *, tenant_id: str, conversation_id: str) -> ConversationRecord | None:
        """The tenant's conversation, or `None` (missing, or another tenant's)."""
        with self._unit() as db:
            row = self._row(db, tenant_id, conversation_id)
            return None if row is None else _record(row)

    def update(
        self,
        *,
        tenant_id: str,
        conversation_id: str,
        metadata: str | None = None,
        items: str | None = None,
        session_id: str | None = None,
        clear_session: bool = False,
    ) -> ConversationRecord | None:
        """Change the fields given (`clear_session`: no session holds the items any more).
        Returns the conversation as it is now, or `None` if the tenant has no such conversation."""
        with self._unit() as db:
            row = self._row(db, tenant_id, conversation_id)
            if row is None:
                return None
            if metadata is not None:
                row.metadata_json = metadata
            if items is not None:
                row.items = items
            if session_id is not None or clear_session:
                row.session_id = session_id
            db.flush()
            return _record(row)

    def edit_items(
        self, *, tenant_id: str, conversation_id: str, edit: Callable[[str], str], session_id: str | None = None
    ) -> tuple[ConversationRecord, ConversationRecord] | None:
        """Replace the items by `edit(items)` (and the session holding them, if given) in one unit of
        work with the row locked (`SELECT ... FOR UPDATE` on PostgreSQL; SQLite has one writer), so
        two edits at once both land. Returns the conversation before and after, or `None` if the
        tenant has no such conversation. Whatever `edit` raises rolls the unit back."""
        with self._unit() as db:
            query = (
                select(ConversationRow)
                .where(ConversationRow.tenant_id == tenant_id, ConversationRow.id == conversation_id)
                .with_for_update()
            )
            row = db.scalar(query)
            if row is None:
                return None
            before = _record(row)
            row.items = edit(row.items)
            if session_id is not None:
                row.session_id = session_id
            db.flush()
            return before, _record(row)

    def holds(self, *, tenant_id: str, session_id: str) -> bool:
        """Whether one of the tenant's conversations is held by the session."""
        with self._unit() as db:
            query = select(ConversationRow.id).where(
                ConversationRow.tenant_id == tenant_id, ConversationRow.session_id == session_id
            )
            return db.scalar(query.limit(1)) is not None

    def delete(self, *, tenant_id: str, conversation_id: str) -> ConversationRecord | None:
        """Delete the tenant's conversation; returns what it was, or `None` if there was none."""
        with self._unit() as db:
            row = self._row(db, tenant_id, conversation_id)
            if row is None:
                return None
            record = _record(row)
            db.execute(delete(ConversationRow).where(ConversationRow.id == conversation_id))
            return record

    @staticmethod
    def _row(db: Session, tenant_id: str, conversation_id: str) -> ConversationRow | None:
        query = select(ConversationRow).where(
            ConversationRow.tenant_id == tenant_id, ConversationRow.id == conversation_id
        )
        return db.scalar(query)


def _record(row: ConversationRow) -> ConversationRecord:
    return ConversationRecord(
        id=row.id,
        tenant_id=row.tenant_id,
        session_id=row.session_id,
        metadata=row.metadata_json,
        items=row.items,
        created_at=row.created_at,
    )
