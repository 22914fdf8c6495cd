"""Budget enforcement of the tier manager: moving least-recently-used idle caches down a tier
(device -> host -> disk -> dropped) and the device reservations of running requests.

`TierMoves` is built and held by `TierManager` (cache/tier_manager.py), the front object, which
owns the session entries: it is handed the entries, the lock and the stores it works on, and makes
the moves under that lock. It owns the device reservations. See the tier manager's module
docstring for the tiers and their rules.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Mapping

from cache.budgets import TierBudgets, TierUsage, measure_usage
from cache.entries import SessionEntry, idle_lru, oldest_disk_blob
from cache.ids import PrefixKey, TenantId
from cache.prefix_pool import PrefixPool
from cache.session_cache import SessionCache
from cache.tiers import BlobStore, CacheKey, CacheSealer, SealFailed, Tier, TierEvents

log = logging.getLogger(__name__)


class TierMoves:
    """Budgets and moves between the local tiers, on the tier manager's entries. Thread-safe: every
    public method takes `lock`; those documented "under the lock" expect the caller to hold it.

    Args:
        entries: the tier manager's entries by key (it adds and removes them; entries are moved
            here).
        base_used: the LRU clock of the base-layer blobs on disk, by blob key (shared with the
            tier manager, which registers the blobs found at start-up and forgets a tenant's).
        lock: the tier manager's lock (re-entrant).
        clock: the tier manager's LRU clock.
        pool: the shared base layers (their device bytes count against the device budget).
        sealer: seals caches moved to the host tier and base layers written to disk.
        stores: the blob stores of the host and disk tiers.
        budgets: the byte budgets; `budgets` may be replaced later.
        events: where moves are reported.
    """

    def __init__(
        self,
        *,
        entries: dict[CacheKey, SessionEntry],
        base_used: dict[CacheKey, int],
        lock: threading.RLock,
        clock: itertools.count[int],
        pool: PrefixPool,
        sealer: CacheSealer,
        stores: Mapping[Tier, BlobStore],
        budgets: TierBudgets,
        events: TierEvents,
    ) -> None:
        self.budgets = budgets
        self._entries = entries
        self._base_used = base_used
        self._lock = lock
        self._clock = clock
        self._pool = pool
        self._sealer = sealer
        self._stores = stores
        self._events = events
        self._reserved_device_bytes = 0

    # -- budgets -------------------------------------------------------------------------------

    def usage(self) -> TierUsage:
        with self._lock:
            return measure_usage(
                self._entries.values(), self._pool, self._stores, self.budgets, self._reserved_device_bytes
            )

    def enforce_budgets(self) -> None:
        """Move least-recently-used idle caches down until every tier is within budget."""
        with self._lock:
            for tenant, used in self.usage().device_bytes_by_tenant.items():
                while used > self.budgets.tenant_device_quota_bytes:
                    freed = self._evict_one_from_device(tenant)
                    if freed is None:
                        break
                    used -= freed
            while self.usage().bytes[Tier.DEVICE] + self._reserved_device_bytes > self.budgets.device_bytes:
                if self._evict_one_from_device(None) is None:
                    break
            while self.usage().bytes[Tier.HOST] > self.budgets.host_bytes:
                if not self._move_lru(Tier.HOST):
                    break
            self.enforce_disk_budget()

    def reserve_device_bytes(self, nbytes: int, *, force: bool) -> bool:
        """Reserve device bytes for a request's working KV buffer (the engine loop's admission),
        moving idle caches down first. Returns `False`, reserving nothing, when even then the
        device budget would be exceeded, unless `force` (a request that runs alone).

        Raises:
            ValueError: if `nbytes` is negative.
            SealFailed, OSError: from moving a cache down; nothing is reserved then.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            self._reserved_device_bytes += nbytes
            try:
                # The device tier only: moving idle caches to the host seals them in memory, while
                # the host and disk budgets (disk writes) are enforced when a lease ends, on the
                # turn's own thread, not on the engine loop's.
                while self.usage().bytes[Tier.DEVICE] + self._reserved_device_bytes > self.budgets.device_bytes:
                    if self._evict_one_from_device(None) is None:
                        break
            # Not a blanket catch: whatever moving a cache down raised, the reservation is undone
            # (it would otherwise leak for the life of the process) and the error propagates.
            except BaseException:
                self._reserved_device_bytes -= nbytes
                raise
            if force or self.usage().bytes[Tier.DEVICE] + self._reserved_device_bytes <= self.budgets.device_bytes:
                return True
            self._reserved_device_bytes -= nbytes
            return False

    def release_device_bytes(self, nbytes: int) -> None:
        """Give back a reservation of `reserve_device_bytes` (the request finished or was cancelled)."""
        with self._lock:
            self._reserved_device_bytes = max(0, self._reserved_device_bytes - nbytes)

    def enforce_disk_budget(self) -> None:
        """Under the lock: drop the oldest disk blobs until the disk tier is within budget."""
        while self._stores[Tier.DISK].used_bytes() > self.budgets.disk_bytes:
            if not self._drop_lru_disk_blob():
                break

    def _evict_one_from_device(self, tenant: TenantId | None) -> int | None:
        """Free device bytes: first a base layer no device session uses (it is persisted and
        cheap to reload), else the least recently used idle session. Returns bytes freed."""
        bases = [(k, t, n) for k, t, n in self._pool.unreferenced() if tenant in (None, t)]
        if bases:
            key, owner, nbytes = bases[0]
            self.persist_base(owner, key)
            self._pool.remove(key)
            self._events.moved(Tier.DEVICE, Tier.DISK, nbytes)
            return nbytes
        sessions = idle_lru(self._entries.values(), Tier.DEVICE, tenant)
        if not sessions:
            return None
        freed = sessions[0].nbytes
        self.move_down(sessions[0], drop=False)
        return freed

    def _move_lru(self, tier: Tier) -> bool:
        idle = idle_lru(self._entries.values(), tier)
        if not idle:
            return False
        self.move_down(idle[0], drop=False)
        return True

    def move_down(self, entry: SessionEntry, drop: bool, skip_host: bool = True) -> None:
        """Under the lock: move one tier down (device -> host -> disk -> dropped). A device cache
        whose current version the write-back already stored goes straight to disk unless
        `skip_host` is off (an operator asked for the host tier)."""
        source = entry.tier
        if source is Tier.DEVICE:
            if entry.cache is None:
                raise RuntimeError("bug: a device entry without its cache")
            cache = entry.cache
            disk = self._stores[Tier.DISK]
            persisted = entry.persisted_version == entry.version and disk.contains(entry.key)
            if not drop and skip_host and persisted:
                # Write-back already stored this version: eviction is instant, straight to disk.
                if cache.base_key is not None:
                    self._pool.release(cache.base_key)
                entry.tier, entry.cache, entry.nbytes = Tier.DISK, None, disk.nbytes(entry.key)
                log.debug("session %s: moved from device to disk (already written back)", entry.key.name)
                self._events.moved(source, entry.tier, entry.nbytes)
                return
            blob = None if drop else self.seal_or_none(entry.key, cache)
            if blob is None:
                self.release_entry(entry)
            else:
                if cache.base_key is not None:
                    self.persist_base(entry.key.tenant_id, cache.base_key)
                    self._pool.release(cache.base_key)
                self._stores[Tier.HOST].put(entry.key, blob)
                entry.tier, entry.cache, entry.nbytes = Tier.HOST, None, len(blob)
        elif source is Tier.HOST:
            host, disk = self._stores[Tier.HOST], self._stores[Tier.DISK]
            if entry.persisted_version != entry.version or not disk.contains(entry.key):
                disk.put(entry.key, host.get(entry.key))
                entry.persisted_version = entry.version
            host.delete(entry.key)
            entry.tier, entry.nbytes = Tier.DISK, disk.nbytes(entry.key)
        elif source is Tier.DISK:
            self.release_entry(entry)
        if source is not None:
            log.debug(
                "session %s: moved from %s to %s (%d bytes)",
                entry.key.name,
                source,
                entry.tier or "nowhere",
                entry.nbytes,
            )
            self._events.moved(source, entry.tier, entry.nbytes)

    def release_entry(self, entry: SessionEntry) -> None:
        """Under the lock: forget an entry's device copy (base reference) and blobs."""
        if entry.tier is Tier.DEVICE and entry.cache is not None and entry.cache.base_key:
            self._pool.release(entry.cache.base_key)
        self.drop_blobs(entry)
        entry.tier, entry.cache, entry.nbytes = None, None, 0

    def drop_blobs(self, entry: SessionEntry, shared: bool = False) -> None:
        """Under the lock: delete the entry's local blobs; with `shared`, mark its shared copy as
        not of any version (it no longer matches the transcript; a budget drop keeps it). The
        caller deletes that copy (`TierManager._delete_shared`) after letting go of the lock."""
        for store in self._stores.values():
            store.delete(entry.key)
        entry.persisted_version = None
        if shared:
            entry.shared_version = None

    def seal_or_none(
        self, key: CacheKey, cache: SessionCache, pause: Callable[[], None] | None = None
    ) -> bytes | bytearray | None:
        """The sealed cache, or `None` (logged) when it cannot be sealed for its key: the caller
        drops it instead of storing it, and the transcript rebuilds it."""
        try:
            return self._sealer.seal_session(key, cache, pause)
        except SealFailed as exc:
            log.warning("dropping the cache of session %s instead of storing it: %s", key.name, exc)
            return None

    def persist_base(self, tenant_id: TenantId, key: PrefixKey) -> None:
        """Under the lock: write a base layer's blob to disk unless it is there (a sealing failure
        is logged: the base is rebuilt when needed), and mark it used now."""
        blob_key = CacheKey.for_base(tenant_id, key)
        self._base_used[blob_key] = next(self._clock)
        disk = self._stores[Tier.DISK]
        if disk.contains(blob_key):
            return
        base = self._pool.get(key)
        if base is None:
            return
        try:
            disk.put(blob_key, self._sealer.seal_base(blob_key, base))
        except SealFailed as exc:
            log.warning("base layer %s not stored (it is rebuilt when needed): %s", key, exc)

    def _drop_lru_disk_blob(self) -> bool:
        """Drop the oldest disk blob (see `oldest_disk_blob`). Returns `False` if there is none."""
        disk = self._stores[Tier.DISK]
        key = oldest_disk_blob(self._entries, disk.keys(), self._base_used)
        if key is None:
            return False
        entry = self._entries.get(key)
        if entry is not None and entry.tier is Tier.DISK:
            self.move_down(entry, drop=True)
        else:
            disk.delete(key)
            if entry is not None:
                entry.persisted_version = None
            self._base_used.pop(key, None)
            self._events.moved(Tier.DISK, None, 0)
        return True
