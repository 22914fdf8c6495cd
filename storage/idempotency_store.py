"""Answers recorded under clients' idempotency keys, so a retried request does not run twice.

A client that retries a request after a timeout (the official OpenAI client does so by default)
cannot know whether the first attempt ran. With an `Idempotency-Key` header, the first request
with the key claims it (`claim`), and a retry then finds one of these:

    no row, or an expired one                  -> Claimed: run the request, then `complete` (or
                                                  `release`)
    state "done", same request                 -> Replay: the recorded answer
    state "running", same request, its holder  -> InProgress (the first attempt still runs; retry
      alive                                       shortly)
    state "running", same request, its holder  -> Claimed: taken over (the process that claimed it
      dead                                        died before completing or releasing it)
    another request's digest                   -> KeyReused

A claim is one INSERT, so of two requests with one key at once exactly one runs. A claim names
its holder, the incarnation of the process that made it (`ReplicaRow.incarnation`, or a single
process's own): it is alive while it is the claimant's own, or while a replica of that
incarnation heartbeats (within `live_within_s`, the replicas' lease time: a claim dies with the
process, as its sessions' leases do). A single process shares its database with nobody, so
another incarnation's claim there is a dead process's. Rows from before holders existed block
their key for `stale_s`.

A stored response (Responses API) completes its key in the transaction that stores it
(`complete_with_response`): the key's answer is that row, read from it on a replay, and deleting
the response (or the conversation it was created in) deletes the key's row (foreign keys), so a
deleted response is never replayed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Engine, delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from storage.database import Repository
from storage.schema import IdempotencyKeyRow, ReplicaRow, ResponseRow, utcnow

RUNNING = "running"
DONE = "done"


@dataclass(frozen=True)
class Claimed:
    """The caller holds the key (`holder`: its incarnation): run the request, then `complete` or
    `release` it."""

    tenant_id: str
    key: str
    holder: str


@dataclass(frozen=True)
class Replay:
    """The request ran before: its recorded answer (JSON text) and session."""

    response: str
    session_id: str | None


@dataclass(frozen=True)
class InProgress:
    """The first request with this key is still running."""


@dataclass(frozen=True)
class KeyReused:
    """The key was used for a different request (another body, route or target session)."""


ClaimOutcome = Claimed | Replay | InProgress | KeyReused


class IdempotencyStore(Repository):
    """Rows of `idempotency_keys`, one unit of work per method.

    Args:
        ttl_s: how long an answer stays replayable (seconds); an older row counts as absent.
        stale_s: how long a `running` row without a holder (older than migration 0011) blocks
            its key (seconds).
        live_within_s: a holder whose replica heartbeat this long ago (seconds) or longer is dead.

    Raises:
        ValueError: for a duration that is not > 0.
    """

    def __init__(self, database: Engine, *, ttl_s: float, stale_s: float, live_within_s: float) -> None:
        super().__init__(database)
        if ttl_s <= 0 or stale_s <= 0 or live_within_s <= 0:
            raise ValueError(
                f"ttl_s, stale_s and live_within_s must be > 0 seconds, got {ttl_s}, {stale_s} and {live_within_s}"
            )
        self.ttl_s = ttl_s
        self.stale_s = stale_s
        self.live_within_s = live_within_s

    def claim(self, *, tenant_id: str, key: str, request_digest: str, holder: str) -> ClaimOutcome:
        """Claim `key` for a request with `request_digest` on behalf of the process `holder`, or
        say why not (see the module)."""
        now = utcnow()
        with self._unit() as db:
            db.execute(
                delete(IdempotencyKeyRow).where(
                    IdempotencyKeyRow.tenant_id == tenant_id,
                    IdempotencyKeyRow.created_at < now - timedelta(seconds=self.ttl_s),
                )
            )
        try:
            with self._unit() as db:
                db.add(
                    IdempotencyKeyRow(
                        tenant_id=tenant_id,
                        key=key,
                        request_digest=request_digest,
                        state=RUNNING,
                        created_at=now,
                        holder=holder,
                    )
                )
            return Claimed(tenant_id, key, holder)
        except IntegrityError:
            pass  # the key has a row: it says what this request is
        with self._unit() as db:
            row = db.get(IdempotencyKeyRow, (tenant_id, key))
            if row is None:  # deleted since the insert failed (released, or its session deleted)
                return InProgress()
            if row.request_digest != request_digest:
                return KeyReused()
            if row.state == DONE:
                answer = row.response
                if row.response_id is not None:
                    answer = db.scalar(select(ResponseRow.response).where(ResponseRow.id == row.response_id))
                if answer is not None:
                    return Replay(answer, row.session_id)
            if self._alive(db, row, holder, now):
                return InProgress()
            taken = db.execute(
                update(IdempotencyKeyRow)
                .where(
                    IdempotencyKeyRow.tenant_id == tenant_id,
                    IdempotencyKeyRow.key == key,
                    IdempotencyKeyRow.state == RUNNING,
                    IdempotencyKeyRow.created_at == row.created_at,
                    IdempotencyKeyRow.holder.is_not_distinct_from(row.holder),
                )
                .values(created_at=now, holder=holder)
            )
            return Claimed(tenant_id, key, holder) if getattr(taken, "rowcount", 0) else InProgress()

    def _alive(self, db: Session, row: IdempotencyKeyRow, holder: str, now: datetime) -> bool:
        """Whether the process holding the `running` claim `row` may still complete it."""
        if row.holder is None:
            return row.created_at >= now - timedelta(seconds=self.stale_s)
        if row.holder == holder:
            return True
        heartbeat = db.scalar(select(ReplicaRow.heartbeat_unix_s).where(ReplicaRow.incarnation == row.holder))
        return heartbeat is not None and heartbeat >= time.time() - self.live_within_s

    def complete(self, claim: Claimed, *, response: str, session_id: str | None) -> None:
        """Record the claimed request's answer (JSON text). A row gone meanwhile (its session or
        tenant deleted), or taken over by another process, records nothing."""
        try:
            with self._unit() as db:
                db.execute(
                    update(IdempotencyKeyRow)
                    .where(*_held(claim))
                    .values(state=DONE, response=response, session_id=session_id)
                )
        except IntegrityError:  # the session was deleted as the turn finished: nothing to replay
            self.release(claim)

    def release(self, claim: Claimed) -> None:
        """Give up a claim whose request did not complete: a retry runs it afresh."""
        with self._unit() as db:
            db.execute(delete(IdempotencyKeyRow).where(*_held(claim)))

    def created_at(self, *, tenant_id: str, key: str) -> datetime | None:
        """When the key was claimed (for tests and operators), or `None`."""
        with self._unit() as db:
            return db.scalar(
                select(IdempotencyKeyRow.created_at).where(
                    IdempotencyKeyRow.tenant_id == tenant_id, IdempotencyKeyRow.key == key
                )
            )


def complete_with_response(
    db: Session, claim: Claimed, *, session_id: str, response_id: str, conversation_id: str | None
) -> None:
    """Inside the unit of work that stored the response `response_id` (flushed): make it the
    claimed key's answer, so the key is done exactly when the response exists (see the module).
    The key's row then goes with the response, its session and its conversation (if any)."""
    db.execute(
        update(IdempotencyKeyRow)
        .where(*_held(claim))
        .values(
            state=DONE,
            response=None,
            session_id=session_id,
            response_id=response_id,
            conversation_id=conversation_id,
        )
        .execution_options(synchronize_session=False)
    )


def _held(claim: Claimed) -> tuple[ColumnElement[bool], ...]:
    """The conditions of the key's row while `claim` still holds it (running, by its holder)."""
    return (
        IdempotencyKeyRow.tenant_id == claim.tenant_id,
        IdempotencyKeyRow.key == claim.key,
        IdempotencyKeyRow.state == RUNNING,
        IdempotencyKeyRow.holder == claim.holder,
    )
