"""One turn's hold on a session's cache: what a turn may do with it while it runs.

A lease calls back the object that issued it through `LeaseIssuer`, a protocol declared here and
satisfied structurally by `TierManager` (cache/tier_manager.py), so this module does not import the
tier manager and the two do not form an import circle.
"""

from __future__ import annotations

from typing import Protocol

from cache.entries import SessionEntry
from cache.restore import Restored
from cache.session_cache import BaseLayer, SessionCache
from cache.tiers import CacheKey


class LeaseIssuer(Protocol):
    """The tier manager's calls on a leased entry, one per `Lease` method (see `TierManager`)."""

    def restore_lease(self, entry: SessionEntry) -> Restored: ...

    def commit_lease(self, entry: SessionEntry, cache: SessionCache) -> None: ...

    def adopt_base_for(self, entry: SessionEntry, base: BaseLayer) -> BaseLayer: ...

    def discard_lease(self, entry: SessionEntry) -> None: ...


class Lease:
    """One turn's hold on a session; created by `TierManager.lease`, which releases it when the
    `with` block ends. Each method is one call of the issuer on the leased entry."""

    def __init__(self, issuer: LeaseIssuer, entry: SessionEntry) -> None:
        self._issuer = issuer
        self._entry = entry
        self.committed = False

    @property
    def key(self) -> CacheKey:
        return self._entry.key

    def restore(self) -> Restored:
        """Bring the session's cache to the device (decrypt, decode, attach the base)."""
        return self._issuer.restore_lease(self._entry)

    def commit(self, cache: SessionCache) -> None:
        """Make `cache` (base attached) the session's device copy after a successful turn."""
        self._issuer.commit_lease(self._entry, cache)
        self.committed = True

    def adopt_base(self, base: BaseLayer) -> BaseLayer:
        """Put a base layer computed by this turn into the pool and return the pooled instance
        (another turn may have put the same key first; every session then shares that one). If
        the session was forgotten meanwhile (it or its tenant deleted), `base` is returned
        unpooled, so a deleted tenant's KV never enters the pool after `forget_tenant`."""
        return self._issuer.adopt_base_for(self._entry, base)

    def discard(self) -> None:
        """Drop whatever is stored for the session (it no longer matches the transcript)."""
        self._issuer.discard_lease(self._entry)
