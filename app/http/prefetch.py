"""Restoring sessions' caches to the device before their next message arrives (the API's
`POST /v1/sessions/{id}/prefetch`, and the UI when a session is selected)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from sessions import ChatKVError, SessionId, Tenant, TenantId

if TYPE_CHECKING:
    from sessions import SessionManager

log = logging.getLogger(__name__)

PREFETCH_WORKERS = 2
"""Restores under way at once (each decrypts and decodes a blob: CPU and memory bandwidth)."""


class Prefetcher:
    """Restores sessions' caches to the device in the background (`SessionManager.restore_session`),
    a few at a time, each session at most once at a time."""

    def __init__(self, manager: SessionManager) -> None:
        self._manager = manager
        self._pool = ThreadPoolExecutor(max_workers=PREFETCH_WORKERS, thread_name_prefix="chatkv-prefetch")
        self._pending: set[tuple[TenantId, SessionId]] = set()
        self._lock = threading.Lock()

    def start(self, tenant: Tenant, session_id: SessionId) -> None:
        key = (tenant.id, session_id)
        with self._lock:
            if key in self._pending:
                return
            self._pending.add(key)
        self._pool.submit(self._restore, tenant, session_id)

    def _restore(self, tenant: Tenant, session_id: SessionId) -> None:
        try:
            self._manager.restore_session(tenant, session_id)
        # A turn arrived first (busy: its cache is on the device), or the session went: nothing to do.
        except ChatKVError as exc:
            log.debug("prefetch of session %s skipped: %s", session_id, exc)
        finally:
            with self._lock:
                self._pending.discard((tenant.id, session_id))

    def close(self) -> None:
        """Wait for the restores under way (before the manager closes)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
