"""Answers recorded under clients' idempotency keys, so a retried request does not run twice.

A client that retries a request after a timeout (the official OpenAI client does so by default)
cannot know whether the first attempt ran. With an `Idempotency-Key` header, the first request
with the key claims it (`claim`), and a retry then finds one of three things:

    no row, or an expired one      -> Claimed: run the request, then `complete` (or `release`)
    state "done", same request     -> Replay: the recorded answer
    state "running", same request  -> InProgress (the first attempt still runs; retry shortly)
    another request's digest       -> KeyReused

A claim is one INSERT, so of two requests with one key at once exactly one runs. A `running` row
older than `stale_s` is taken over (its process died before completing or releasing it).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Engine, delete, select, update
from sqlalchemy.exc import IntegrityError

from storage.database import Repository
from storage.schema import IdempotencyKeyRow, utcnow

RUNNING = "running"
DONE = "done"


@dataclass(frozen=True)
class Claimed:
    """The caller holds the key: run the request, then `complete` or `release` it."""


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
    """The key was used for a different request (another body or route)."""


ClaimOutcome = Claimed | Replay | InProgress | KeyReused


class IdempotencyStore(Repository):
    """Rows of `idempotency_keys`, one unit of work per method.

    Args:
        ttl_s: how long an answer stays replayable (seconds); an older row counts as absent.
        stale_s: how long a `running` row blocks its key before it is taken over (seconds).
    """

    def __init__(self, database: Engine, *, ttl_s: float, stale_s: float) -> None:
        super().__init__(database)
        if ttl_s <= 0 or stale_s <= 0:
            raise ValueError(f"ttl_s and stale_s must be > 0 seconds, got {ttl_s} and {stale_s}")
        self.ttl_s = ttl_s
        self.stale_s = stale_s

    def claim(self, *, tenant_id: str, key: str, request_digest: str) -> ClaimOutcome:
        """Claim `key` for a request with `request_digest`, or say why not (see the module)."""
        now = utcnow()
        expired = now - timedelta(seconds=self.ttl_s)
        with self._unit() as db:
            db.execute(
                delete(IdempotencyKeyRow).where(
                    IdempotencyKeyRow.tenant_id == tenant_id, IdempotencyKeyRow.created_at < expired
                )
            )
        try:
            with self._unit() as db:
                db.add(
                    IdempotencyKeyRow(
                        tenant_id=tenant_id, key=key, request_digest=request_digest, state=RUNNING, created_at=now
                    )
                )
            return Claimed()
        except IntegrityError:
            pass  # the key has a row: it says what this request is
        with self._unit() as db:
            row = db.get(IdempotencyKeyRow, (tenant_id, key))
            if row is None:  # deleted since the insert failed (released, or its session deleted)
                return InProgress()
            if row.request_digest != request_digest:
                return KeyReused()
            if row.state == DONE and row.response is not None:
                return Replay(row.response, row.session_id)
            if row.created_at >= now - timedelta(seconds=self.stale_s):
                return InProgress()
            taken = db.execute(
                update(IdempotencyKeyRow)
                .where(
                    IdempotencyKeyRow.tenant_id == tenant_id,
                    IdempotencyKeyRow.key == key,
                    IdempotencyKeyRow.state == RUNNING,
                    IdempotencyKeyRow.created_at == row.created_at,
                )
                .values(created_at=now)
            )
            return Claimed() if getattr(taken, "rowcount", 0) else InProgress()

    def complete(self, *, tenant_id: str, key: str, response: str, session_id: str | None) -> None:
        """Record the claimed request's answer (JSON text). A row gone meanwhile (its session or
        tenant deleted) records nothing."""
        try:
            with self._unit() as db:
                db.execute(
                    update(IdempotencyKeyRow)
                    .where(IdempotencyKeyRow.tenant_id == tenant_id, IdempotencyKeyRow.key == key)
                    .values(state=DONE, response=response, session_id=session_id)
                )
        except IntegrityError:  # the session was deleted as the turn finished: nothing to replay
            self.release(tenant_id=tenant_id, key=key)

    def release(self, *, tenant_id: str, key: str) -> None:
        """Give up a claim whose request did not complete: a retry runs it afresh."""
        with self._unit() as db:
            db.execute(
                delete(IdempotencyKeyRow).where(
                    IdempotencyKeyRow.tenant_id == tenant_id,
                    IdempotencyKeyRow.key == key,
                    IdempotencyKeyRow.state == RUNNING,
                )
            )

    def created_at(self, *, tenant_id: str, key: str) -> datetime | None:
        """When the key was claimed (for tests and operators), or `None`."""
        with self._unit() as db:
            return db.scalar(
                select(IdempotencyKeyRow.created_at).where(
                    IdempotencyKeyRow.tenant_id == tenant_id, IdempotencyKeyRow.key == key
                )
            )
