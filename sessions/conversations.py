"""Conversations (OpenAI's Responses API): a session with a durable id. A conversation keeps its
items (messages, oldest first) and metadata, and the session whose turns are those items; a
response created with `conversation` runs its turn on that session and appends its input and its
output to the items.

    items in step with the session (same system prompt, same turns)  -> the turn continues it
    items changed by the client (added, deleted), or the session gone -> a new session holding
                                                                          them (prefilled) runs it

Items are rows (`storage.conversation_store`): an append adds rows and never rewrites the items
already there, and edits of one conversation are ordered by that conversation's row lock (edits
of different conversations do not wait for each other). A conversation holds at most
`MAX_CONVERSATION_ITEMS` items and `MAX_CONVERSATION_BYTES` bytes (UTF-8, of the items as JSON):
items that would take it past either are refused with `ConversationTooLarge` and nothing is added.
A response's input is checked before its turn runs; its reply is then appended whatever its size
(it is bounded by `max_output_tokens`), so a conversation may pass the byte cap by one reply.

A conversation's session is kept while the conversation or a stored response points into it:
deleting the conversation deletes its items, and the session unless a stored response still ends
one of its turns (those responses stay, as in OpenAI's API).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sqlalchemy

from cache.ids import TenantId
from sessions.errors import ConversationNotFound, ConversationTooLarge, InvalidInput
from storage.conversation_store import (
    Caps,
    ConversationFull,
    ConversationRecord,
    ConversationStore,
    ItemNotFound,
    StoredItem,
)

CONVERSATION_ID_PREFIX = "conv_"
MAX_CONVERSATION_ITEMS = 10_000
"""Items one conversation holds."""
MAX_CONVERSATION_BYTES = 16 * 2**20
"""Bytes (UTF-8, of the items as JSON) one conversation holds: 16 MiB, two bodies at the `/v1/`
body limit; far more text than a model's context window takes."""

Item = Mapping[str, Any]
"""An item as OpenAI's API shows it (a JSON object with an `id`)."""

__all__ = [
    "CONVERSATION_ID_PREFIX",
    "MAX_CONVERSATION_BYTES",
    "MAX_CONVERSATION_ITEMS",
    "ConversationRecord",
    "ConversationRecords",
]


class ConversationRecords:
    """The conversations of one manager's tenants (see the module docstring). Thread-safe.

    Args:
        database: the metadata database.
        release_session: deletes the tenant's session unless a stored response points into it.
        max_items, max_bytes: the caps (tests lower them).
    """

    def __init__(
        self,
        database: sqlalchemy.Engine,
        *,
        release_session: Callable[[TenantId, str], None],
        max_items: int = MAX_CONVERSATION_ITEMS,
        max_bytes: int = MAX_CONVERSATION_BYTES,
    ) -> None:
        self._store = ConversationStore(database)
        self._release = release_session
        self._caps = Caps(max_items, max_bytes)

    def create(self, tenant_id: TenantId, *, metadata: str, items: Sequence[Item]) -> ConversationRecord:
        """A new conversation with `metadata` (a JSON object as text) and its first `items`.

        Raises:
            ConversationTooLarge: if the items exceed the caps (nothing stored).
        """
        conversation_id = CONVERSATION_ID_PREFIX + secrets.token_hex(12)
        try:
            return self._store.add(
                conversation_id=conversation_id,
                tenant_id=tenant_id,
                metadata=metadata,
                items=_stored(items),
                caps=self._caps,
            )
        except ConversationFull as full:
            raise self._too_large(full) from None

    def get(self, tenant_id: TenantId, conversation_id: str) -> ConversationRecord:
        """Raises `ConversationNotFound` for a missing id or another tenant's."""
        record = self._store.get(tenant_id=tenant_id, conversation_id=str(conversation_id))
        if record is None:
            raise ConversationNotFound(str(conversation_id))
        return record

    def update(
        self, tenant_id: TenantId, conversation_id: str, *, metadata: str | None = None, session_id: str | None = None
    ) -> ConversationRecord:
        """Change the metadata, or the session holding the items. A session replaced by another
        is released. Raises `ConversationNotFound`."""
        before = self.get(tenant_id, conversation_id)
        record = self._store.update(
            tenant_id=tenant_id, conversation_id=before.id, metadata=metadata, session_id=session_id
        )
        if record is None:
            raise ConversationNotFound(str(conversation_id))
        if session_id is not None and before.session_id not in (None, session_id):
            self._release(tenant_id, before.session_id)
        return record

    def append(
        self,
        tenant_id: TenantId,
        conversation_id: str,
        items: Sequence[Item],
        *,
        session_id: str | None = None,
        capped: bool = True,
    ) -> ConversationRecord:
        """Append `items` (and set the session holding them, if given) atomically: concurrent
        edits of one conversation apply one after the other, none lost. A session replaced by
        another is released. `capped=False`: a response's reply, appended whatever the caps say
        (see the module docstring).

        Raises:
            ConversationNotFound: for a missing id or another tenant's.
            ConversationTooLarge: if the items would take it past the caps (nothing changes).
        """
        try:
            changed = self._store.append(
                tenant_id=tenant_id,
                conversation_id=str(conversation_id),
                items=_stored(items),
                caps=self._caps if capped else None,
                session_id=session_id,
            )
        except ConversationFull as full:
            raise self._too_large(full) from None
        if changed is None:
            raise ConversationNotFound(str(conversation_id))
        before, after = changed
        if session_id is not None and before.session_id not in (None, session_id):
            self._release(tenant_id, before.session_id)
        return after

    def check_room(self, record: ConversationRecord, items: Sequence[Item]) -> None:
        """Raise `ConversationTooLarge` if `items` would not fit in the conversation as `record`
        found it (checked again when they are appended)."""
        stored = _stored(items)
        count = record.item_count + len(stored)
        nbytes = record.item_bytes + sum(item.nbytes for item in stored)
        if count > self._caps.max_items or nbytes > self._caps.max_bytes:
            raise self._too_large(ConversationFull(count, nbytes))

    def delete_item(self, tenant_id: TenantId, conversation_id: str, item_id: str) -> ConversationRecord | None:
        """Delete one item; the conversation as it is now, or `None` if it has no such item.
        Raises `ConversationNotFound`."""
        try:
            record = self._store.delete_item(
                tenant_id=tenant_id, conversation_id=str(conversation_id), item_id=str(item_id)
            )
        except ItemNotFound:
            return None
        if record is None:
            raise ConversationNotFound(str(conversation_id))
        return record

    def items(self, tenant_id: TenantId, conversation_id: str) -> list[dict[str, Any]]:
        """Every item, oldest first. Raises `ConversationNotFound`."""
        texts = self._store.items(tenant_id=tenant_id, conversation_id=str(conversation_id))
        if texts is None:
            raise ConversationNotFound(str(conversation_id))
        return [json.loads(text) for text in texts]

    def item(self, tenant_id: TenantId, conversation_id: str, item_id: str) -> dict[str, Any] | None:
        """One item, or `None` if the conversation has no such item. Raises `ConversationNotFound`."""
        text = self._store.item(tenant_id=tenant_id, conversation_id=str(conversation_id), item_id=str(item_id))
        if text is None:
            self.get(tenant_id, conversation_id)  # raises for a missing conversation
            return None
        return dict(json.loads(text))

    def page(
        self, tenant_id: TenantId, conversation_id: str, *, after: str | None, limit: int, descending: bool
    ) -> tuple[list[dict[str, Any]], bool]:
        """Up to `limit` items (newest first if `descending`) after the item `after`, and whether
        more follow.

        Raises:
            ConversationNotFound: for a missing id or another tenant's.
            InvalidInput: if `after` is not one of its items.
        """
        try:
            found = self._store.page(
                tenant_id=tenant_id,
                conversation_id=str(conversation_id),
                after=after,
                limit=limit,
                descending=descending,
            )
        except ItemNotFound:
            raise InvalidInput(f"after: no item {after!r} in this list") from None
        if found is None:
            raise ConversationNotFound(str(conversation_id))
        texts, more = found
        return [json.loads(text) for text in texts], more

    def holds(self, tenant_id: TenantId, session_id: str) -> bool:
        """Whether one of the tenant's conversations is held by the session."""
        return self._store.holds(tenant_id=tenant_id, session_id=session_id)

    def delete(self, tenant_id: TenantId, conversation_id: str) -> None:
        """Delete the conversation and its items, and its session unless a stored response
        points into it. Raises `ConversationNotFound`."""
        record = self._store.delete(tenant_id=tenant_id, conversation_id=str(conversation_id))
        if record is None:
            raise ConversationNotFound(str(conversation_id))
        if record.session_id is not None:
            self._release(tenant_id, record.session_id)

    def _too_large(self, full: ConversationFull) -> ConversationTooLarge:
        return ConversationTooLarge(
            f"a conversation holds at most {self._caps.max_items:,} items and {self._caps.max_bytes:,} bytes; "
            f"with these items it would hold {full.item_count:,} items and {full.item_bytes:,} bytes"
        )


def _stored(items: Sequence[Item]) -> list[StoredItem]:
    return [StoredItem(str(item["id"]), json.dumps(item, ensure_ascii=False, separators=(",", ":"))) for item in items]
