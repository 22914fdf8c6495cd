"""Responses (OpenAI's Responses API) as points in sessions: a stored response is the end of one
turn of a session, and its id resolves to that session and turn.

    chain      r1 -> r2 -> r3        one session S: r1 ends turn 0, r2 turn 1, r3 turn 2
    continue   previous = r3         r3 ends S's latest turn: the next turn runs on S itself
    branch     previous = r1         S has moved on past r1: a fork of S after turn 0 (warm from
                                     S's KV, `SessionManager.fork`) runs the turn; S is untouched

Deleting a response removes its record only, with the idempotency key it answered (a retry with
that key runs anew, never replays it): it can no longer be retrieved or continued from, while the
session keeps the turn, so responses created after it (on the same session, or on forks of it)
keep their whole context and can still be retrieved and continued. Once a session has no
stored response left (and no conversation is held by it), the session goes too (its transcript
and its cache in every tier): deleting every response of a chain leaves nothing of it. A response
created with `store: false` has no record at all.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy

from cache.ids import TenantId
from sessions.errors import ChatKVError, ResponseNotFound, SessionNotFound
from storage.errors import SessionGone
from storage.idempotency_store import Claimed
from storage.response_store import ResponseRecord, ResponseStore
from storage.schema import utcnow

RESPONSE_ID_PREFIX = "resp_"


@dataclass(frozen=True)
class ResponsePoint:
    """Where a stored response is: turn `turn_index` (0-based) of `session_id`; `latest` when that
    turn is the session's last (a next turn continues the session, else forks it)."""

    id: str
    session_id: str
    turn_index: int
    latest: bool


class ResponseRecords:
    """The stored responses of one manager's tenants (see the module docstring). Thread-safe.

    Args:
        database: the metadata database.
        delete_session: deletes the tenant's session, caches in every tier included.
        held_by_conversation: whether a conversation of the tenant is held by the session.
    """

    def __init__(
        self,
        database: sqlalchemy.Engine,
        *,
        delete_session: Callable[[TenantId, str], None],
        held_by_conversation: Callable[[TenantId, str], bool],
    ) -> None:
        self._store = ResponseStore(database)
        self._delete_session = delete_session
        self._held = held_by_conversation

    @staticmethod
    def new_id() -> str:
        """A fresh response id (`resp_` and 24 hex digits)."""
        return RESPONSE_ID_PREFIX + secrets.token_hex(12)

    def point(self, tenant_id: TenantId, response_id: str) -> ResponsePoint:
        """Where the tenant's stored response `response_id` is (one query: a turn after it asks
        before its first token).

        Raises:
            ResponseNotFound: for a missing id, another tenant's, or one whose session is gone.
        """
        where = self._store.locate(tenant_id=tenant_id, response_id=str(response_id))
        if where is None:
            raise ResponseNotFound(str(response_id))
        latest = where.turn_index + 1 == where.session_turns
        return ResponsePoint(str(response_id), where.session_id, where.turn_index, latest)

    def stored(self, tenant_id: TenantId, response_id: str) -> ResponseRecord:
        """The tenant's stored response `response_id` with its JSON texts (the response object as
        answered, the input items it was created with).

        Raises:
            ResponseNotFound: for a missing id or another tenant's.
        """
        record = self._store.get(tenant_id=tenant_id, response_id=str(response_id))
        if record is None:
            raise ResponseNotFound(str(response_id))
        return record

    def record(
        self,
        tenant_id: TenantId,
        response_id: str,
        *,
        session_id: str,
        turn_index: int,
        previous_response_id: str | None,
        response: str,
        input_items: str,
        answers: Claimed | None = None,
        conversation_id: str | None = None,
    ) -> None:
        """Store a response that ends turn `turn_index` of the tenant's session; with `answers`
        (a claimed `Idempotency-Key`), it becomes the key's answer in the same transaction, so
        no retry can run the turn again once the response exists. The key's answer goes with the
        response, and with the conversation `conversation_id` it was created in, if any.

        Raises:
            SessionNotFound: if the session was deleted meanwhile (nothing stored, the key still
                claimed).
        """
        try:
            self._store.add(
                ResponseRecord(
                    id=response_id,
                    tenant_id=tenant_id,
                    session_id=session_id,
                    turn_index=turn_index,
                    previous_response_id=previous_response_id,
                    response=response,
                    input_items=input_items,
                    created_at=utcnow(),
                ),
                answers=answers,
                conversation_id=conversation_id,
            )
        except SessionGone:
            raise SessionNotFound(session_id) from None

    def delete(self, tenant_id: TenantId, response_id: str) -> None:
        """Delete the tenant's stored response; its session too when no other response of it is
        stored (see the module docstring).

        Raises:
            ResponseNotFound: for a missing id or another tenant's.
        """
        record = self._store.delete(tenant_id=tenant_id, response_id=str(response_id))
        if record is None:
            raise ResponseNotFound(str(response_id))
        self.release_session(tenant_id, record.session_id)

    def release_session(self, tenant_id: TenantId, session_id: str) -> None:
        """Delete the tenant's session unless a stored response points into it or a conversation
        is held by it."""
        if self._store.count_in_session(tenant_id=tenant_id, session_id=session_id) or self._held(
            tenant_id, session_id
        ):
            return
        with contextlib.suppress(ChatKVError):  # deleted meanwhile
            self._delete_session(tenant_id, session_id)
