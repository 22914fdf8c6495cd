"""Idempotent turns: a request sent with an `Idempotency-Key` runs once; a retry of it gets the
answer the first one recorded (`storage.idempotency_store` has the rules).

The HTTP routes that create turns claim the key before the turn, record the answer when the turn
completes and give the claim up when it does not (refused, failed, cancelled because its client
went away), so the client's retry then runs the turn afresh.
"""

from __future__ import annotations

import hashlib
import re

import sqlalchemy

from sessions.errors import InvalidInput
from storage.idempotency_store import Claimed, ClaimOutcome, IdempotencyStore, InProgress, KeyReused, Replay

IDEMPOTENCY_TTL_S = 24 * 3600.0
"""How long a recorded answer is replayed (Stripe's window; a client retries within minutes)."""
IDEMPOTENCY_STALE_S = 15 * 60.0
"""How long an unfinished claim blocks its key (the process that made it died)."""
_KEY = re.compile(r"[\x21-\x7e]{1,255}")

__all__ = ["ClaimOutcome", "Claimed", "IdempotentRequests", "InProgress", "KeyReused", "Replay"]


class IdempotentRequests:
    """Idempotency keys of one manager's tenants (see the module docstring). Thread-safe."""

    def __init__(self, database: sqlalchemy.Engine) -> None:
        self._store = IdempotencyStore(database, ttl_s=IDEMPOTENCY_TTL_S, stale_s=IDEMPOTENCY_STALE_S)

    def claim(self, tenant_id: str, key: str, route: str, body: bytes) -> ClaimOutcome:
        """Claim `key` for the request `route` + `body` (bytes as received).

        Raises:
            InvalidInput: if `key` is not 1-255 printable ASCII characters.
        """
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise InvalidInput("Idempotency-Key must be 1-255 printable ASCII characters without spaces")
        digest = hashlib.sha256(route.encode() + b"\0" + body).hexdigest()
        return self._store.claim(tenant_id=tenant_id, key=key, request_digest=digest)

    def complete(self, tenant_id: str, key: str, response: str, session_id: str | None) -> None:
        """Record the answer (JSON text) of a claimed request."""
        self._store.complete(tenant_id=tenant_id, key=key, response=response, session_id=session_id)

    def release(self, tenant_id: str, key: str) -> None:
        """Give up a claim whose request did not complete."""
        self._store.release(tenant_id=tenant_id, key=key)
