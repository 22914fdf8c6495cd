"""This process's part among replicas (docs/replicas.md): its replica id and the ownership leases
it holds (`sessions.replicas.ownership`). A single process has neither; every call here is then inert (a
turn holds nothing, every session is this process's to publish).
"""

from __future__ import annotations

import logging
import secrets
import time
from contextlib import AbstractContextManager, nullcontext

from cache.tiers import CacheKey
from sessions.replicas.ownership import SessionOwnership
from sessions.replicas.routing import Route, Router
from storage.replica_store import OwnerToken

log = logging.getLogger(__name__)


class Replicas:
    """The replica role of one manager. Built before the tier manager (which asks `may_publish`),
    started once the tiers exist (`start`: the keeper publishes through them).

    Args:
        replica_id: this replica's id; `None` for a single process.
        configured_url: `Settings.replica_url` (it wins over the address `chatkv serve` reports).
        forward: `Settings.routing == "forward"` (`sessions.replicas.routing`).
        forward_queue_limit: `Settings.forward_queue_limit`.
    """

    def __init__(
        self,
        replica_id: str | None,
        configured_url: str | None = None,
        *,
        forward: bool = False,
        forward_queue_limit: int = 0,
    ) -> None:
        self.replica_id = replica_id
        self._configured_url = configured_url
        self._forward, self._queue_limit = forward, forward_queue_limit
        self.ownership: SessionOwnership | None = None
        self._router: Router | None = None
        self._single_incarnation = secrets.token_hex(8)

    @property
    def incarnation(self) -> str:
        """This process's incarnation: the one its replica registered (`SessionOwnership`), or
        a single process's own (random per manager). Claims it makes die with it."""
        return self.ownership.incarnation if self.ownership is not None else self._single_incarnation

    def start(self, ownership: SessionOwnership) -> None:
        """Take up the leases' keeper (registered and running: `sessions.replicas.startup.start_ownership`)."""
        self.ownership = ownership
        self._router = Router(ownership, forward=self._forward, queue_limit=self._queue_limit)

    def route(self, key: CacheKey | None, *, forwarded: bool) -> Route:
        """Where a turn of the session `key` (`None`: a new session) runs; always here for a single
        process. See `sessions.replicas.routing`."""
        if self._router is None:
            return Route("local", key.name if key is not None else None)
        return self._router.route(key, forwarded=forwarded)

    def forward_failed(self, route: Route, error: str) -> Route:
        """The route after a forward to `route.url` failed before the request got there: a
        hand-over (the turn's hold waits for the owner to release the session, or its lease to
        expire)."""
        log.warning(
            "forwarding a turn to %s at %s failed (%s); taking the session over", route.replica_id, route.url, error
        )
        return Route("handover", route.session_id, None, route.replica_id, "forward_failed")

    @property
    def draining(self) -> bool:
        return self.ownership is not None and self.ownership.draining

    def drain(self) -> None:
        """Hand every session over as its turns end and take no new ones where another replica can
        (`SessionOwnership.drain`); nothing to do for a single process."""
        if self.ownership is not None:
            self.ownership.drain()

    def hold(self, key: CacheKey) -> AbstractContextManager[OwnerToken | None]:
        """The session's ownership lease while a turn (or a pin, or a pre-warm) runs; nothing to
        hold for a single process.

        Raises:
            SessionNotFound, SessionOwnedElsewhere, ReplicaRetired: see `SessionOwnership.hold`.
        """
        return self.ownership.hold(key) if self.ownership is not None else nullcontext()

    def may_publish(self, key: CacheKey) -> bool:
        """A write-back may publish to Redis only while this replica owns the session."""
        return self.ownership is None or self.ownership.owns(key)

    def set_url(self, url: str) -> None:
        """The URL this process serves at, shown to clients of other replicas refused a session
        this replica owns. `Settings.replica_url` wins."""
        if self.ownership is not None and not self._configured_url:
            self.ownership.set_url(url)

    def owner(self, session_id: str) -> tuple[str | None, str | None]:
        """The replica holding the session's lease now and its URL (`None`s: nobody, or a single
        process)."""
        if self.ownership is None:
            return None, None
        lease = self.ownership.store.owner(session_id=session_id)
        if lease is None or lease.expires_unix_s < time.time():
            return None, None
        return lease.replica_id, lease.owner_url

    def close(self) -> None:
        """Publish the sessions held and stop the keeper, so other replicas take them at once."""
        if self.ownership is not None:
            self.ownership.close()
