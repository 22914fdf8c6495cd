"""Bringing a stored cache back: open its blob and attach its base layer, found in the prefix pool,
else in its own stored blob (host, then disk), else recomputed by prefill.

`Restorer` does the opening; the tier manager decides what to open and moves the result onto the
device (`TierManager.restore_lease`), and `Restored` is what a turn gets back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cache.ids import PrefixKey, TenantId
from cache.prefix_pool import PrefixPool
from cache.session_cache import BaseLayer, SessionCache
from cache.tiers import (
    BlobMissing,
    BlobRejected,
    BlobStore,
    CacheKey,
    CacheSealer,
    SealedBlob,
    SharedBlobStore,
    Tier,
    TierEvents,
)

log = logging.getLogger(__name__)

BaseBuilder = Callable[[TenantId, PrefixKey, tuple[int, ...]], BaseLayer]
"""Recomputes a base layer by prefill when neither the pool nor a stored blob has it."""


@dataclass(frozen=True)
class Restored:
    """Outcome of `Lease.restore`: the cache on the device (base attached) or `None`.

    `source` is the tier it came from, `None` if nothing was stored; `rejected` is set when a
    stored blob failed authentication or decoding, or was missing, and was discarded;
    `base_prefill_tokens` counts base-layer tokens recomputed by prefill because neither the pool
    nor a blob had the base.
    """

    cache: SessionCache | None
    source: Tier | None
    seconds: float
    rejected: bool = False
    base_prefill_tokens: int = 0


class Restorer:
    """Opens stored session caches and finds their base layers. Thread-safe as its parts are.

    Args:
        pool: the shared base layers; a base found in a blob or built is put there.
        sealer: opens the blobs.
        stores: the blob store of each lower tier (host, disk, and the shared tier if any), in
            the order a base layer is looked for.
        events: told of each base blob that was rejected.
        base_builder: recomputes a missing base layer by prefill.
        shared: the shared tier's store (also in `stores`), read piece by piece.
    """

    def __init__(
        self,
        *,
        pool: PrefixPool,
        sealer: CacheSealer,
        stores: Mapping[Tier, BlobStore],
        events: TierEvents,
        base_builder: BaseBuilder,
        shared: SharedBlobStore | None = None,
    ) -> None:
        self._pool = pool
        self._shared = shared
        self._sealer = sealer
        self._stores = stores
        self._events = events
        self._base_builder = base_builder

    def open_session(self, tier: Tier, key: CacheKey) -> tuple[SessionCache, int]:
        """The session cache stored in `tier` (host or disk) with its base attached, and the
        number of base tokens recomputed by prefill to attach it. The blob stays stored.

        Raises:
            BlobMissing: if the store holds no blob for `key`.
            BlobRejected: if the blob does not authenticate or decode.
        """
        cache = self._sealer.open_session(key, self._read(tier, key))
        if cache.base_key is None:
            return cache, 0
        base, how = self.base_layer(key.tenant_id, cache.base_key, cache.base_token_ids)
        return cache.with_base(base), base.token_count if how == "built" else 0

    def _read(self, tier: Tier, key: CacheKey) -> SealedBlob:
        """The blob of `key` in `tier`; the shared tier's piece by piece, each opened as it arrives
        while the next is read."""
        if tier is Tier.REDIS and self._shared is not None:
            return self._shared.read(key)
        return self._stores[tier].get(key)

    def base_layer(self, tenant_id: TenantId, key: PrefixKey, token_ids: tuple[int, ...]) -> tuple[BaseLayer, str]:
        """The base layer `key` and where it came from: `pool`, `blob` (a stored copy, decrypted)
        or `built` (recomputed by `base_builder`)."""
        found = self.find_base_layer(tenant_id, key, token_ids)
        if found is not None:
            return found
        return self._pool.put(tenant_id, self._base_builder(tenant_id, key, token_ids)), "built"

    def find_base_layer(
        self, tenant_id: TenantId, key: PrefixKey, token_ids: tuple[int, ...]
    ) -> tuple[BaseLayer, str] | None:
        """Like `base_layer` without building: `None` when neither the pool nor a stored blob has
        it (the caller computes it, e.g. in the turn's own prefill, and `Lease.adopt_base`s it).
        A stored base blob that is rejected, or vanishes between the check and the read, is
        deleted and skipped."""
        base = self._pool.get(key)
        if base is not None:
            return base, "pool"
        blob_key = CacheKey.for_base(tenant_id, key)
        for tier, store in self._stores.items():
            if not store.contains(blob_key):
                continue
            try:
                base = self._sealer.open_base(blob_key, self._read(tier, blob_key))
            except (BlobRejected, BlobMissing) as exc:
                log.warning("discarding stored base layer %s: %s", key, exc)
                self._events.rejected(tier)
                store.delete(blob_key)
                continue
            if base.token_ids == token_ids:
                return self._pool.put(tenant_id, base), "blob"
        return None
