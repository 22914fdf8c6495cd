"""Idempotent turns: a request sent with an `Idempotency-Key` runs once; a retry of it gets the
answer the first one recorded (`storage.idempotency_store` has the rules).

The HTTP routes that create turns claim the key before the turn, record the answer when the turn
completes (a stored response records it in the transaction that stores it:
`ResponseRecords.record(answers=...)`) and give the claim up when it does not (refused, failed,
cancelled because its client went away), so the client's retry then runs the turn afresh. A claim
belongs to this process's incarnation: if the process dies, its claims die with it (as its
sessions' leases do), and a retry runs the turn instead of waiting.

A request is what the turn does: its route, the headers that say where it goes (`X-Session-ID`),
and its body. The same key with the same body aimed at another session is another request.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping

import sqlalchemy

from sessions.errors import InvalidInput
from storage.idempotency_store import Claimed, ClaimOutcome, IdempotencyStore, InProgress, KeyReused, Replay

IDEMPOTENCY_TTL_S = 24 * 3600.0
"""How long a recorded answer is replayed (Stripe's window; a client retries within minutes)."""
IDEMPOTENCY_STALE_S = 15 * 60.0
"""How long a claim made before claims named their holder (migration 0011) blocks its key."""
_KEY = re.compile(r"[\x21-\x7e]{1,255}")

__all__ = ["ClaimOutcome", "Claimed", "IdempotentRequests", "InProgress", "KeyReused", "Replay"]


class IdempotentRequests:
    """Idempotency keys of one manager's tenants (see the module docstring). Thread-safe.

    Args:
        database: the metadata database.
        incarnation: this process's incarnation (`Replicas.incarnation`): the holder of its claims.
        live_within_s: a claim's holder whose replica heartbeat this long ago is dead (the
            replicas' lease time, seconds).
    """

    def __init__(self, database: sqlalchemy.Engine, *, incarnation: Callable[[], str], live_within_s: float) -> None:
        self._store = IdempotencyStore(
            database, ttl_s=IDEMPOTENCY_TTL_S, stale_s=IDEMPOTENCY_STALE_S, live_within_s=live_within_s
        )
        self._incarnation = incarnation

    def claim(
        self, tenant_id: str, key: str, route: str, body: bytes, target: Mapping[str, str | None] | None = None
    ) -> ClaimOutcome:
        """Claim `key` for the request `route` + `target` + `body` (bytes as received; `target`:
        the headers that say where the turn goes, by name, `None` for one not sent).

        Raises:
            InvalidInput: if `key` is not 1-255 printable ASCII characters.
        """
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise InvalidInput("Idempotency-Key must be 1-255 printable ASCII characters without spaces")
        where = json.dumps(sorted((target or {}).items())).encode()
        digest = hashlib.sha256(route.encode() + b"\0" + where + b"\0" + body).hexdigest()
        return self._store.claim(tenant_id=tenant_id, key=key, request_digest=digest, holder=self._incarnation())

    def complete(self, claim: Claimed, response: str, session_id: str | None) -> None:
        """Record the answer (JSON text) of a claimed request."""
        self._store.complete(claim, response=response, session_id=session_id)

    def release(self, claim: Claimed) -> None:
        """Give up a claim whose request did not complete."""
        self._store.release(claim)
