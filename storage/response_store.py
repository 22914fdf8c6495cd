"""Stored responses (OpenAI's Responses API): each row is a point in a session, the end of one of
its turns, with the response object as it was answered and the input items it was created with.

    responses   id (resp_...), tenant, session, turn_index, previous_response_id, JSON texts
                the row goes with its tenant and its session (ON DELETE CASCADE); the
                idempotency key it answers goes with it

Every read is keyed by tenant and id: another tenant's id reads like a missing one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError

from storage.database import Repository
from storage.errors import SessionGone
from storage.idempotency_store import Claimed, complete_with_response
from storage.schema import MessageRow, ResponseRow, SessionRow, utcnow


@dataclass(frozen=True)
class ResponseRecord:
    """One stored response: turn `turn_index` (0-based) of session `session_id` ends at it."""

    id: str
    tenant_id: str
    session_id: str
    turn_index: int
    previous_response_id: str | None
    response: str
    """The response object as answered (JSON text)."""
    input_items: str
    """The input items it was created with (JSON text of a list)."""
    created_at: datetime


@dataclass(frozen=True)
class ResponseLocation:
    """Where a stored response is: turn `turn_index` of `session_id`, which holds `session_turns`
    turns now."""

    session_id: str
    turn_index: int
    session_turns: int


class ResponseStore(Repository):
    """Rows of `responses`, one unit of work per method."""

    def add(
        self, record: ResponseRecord, *, answers: Claimed | None = None, conversation_id: str | None = None
    ) -> None:
        """Store a response; with `answers`, in the same transaction make it the answer of that
        claimed idempotency key (`storage.idempotency_store.complete_with_response`; the key's
        row goes with the response, and with `conversation_id`, the conversation it was made in).

        Raises:
            SessionGone: if its session (or tenant) was deleted meanwhile (nothing stored, the
                key still claimed).
        """
        try:
            with self._unit() as db:
                db.add(
                    ResponseRow(
                        id=record.id,
                        tenant_id=record.tenant_id,
                        session_id=record.session_id,
                        turn_index=record.turn_index,
                        previous_response_id=record.previous_response_id,
                        response=record.response,
                        input_items=record.input_items,
                        created_at=record.created_at or utcnow(),
                    )
                )
                if answers is not None:
                    db.flush()  # the key's row refers to the response's
                    complete_with_response(
                        db,
                        answers,
                        session_id=record.session_id,
                        response_id=record.id,
                        conversation_id=conversation_id,
                    )
        except IntegrityError:
            raise SessionGone(record.session_id) from None

    def get(self, *, tenant_id: str, response_id: str) -> ResponseRecord | None:
        """The tenant's response `response_id`, or `None` (missing, or another tenant's)."""
        with self._unit() as db:
            row = db.scalar(
                select(ResponseRow).where(ResponseRow.tenant_id == tenant_id, ResponseRow.id == response_id)
            )
            return None if row is None else _record(row)

    def locate(self, *, tenant_id: str, response_id: str) -> ResponseLocation | None:
        """Where the tenant's response `response_id` is, or `None` (missing, another tenant's, or
        its session gone). One query, without the JSON columns: it is on a turn's first-token
        path (`previous_response_id`)."""
        messages = (
            select(func.count()).select_from(MessageRow).where(MessageRow.session_id == ResponseRow.session_id)
        ).scalar_subquery()
        with self._unit() as db:
            row = db.execute(
                select(ResponseRow.session_id, ResponseRow.turn_index, messages)
                .join(SessionRow, (SessionRow.id == ResponseRow.session_id) & (SessionRow.tenant_id == tenant_id))
                .where(ResponseRow.tenant_id == tenant_id, ResponseRow.id == response_id)
            ).one_or_none()
            if row is None:
                return None
            return ResponseLocation(row[0], row[1], int(row[2]) // 2)  # a turn is two messages

    def delete(self, *, tenant_id: str, response_id: str) -> ResponseRecord | None:
        """Delete the tenant's response; returns what it was, or `None` if there was none."""
        with self._unit() as db:
            row = db.scalar(
                select(ResponseRow).where(ResponseRow.tenant_id == tenant_id, ResponseRow.id == response_id)
            )
            if row is None:
                return None
            record = _record(row)
            db.execute(delete(ResponseRow).where(ResponseRow.id == response_id))
            return record

    def count_in_session(self, *, tenant_id: str, session_id: str) -> int:
        """How many responses of the tenant's session are stored."""
        with self._unit() as db:
            count = db.scalar(
                select(func.count())
                .select_from(ResponseRow)
                .where(ResponseRow.tenant_id == tenant_id, ResponseRow.session_id == session_id)
            )
            return int(count or 0)


def _record(row: ResponseRow) -> ResponseRecord:
    return ResponseRecord(
        id=row.id,
        tenant_id=row.tenant_id,
        session_id=row.session_id,
        turn_index=row.turn_index,
        previous_response_id=row.previous_response_id,
        response=row.response,
        input_items=row.input_items,
        created_at=row.created_at,
    )
