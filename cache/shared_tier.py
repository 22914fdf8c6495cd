"""The tier that replicas share (Redis or Redis Cluster): sealed copies of session caches and base
layers that any replica can restore.

    replica A: device / host / disk  --publish-->  shared tier  --restore-->  replica B: device

Unlike the local tiers, the shared tier is not a placement: a session's cache is always in one of
this process's tiers (or nowhere), and the shared tier may hold a copy of some version of it
beside that. `TierManager` records which version (`SessionEntry.shared_version`) and publishes the
current one after each write-back and when a replica hands the session over; `SharedTier` does the
sealing and the writing. The blob is the same sealed bytes as on disk (AES-GCM bound to tenant,
session, model fingerprint and format), so a copy moved to another session's key does not open,
and a stale copy is caught by the turn's transcript check and rebuilt.

A shared store that cannot be reached raises `StoreUnavailable` on `put`: publishing then fails
quietly (logged) and the next owner rebuilds from the transcript; a read from it is `BlobMissing`.
"""

from __future__ import annotations

import logging

from cache.ids import PrefixKey, TenantId
from cache.prefix_pool import PrefixPool
from cache.session_cache import SessionCache
from cache.tiers import BlobMissing, BlobStore, CacheKey, CacheSealer, SealFailed, SharedBlobStore, StoreUnavailable

log = logging.getLogger(__name__)


class SharedTier:
    """Writes session and base-layer blobs to the shared store. Thread-safe as its store is.

    Args:
        store: the shared store (Redis), keyed like the local ones.
        sealer: seals caches that are only on the device.
        pool: the base layers on the device, sealed into the store when a published session
            references one.
        local_disk: this process's disk store, whose sealed base blobs are copied as they are.
    """

    def __init__(self, *, store: SharedBlobStore, sealer: CacheSealer, pool: PrefixPool, local_disk: BlobStore) -> None:
        self.store = store
        self._sealer = sealer
        self._pool = pool
        self._disk = local_disk

    def publish(
        self, key: CacheKey, blob: bytes | bytearray | None, cache: SessionCache | None, base_key: PrefixKey | None
    ) -> bool:
        """Store a session's sealed `blob` (sealed here from `cache` when `None`) and its base
        layer's blob. Returns whether the store now holds both.

        Raises:
            ValueError: if neither `blob` nor `cache` is given.
        """
        if blob is None:
            if cache is None:
                raise ValueError(f"publish({key.name}) needs the sealed blob or the cache")
            try:
                blob = self._sealer.seal_session(key, cache)
            except SealFailed as exc:
                log.warning("session %s not published to the shared tier: %s", key.name, exc)
                return False
        try:
            if base_key is not None and not self._publish_base(key.tenant_id, base_key):
                return False
            self.store.put(key, blob)
        except StoreUnavailable as exc:
            log.warning("session %s not published to the shared tier: %s", key.name, exc)
            return False
        return True

    def _publish_base(self, tenant_id: TenantId, base_key: PrefixKey) -> bool:
        """Store the base layer's blob unless the store has it; `False` if it is nowhere here."""
        blob_key = CacheKey.for_base(tenant_id, base_key)
        if self.store.contains(blob_key):
            return True
        base = self._pool.get(base_key)
        try:
            blob = self._sealer.seal_base(blob_key, base) if base is not None else self._disk.get(blob_key)
        except (SealFailed, BlobMissing) as exc:
            log.warning("base layer %s not published to the shared tier: %s", base_key, exc)
            return False
        self.store.put(blob_key, blob)
        return True

    def contains(self, key: CacheKey) -> bool:
        return self.store.contains(key)

    def delete(self, key: CacheKey) -> None:
        self.store.delete(key)

    def delete_tenant(self, tenant_id: TenantId) -> None:
        self.store.delete_tenant(tenant_id)
