"""Retention for stateless clients: sessions made for a posted history, and forks nobody
continued, expire after a sliding idle TTL (`Settings.implicit_retention_s`, 30 days by default
like OpenAI's stored responses; a tenant may set its own). Explicit and named sessions are kept
(`chatkv gc` with `session_retention_s` removes any idle session).

`chatkv serve` runs the sweep in a background thread (`RetentionSweeper`); an embedding program
may call `SessionManager.expire_sessions()` itself. Expiry is a deletion: caches in every tier go
first (`SessionCatalogue.delete`), so nothing of an expired session stays readable.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from datetime import datetime

from cache.ids import SessionId, TenantId
from sessions.errors import ChatKVError
from storage.history_store import ExpiredSession, HistoryStore
from storage.schema import utcnow

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 600.0
"""How often `chatkv serve` looks for expired sessions (a TTL is days: minutes late is fine)."""


class Retention:
    """Expires implicit sessions and uncontinued forks. Thread-safe.

    Args:
        history: finds them.
        delete: deletes one (caches in every tier, then rows); raises `SessionNotFound` if gone.
        last_active: a session's last activity now (an expired one may have come back to life
            since it was listed); `None` when it is gone.
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
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._history = history
        self._delete = delete
        self._last_active = last_active
        self.default_retention_s = default_retention_s
        self.clock = clock

    def expire(self) -> list[ExpiredSession]:
        """Delete every session whose retention ran out now; returns those deleted."""
        now = self.clock()
        deleted = []
        for expired in self._history.expired(now=now, default_retention_s=self.default_retention_s):
            tenant_id, session_id = TenantId(expired.tenant_id), SessionId(expired.session_id)
            with contextlib.suppress(ChatKVError):  # gone meanwhile, or busy: the next sweep decides
                if self._last_active(tenant_id, session_id) == expired.last_active_at:
                    self._delete(tenant_id, session_id)
                    deleted.append(expired)
        if deleted:
            log.info("expired %d idle sessions (implicit, or forks nobody continued)", len(deleted))
        return deleted


class RetentionSweeper:
    """Runs `Retention.expire` every `interval_s` in a daemon thread until `close`."""

    def __init__(self, retention: Retention, interval_s: float = SWEEP_INTERVAL_S) -> None:
        self._retention = retention
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chatkv-retention", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._retention.expire()
            # The sweeper's thread must outlive one failed sweep (a database outage, say): the
            # next one tries again. Logged with its traceback, never swallowed silently.
            except Exception:
                log.exception("the retention sweep failed; retrying in %.0f s", self._interval_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
