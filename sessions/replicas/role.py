"""This process's part among replicas (docs/replicas.md): its replica id and the ownership leases
it holds (`sessions.replicas.ownership`). A single process has neither; every call here is then inert (a
turn holds nothing, every session is this process's to publish).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext

from cache.tiers import CacheKey
from sessions.replicas.ownership import SessionOwnership
from storage.replica_store import OwnerToken


class Replicas:
    """The replica role of one manager. Built before the tier manager (which asks `may_publish`),
    started once the tiers exist (`start`: the keeper publishes through them).

    Args:
        replica_id: this replica's id; `None` for a single process.
        configured_url: `Settings.replica_url` (it wins over the address `chatkv serve` reports).
    """

    def __init__(self, replica_id: str | None, configured_url: str | None = None) -> None:
        self.replica_id = replica_id
        self._configured_url = configured_url
        self.ownership: SessionOwnership | None = None

    def start(self, ownership: SessionOwnership) -> None:
        """Take up the leases' keeper (registered and running: `sessions.replicas.startup.start_ownership`)."""
        self.ownership = ownership

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
