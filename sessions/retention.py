"""Retention for stateless clients: sessions made for a posted history, and forks nobody
continued, expire after a sliding idle TTL (`Settings.implicit_retention_s`, 30 days by default
like OpenAI's stored responses; a tenant may set its own). Explicit and named sessions are kept
(`chatkv gc` with `session_retention_s` removes any idle session).

`chatkv serve` runs the sweep in a background thread (`RetentionSweeper`: at start, then every
`SWEEP_INTERVAL_S`); `chatkv gc` runs it once; an embedding program may call
`SessionManager.expire_sessions()` itself. Expiry is a deletion: caches in every tier go first
(`SessionCatalogue.delete`), so nothing of an expired session stays readable.

    origin      explicit   named   implicit         fork
    kept        always     always  until idle TTL   until idle TTL, unless a turn followed the fork
    TTL         tenants.implicit_retention_s, else Settings.implicit_retention_s (sliding: from the
                session's last activity, which every turn moves)
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime, timedelta
from typing import Protocol

from cache.ids import SessionId, TenantId
from sessions.errors import ChatKVError, InvalidInput
from sessions.settings import MAX_DURATION_S
from storage.history_store import ExpiredSession, HistoryStore
from storage.schema import utcnow

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 600.0
"""How often `chatkv serve` looks for expired sessions (a TTL is days: minutes late is fine)."""


def check_retention_s(retention_s: object) -> float | None:
    """A tenant's TTL as given (seconds, or `None` for the server's). Raises `InvalidInput` for
    anything but a number in (0, 100 years] or `None`."""
    if retention_s is None:
        return None
    if isinstance(retention_s, bool) or not isinstance(retention_s, int | float):
        raise InvalidInput(f"a retention must be a number of seconds, got {retention_s!r}")
    if not 0 < retention_s <= MAX_DURATION_S:
        raise InvalidInput(f"a retention must be in (0, 100 years] seconds, got {retention_s!r}")
    return float(retention_s)


class RetainedSession(Protocol):
    """What decides a session's retention (`SessionInfo` and `storage`'s `SessionRecord` have it)."""

    @property
    def origin(self) -> str: ...
    @property
    def message_count(self) -> int: ...
    @property
    def fork_turns(self) -> int | None: ...
    @property
    def last_active_at(self) -> datetime: ...


def expires_at(
    record: RetainedSession, tenant_retention_s: float | None, default_retention_s: float
) -> datetime | None:
    """When the session expires if it stays idle (UTC), or `None` when it is kept: the rule of
    `HistoryStore.expired` (which finds them in SQL) for one session the caller holds."""
    uncontinued_fork = record.origin == "fork" and record.message_count <= 2 * (record.fork_turns or 0)
    if record.origin != "implicit" and not uncontinued_fork:
        return None
    ttl = tenant_retention_s if tenant_retention_s is not None else default_retention_s
    return record.last_active_at + timedelta(seconds=ttl)


class Retention:
    """Expires implicit sessions and uncontinued forks. Thread-safe.

    Args:
        history: finds them.
        delete: deletes one (caches in every tier, then rows); raises `SessionNotFound` if gone.
        last_active: a session's last activity now (an expired one may have come back to life
            since it was listed); `None` when it is gone.
        hold: held around reading `last_active` and deleting, so no turn runs on the session
            meanwhile; raises a `ChatKVError` (`SessionBusy`) while a turn is in flight on it.
        default_retention_s: the TTL of tenants without their own.
        clock: the current UTC time (tests control it).
    """

    def __init__(
        self,
        *,
        history: HistoryStore,
        delete: Callable[[TenantId, SessionId], None],
        last_active: Callable[[TenantId, SessionId], datetime | None],
        default_retention_s: float,
        hold: Callable[[TenantId, SessionId], AbstractContextManager[object]] = lambda t, s: nullcontext(),
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._history = history
        self._delete = delete
        self._last_active = last_active
        self._hold = hold
        self.default_retention_s = default_retention_s
        self.clock = clock

    def due(self) -> list[ExpiredSession]:
        """The sessions whose retention ran out now (oldest first, at most 1,000), none deleted."""
        return self._history.expired(now=self.clock(), default_retention_s=self.default_retention_s)

    def expire(self) -> list[ExpiredSession]:
        """Delete the sessions whose retention ran out now (at most 1,000 per call) unless a turn
        made them active since they were listed; returns those deleted."""
        deleted = []
        for expired in self.due():
            tenant_id, session_id = TenantId(expired.tenant_id), SessionId(expired.session_id)
            # Gone meanwhile, or busy (a turn in flight will make it active): the next sweep decides.
            with contextlib.suppress(ChatKVError), self._hold(tenant_id, session_id):
                if self._last_active(tenant_id, session_id) == expired.last_active_at:
                    self._delete(tenant_id, session_id)
                    deleted.append(expired)
        if deleted:
            log.info("expired %d idle sessions (implicit, or forks nobody continued)", len(deleted))
        return deleted


class RetentionSweeper:
    """Runs `Retention.expire` at once, then every `interval_s`, in a daemon thread until `close`
    (at once: a server restarted more often than `interval_s` would otherwise never sweep)."""

    def __init__(self, retention: Retention, interval_s: float = SWEEP_INTERVAL_S) -> None:
        self._retention = retention
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chatkv-retention", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._retention.expire()
            # The sweeper's thread must outlive one failed sweep (a database outage, say): the
            # next one tries again. Logged with its traceback, never swallowed silently.
            except Exception:
                log.exception("the retention sweep failed; retrying in %.0f s", self._interval_s)
            self._stop.wait(self._interval_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
