"""Conversations (OpenAI's Responses API): a durable id over a session, with the conversation's
metadata (JSON text), its items as rows (JSON texts, in order) and the session that holds the
items' turns.

    conversations       id (conv_...), tenant, session (NULL once it is gone), metadata, the
                        items' count and bytes, the next item's position; goes with its tenant,
                        its session's deletion only clears session_id
    conversation_items  conversation, position, item id, JSON text, bytes; go with their
                        conversation

An edit of a conversation's items (append, delete) is one unit of work that starts by writing the
conversation's row (`_locked`): that write takes the row's lock on PostgreSQL, and SQLite's write
lock, before anything is read, so edits of one conversation apply one after the other (the counts
the caps are checked on included), from any thread or process, while edits of other
conversations do not wait for it on PostgreSQL. An append inserts its rows; nothing rewrites the
items already there.

Every read is keyed by tenant and id: another tenant's id reads like a missing one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Select, delete, func, select, update
from sqlalchemy.orm import Session

from storage.database import Repository
from storage.errors import StorageError
from storage.schema import ConversationItemRow, ConversationRow, utcnow


@dataclass(frozen=True)
class ConversationRecord:
    id: str
    tenant_id: str
    session_id: str | None
    metadata: str
    """A JSON object."""
    item_count: int
    item_bytes: int
    """UTF-8 bytes of the items' JSON texts."""
    created_at: datetime


@dataclass(frozen=True)
class StoredItem:
    """One item as a conversation keeps it: its id and its JSON text."""

    id: str
    text: str

    @property
    def nbytes(self) -> int:
        return len(self.text.encode())


@dataclass(frozen=True)
class Caps:
    """The most items and bytes (UTF-8, of the items' JSON texts) a conversation holds.

    Raises:
        ValueError: for a cap under 1.
    """

    max_items: int
    max_bytes: int

    def __post_init__(self) -> None:
        if self.max_items < 1 or self.max_bytes < 1:
            raise ValueError(f"caps must be >= 1, got {self.max_items} items and {self.max_bytes} bytes")


class ConversationFull(StorageError):
    """The items would take the conversation past its caps; nothing was added. Carries the count
    and bytes the conversation would have had."""

    def __init__(self, item_count: int, item_bytes: int) -> None:
        super().__init__(f"{item_count} items, {item_bytes} bytes")
        self.item_count = item_count
        self.item_bytes = item_bytes


class ItemNotFound(StorageError):
    """No item with this id in the conversation."""


class ConversationStore(Repository):
    """Rows of `conversations` and `conversation_items`, one unit of work per method."""

    def add(
        self, *, conversation_id: str, tenant_id: str, metadata: str, items: Sequence[StoredItem], caps: Caps
    ) -> ConversationRecord:
        """Store a new conversation (no session yet) with its first `items`.

        Raises:
            ConversationFull: if the items alone exceed `caps` (nothing stored).
        """
        with self._unit() as db:
            row = ConversationRow(
                id=conversation_id,
                tenant_id=tenant_id,
                session_id=None,
                metadata_json=metadata,
                created_at=utcnow(),
                item_count=0,
                item_bytes=0,
                next_position=0,
            )
            db.add(row)
            db.flush()
            _append(db, row, items, caps)
            return _record(row)

    def get(self, *, tenant_id: str, conversation_id: str) -> ConversationRecord | None:
        """The tenant's conversation, or `None` (missing, or another tenant's)."""
        with self._unit() as db:
            row = db.scalar(_conversation(tenant_id, conversation_id))
            return None if row is None else _record(row)

    def update(
        self,
        *,
        tenant_id: str,
        conversation_id: str,
        metadata: str | None = None,
        session_id: str | None = None,
        clear_session: bool = False,
    ) -> ConversationRecord | None:
        """Change the fields given (`clear_session`: no session holds the items any more).
        Returns the conversation as it is now, or `None` if the tenant has no such conversation."""
        with self._unit() as db:
            row = _locked(db, tenant_id, conversation_id)
            if row is None:
                return None
            if metadata is not None:
                row.metadata_json = metadata
            if session_id is not None or clear_session:
                row.session_id = session_id
            db.flush()
            return _record(row)

    def append(
        self,
        *,
        tenant_id: str,
        conversation_id: str,
        items: Sequence[StoredItem],
        caps: Caps | None,
        session_id: str | None = None,
    ) -> tuple[ConversationRecord, ConversationRecord] | None:
        """Append `items` (and set the session holding them, if given) with the conversation
        locked (see the module). Returns the conversation before and after, or `None` if the
        tenant has no such conversation.

        Raises:
            ConversationFull: if the items would take the conversation past `caps` (`None`: no
                check); nothing changes then.
        """
        with self._unit() as db:
            row = _locked(db, tenant_id, conversation_id)
            if row is None:
                return None
            before = _record(row)
            _append(db, row, items, caps)
            if session_id is not None:
                row.session_id = session_id
            db.flush()
            return before, _record(row)

    def delete_item(self, *, tenant_id: str, conversation_id: str, item_id: str) -> ConversationRecord | None:
        """Delete one item (the conversation locked). Returns the conversation as it is now, or
        `None` if the tenant has no such conversation.

        Raises:
            ItemNotFound: if the conversation has no item `item_id`.
        """
        with self._unit() as db:
            row = _locked(db, tenant_id, conversation_id)
            if row is None:
                return None
            nbytes = db.scalar(
                delete(ConversationItemRow)
                .where(ConversationItemRow.conversation_id == row.id, ConversationItemRow.item_id == item_id)
                .returning(ConversationItemRow.nbytes)
            )
            if nbytes is None:
                raise ItemNotFound(item_id)
            row.item_count -= 1
            row.item_bytes -= nbytes
            db.flush()
            return _record(row)

    def items(self, *, tenant_id: str, conversation_id: str) -> list[str] | None:
        """Every item's JSON text, oldest first; `None` if the tenant has no such conversation."""
        with self._unit() as db:
            if db.scalar(_conversation(tenant_id, conversation_id)) is None:
                return None
            query = select(ConversationItemRow.item).where(ConversationItemRow.conversation_id == conversation_id)
            return list(db.scalars(query.order_by(ConversationItemRow.position)))

    def item(self, *, tenant_id: str, conversation_id: str, item_id: str) -> str | None:
        """One item's JSON text; `None` if the tenant has no such conversation or item."""
        with self._unit() as db:
            return db.scalar(
                select(ConversationItemRow.item)
                .join(ConversationRow, ConversationRow.id == ConversationItemRow.conversation_id)
                .where(
                    ConversationRow.tenant_id == tenant_id,
                    ConversationRow.id == conversation_id,
                    ConversationItemRow.item_id == item_id,
                )
            )

    def page(
        self, *, tenant_id: str, conversation_id: str, after: str | None, limit: int, descending: bool
    ) -> tuple[list[str], bool] | None:
        """Up to `limit` items' JSON texts in order (newest first if `descending`) after the item
        `after` (from the start if `None`), and whether more follow; `None` if the tenant has no
        such conversation.

        Raises:
            ItemNotFound: if `after` is not one of the conversation's items.
        """
        with self._unit() as db:
            if db.scalar(_conversation(tenant_id, conversation_id)) is None:
                return None
            position = ConversationItemRow.position
            query = select(ConversationItemRow.item).where(ConversationItemRow.conversation_id == conversation_id)
            if after is not None:
                start = db.scalar(
                    select(position).where(
                        ConversationItemRow.conversation_id == conversation_id, ConversationItemRow.item_id == after
                    )
                )
                if start is None:
                    raise ItemNotFound(after)
                query = query.where(position < start if descending else position > start)
            query = query.order_by(position.desc() if descending else position).limit(limit + 1)
            texts = list(db.scalars(query))
            return texts[:limit], len(texts) > limit

    def holds(self, *, tenant_id: str, session_id: str) -> bool:
        """Whether one of the tenant's conversations is held by the session."""
        with self._unit() as db:
            query = select(ConversationRow.id).where(
                ConversationRow.tenant_id == tenant_id, ConversationRow.session_id == session_id
            )
            return db.scalar(query.limit(1)) is not None

    def delete(self, *, tenant_id: str, conversation_id: str) -> ConversationRecord | None:
        """Delete the tenant's conversation and its items; returns what it was, or `None` if
        there was none."""
        with self._unit() as db:
            row = _locked(db, tenant_id, conversation_id)
            if row is None:
                return None
            record = _record(row)
            db.execute(delete(ConversationItemRow).where(ConversationItemRow.conversation_id == conversation_id))
            db.execute(delete(ConversationRow).where(ConversationRow.id == conversation_id))
            return record

    def count_items(self, *, conversation_id: str) -> int:
        """How many item rows the conversation has (for tests: the counters agree with the rows)."""
        with self._unit() as db:
            query = select(func.count()).where(ConversationItemRow.conversation_id == conversation_id)
            return int(db.scalar(query) or 0)


def _conversation(tenant_id: str, conversation_id: str) -> Select[ConversationRow]:
    return select(ConversationRow).where(ConversationRow.tenant_id == tenant_id, ConversationRow.id == conversation_id)


def _locked(db: Session, tenant_id: str, conversation_id: str) -> ConversationRow | None:
    """The conversation's row, locked for the rest of the unit of work: a write that changes
    nothing takes the lock before anything is read (see the module)."""
    touched = db.execute(
        update(ConversationRow)
        .where(ConversationRow.tenant_id == tenant_id, ConversationRow.id == conversation_id)
        .values(next_position=ConversationRow.next_position)
        .execution_options(synchronize_session=False)
    )
    if not getattr(touched, "rowcount", 0):
        return None
    return db.scalar(_conversation(tenant_id, conversation_id))


def _append(db: Session, row: ConversationRow, items: Sequence[StoredItem], caps: Caps | None) -> None:
    """Insert `items` after the conversation's last and count them in `row` (locked)."""
    count = row.item_count + len(items)
    nbytes = row.item_bytes + sum(item.nbytes for item in items)
    if caps is not None and (count > caps.max_items or nbytes > caps.max_bytes):
        raise ConversationFull(count, nbytes)
    for offset, item in enumerate(items):
        db.add(
            ConversationItemRow(
                conversation_id=row.id,
                position=row.next_position + offset,
                item_id=item.id,
                item=item.text,
                nbytes=item.nbytes,
            )
        )
    row.item_count, row.item_bytes = count, nbytes
    row.next_position += len(items)


def _record(row: ConversationRow) -> ConversationRecord:
    return ConversationRecord(
        id=row.id,
        tenant_id=row.tenant_id,
        session_id=row.session_id,
        metadata=row.metadata_json,
        item_count=row.item_count,
        item_bytes=row.item_bytes,
        created_at=row.created_at,
    )
