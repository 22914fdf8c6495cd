"""One turn's hold on a session's cache: what a turn may do with it while it runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cache.entries import SessionEntry
from cache.restore import Restored
from cache.session_cache import BaseLayer, SessionCache
from cache.tiers import CacheKey

if TYPE_CHECKING:  # the tier manager creates leases, so it imports this module
    from cache.tier_manager import TierManager


class Lease:
    """One turn's hold on a session; created by `TierManager.lease`, which releases it when the
    `with` block ends. Each method is one call of the tier manager on the leased entry."""

    def __init__(self, manager: TierManager, entry: SessionEntry) -> None:
        self._manager = manager
        self._entry = entry
        self.committed = False

    @property
    def key(self) -> CacheKey:
        return self._entry.key

    def restore(self) -> Restored:
        """Bring the session's cache to the device (decrypt, decode, attach the base)."""
        return self._manager.restore_lease(self._entry)

    def commit(self, cache: SessionCache) -> None:
        """Make `cache` (base attached) the session's device copy after a successful turn."""
        self._manager.commit_lease(self._entry, cache)
        self.committed = True

    def adopt_base(self, base: BaseLayer) -> BaseLayer:
        """Put a base layer computed by this turn into the pool and return the pooled instance
        (another turn may have put the same key first; every session then shares that one). If
        the session was forgotten meanwhile (it or its tenant deleted), `base` is returned
        unpooled, so a deleted tenant's KV never enters the pool after `forget_tenant`."""
        return self._manager.adopt_base_for(self._entry, base)

    def discard(self) -> None:
        """Drop whatever is stored for the session (it no longer matches the transcript)."""
        self._manager.discard_lease(self._entry)
