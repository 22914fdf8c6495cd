"""Placement of session caches in the device, host and disk tiers, under byte budgets.

    device (SessionCache objects)  --evict LRU-->  host (sealed bytes in memory)  --evict LRU-->  disk (sealed files)
           ^                                              |                                          |  over budget:
           +-------------- restore on the next turn ------+------------------------------------------+  drop (rebuild)

Every session cache is in exactly one tier. After each turn (`Lease` release) the device and host
tiers are brought within budget by moving least-recently-used idle sessions down; the disk tier
drops its oldest blobs (the transcript stays, so a dropped cache is rebuilt by prefill). A leased
session (a turn in flight) is never moved or dropped. A tenant over its device quota loses its own
sessions first, so it cannot push other tenants' sessions off the device beyond its quota.

`TierManager` is the front object and the one owner of the per-session `SessionEntry` records,
under one lock. It builds and holds the objects behind it: `Restorer` (cache/restore.py) opens
stored caches and finds base layers; `TierMoves` (cache/tier_moves.py) enforces the budgets by
moving caches down, on the entries it is handed; `WriteBack` (cache/write_back.py) is the
background writer. `Lease` (cache/lease.py) is a turn's handle, calling back the calls of
`LeaseIssuer` that this class provides. cache/entries.py picks the least recently used entries and
cache/budgets.py measures the tiers against their budgets.

Replicas add a shared tier (Redis, `cache/shared_tier.py`): not a placement but a copy beside it.
Each write-back also publishes the new version there, `publish` does so before a replica hands a
session over, and a session with no local copy is restored from it (`Restored.source` = `redis`).

Write-back (`write_back=True`): after a turn the new cache is sealed and written to disk by a
background thread, so moving a persisted session from host to disk is instant and a crash loses
no cache. The writer steps aside while turns run; `cache/write_back.py` says how and why.

Shared base layers live in the `PrefixPool`; an offloaded session stores a reference to its base,
and the base itself is written once as its own blob.

A cache that cannot be sealed (`SealFailed`: its tenant's data key is unavailable) is dropped
instead of stored, like a cache dropped for space: the transcript rebuilds it. A stored blob that
is missing (`BlobMissing`) or rejected (`BlobRejected`) is discarded at restore: the turn rebuilds.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cache.budgets import TierBudgets, TierUsage
from cache.entries import SessionEntry
from cache.errors import CacheError
from cache.ids import PrefixKey, TenantId
from cache.lease import Lease
from cache.prefix_pool import PrefixPool
from cache.restore import BaseBuilder, Restored, Restorer
from cache.session_cache import BaseLayer, SessionCache
from cache.shared_tier import SharedTier
from cache.tier_moves import TierMoves
from cache.tiers import (
    BlobMissing,
    BlobRejected,
    BlobStore,
    CacheKey,
    CacheSealer,
    NoEvents,
    SharedBlobStore,
    Tier,
    TierEvents,
)
from cache.write_back import WriteBack

log = logging.getLogger(__name__)

PUBLISH_LOCK_STRIPES = 64


class LeaseHeld(CacheError):
    """The session already has a turn in flight."""


class TierManager:
    """See the module docstring. Thread-safe; one instance per process.

    Args:
        pool: the shared base layers (their device bytes count against the device budget).
        sealer: seals and opens cache blobs.
        host, disk: the blob stores of the two lower tiers.
        base_builder: recomputes a missing base layer by prefill.
        write_back: persist each committed cache to disk in the background.
        write_back_settle_s, write_back_max_defer_s: how a write-back yields to turns (seconds;
            see `cache.write_back`; default `WRITE_BACK_SETTLE_S`, `WRITE_BACK_MAX_DEFER_S`).
    """

    def __init__(
        self,
        *,
        pool: PrefixPool,
        sealer: CacheSealer,
        host: BlobStore,
        disk: BlobStore,
        budgets: TierBudgets,
        base_builder: BaseBuilder,
        write_back: bool,
        events: TierEvents | None = None,
        write_back_settle_s: float | None = None,
        write_back_max_defer_s: float | None = None,
        shared: SharedBlobStore | None = None,
        may_publish: Callable[[CacheKey], bool] | None = None,
    ) -> None:
        self.pool = pool
        self._sealer = sealer
        self._stores = {Tier.HOST: host, Tier.DISK: disk}
        self._write_back = write_back
        self._events: TierEvents = events or NoEvents()
        self._entries: dict[CacheKey, SessionEntry] = {}
        self._base_used: dict[CacheKey, int] = {}
        self._lock = threading.RLock()
        self._clock = itertools.count(1)
        self._may_publish = may_publish or (lambda key: True)
        self._moves = TierMoves(
            entries=self._entries,
            base_used=self._base_used,
            lock=self._lock,
            clock=self._clock,
            pool=pool,
            sealer=sealer,
            stores=self._stores,
            budgets=budgets,
            events=self._events,
        )
        self._shared = SharedTier(store=shared, sealer=sealer, pool=pool, local_disk=disk) if shared else None
        restore_from = {**self._stores, Tier.REDIS: shared} if shared else self._stores
        self._restorer = Restorer(
            pool=pool, sealer=sealer, stores=restore_from, events=self._events, base_builder=base_builder, shared=shared
        )
        self._writer = WriteBack(
            lock=self._lock,
            is_due=lambda key: self._write_back_due(key) is not None,
            write=self._write_back_one,
            device_use=lambda: (self.usage().bytes[Tier.DEVICE], self.budgets.device_bytes),
            settle_s=write_back_settle_s,
            max_defer_s=write_back_max_defer_s,
        )
        # Publishes of one session run one at a time, each re-checking under its lock that its
        # version is still the one to publish: otherwise a slow write-back could overwrite the
        # shared copy of a newer version (a hand-over's) with its older one. Striped: bounded.
        self._publish_locks = [threading.Lock() for _ in range(PUBLISH_LOCK_STRIPES)]

    @property
    def budgets(self) -> TierBudgets:
        return self._moves.budgets

    @budgets.setter
    def budgets(self, budgets: TierBudgets) -> None:
        self._moves.budgets = budgets

    # -- start-up ------------------------------------------------------------------------------

    def adopt_disk_blobs(self, keys: list[CacheKey]) -> None:
        """Register session blobs found on disk at start-up (oldest first)."""
        disk = self._stores[Tier.DISK]
        with self._lock:
            for key in keys:
                if key.is_base:
                    self._base_used[key] = next(self._clock)
                    continue
                entry = self._entries.setdefault(key, SessionEntry(key))
                entry.tier, entry.nbytes, entry.last_used = Tier.DISK, disk.nbytes(key), next(self._clock)
                entry.persisted_version = entry.version

    # -- leases --------------------------------------------------------------------------------

    @contextmanager
    def lease(self, key: CacheKey) -> Iterator[Lease]:
        """Hold the session for one turn: it is not moved while leased. Budgets are enforced and
        the write-back is queued when the lease ends.

        Raises:
            LeaseHeld: if the session already has a turn in flight.
        """
        with self._lock:
            entry = self._entries.setdefault(key, SessionEntry(key))
            if entry.leased:
                raise LeaseHeld(key.name)
            entry.leased = True
            self._writer.turn_started()
        lease = Lease(self, entry)
        try:
            yield lease
        finally:
            with self._lock:
                self._writer.turn_ended()
                entry.leased = False
                entry.last_used = next(self._clock)
                if self._entries.get(key) is not entry:
                    self._moves.release_entry(entry)
                committed = lease.committed
            if committed and self._write_back:
                self._writer.queue(key)
            self.enforce_budgets()

    # -- what a lease does: `Lease` calls these with the entry it holds ---------------------------

    def restore_lease(self, entry: SessionEntry) -> Restored:
        """Bring the leased session's cache to the device (see `Lease.restore`). A stored blob that
        is missing or rejected is discarded and reported as `Restored.rejected`: the turn rebuilds.
        Any other exception of a store or the sealer (a `KeyError` from a bug) propagates."""
        started = time.perf_counter()
        with self._lock:
            tier, cache = entry.tier, entry.cache
        if tier is None and self._shared is not None and self._shared.contains(entry.key):
            tier = Tier.REDIS
        if tier is None:
            return Restored(None, None, 0.0)
        if tier is Tier.DEVICE:
            if cache is None:
                raise RuntimeError("bug: a device entry without its cache")
            return Restored(cache, Tier.DEVICE, time.perf_counter() - started)
        try:
            cache, base_prefill = self._restorer.open_session(tier, entry.key)
        except (BlobRejected, BlobMissing) as exc:
            log.warning("discarding the %s cache of session %s: %s", tier, entry.key.name, exc)
            self._events.rejected(tier)
            with self._lock:
                self._moves.drop_blobs(entry, shared=tier is Tier.REDIS)
                entry.tier, entry.cache, entry.nbytes = None, None, 0
                entry.version += 1  # a publish of the rejected version under way records nothing
            if tier is Tier.REDIS:
                self._delete_shared(entry.key)
            return Restored(None, None, time.perf_counter() - started, rejected=True)
        with self._lock:
            if tier is Tier.HOST:
                self._stores[Tier.HOST].delete(entry.key)
            self._place_on_device(entry, cache)
            if tier is Tier.REDIS:
                entry.shared_version = entry.version
        seconds = time.perf_counter() - started
        self._events.restored(tier, seconds)
        return Restored(cache, tier, seconds, base_prefill_tokens=base_prefill)

    def commit_lease(self, entry: SessionEntry, cache: SessionCache) -> None:
        """Make `cache` (base attached) the leased session's device copy (see `Lease.commit`)."""
        with self._lock:
            if entry.tier in (Tier.HOST, Tier.DISK):
                self._stores[entry.tier].delete(entry.key)
                entry.persisted_version = None
            elif entry.persisted_version is not None and not self._write_back:
                # The disk copy is about to be stale and nothing would overwrite it before eviction.
                self._stores[Tier.DISK].delete(entry.key)
                entry.persisted_version = None
            self._place_on_device(entry, cache)
            entry.version += 1

    def adopt_base_for(self, entry: SessionEntry, base: BaseLayer) -> BaseLayer:
        """Pool a base layer the leased session's turn computed, unless the session was forgotten
        meanwhile (see `Lease.adopt_base`)."""
        with self._lock:
            if self._entries.get(entry.key) is not entry:
                return base
            return self.pool.put(entry.key.tenant_id, base)

    def discard_lease(self, entry: SessionEntry) -> None:
        """Drop whatever is stored for the leased session, the shared copy included (see
        `Lease.discard`)."""
        with self._lock:
            self._moves.release_entry(entry)
            self._moves.drop_blobs(entry, shared=True)
            # A publish of the discarded version under way (a hand-over the turn's claim called
            # off, or a write-back) must neither record it nor be followed by another.
            entry.version += 1
        self._delete_shared(entry.key)

    # -- base layers -----------------------------------------------------------------------------

    def base_layer(self, tenant_id: TenantId, key: PrefixKey, token_ids: tuple[int, ...]) -> tuple[BaseLayer, str]:
        """See `Restorer.base_layer`."""
        return self._restorer.base_layer(tenant_id, key, token_ids)

    def find_base_layer(
        self, tenant_id: TenantId, key: PrefixKey, token_ids: tuple[int, ...]
    ) -> tuple[BaseLayer, str] | None:
        """See `Restorer.find_base_layer`."""
        return self._restorer.find_base_layer(tenant_id, key, token_ids)

    # -- one entry, under the lock ---------------------------------------------------------------

    def _place_on_device(self, entry: SessionEntry, cache: SessionCache) -> None:
        """Under the lock: make `cache` the entry's device copy, moving the base reference."""
        if cache.base_key is not None and cache.base is None:
            raise RuntimeError(f"bug: device cache of {entry.key.name} without its base attached")
        if cache.base is not None:
            self.pool.acquire(entry.key.tenant_id, cache.base)
        if entry.tier is Tier.DEVICE and entry.cache is not None and entry.cache.base_key:
            self.pool.release(entry.cache.base_key)
        entry.tier, entry.cache, entry.nbytes = Tier.DEVICE, cache, cache.own_nbytes
        entry.base_key = cache.base_key

    def _delete_shared(self, key: CacheKey) -> None:
        """Delete the shared copy, outside the tier lock (Redis may take its timeout to answer,
        and other sessions' turns must not wait for it) and after any publish of the session
        under way (which could otherwise store its copy again after the delete)."""
        if self._shared is not None:
            with self._publishing(key):
                self._shared.delete(key)

    # -- budgets: `TierMoves` enforces them --------------------------------------------------------

    def usage(self) -> TierUsage:
        """Bytes and sessions per tier against the budgets, and the device bytes reserved."""
        return self._moves.usage()

    def enforce_budgets(self) -> None:
        """Move least-recently-used idle caches down until every tier is within budget."""
        self._moves.enforce_budgets()

    def reserve_device_bytes(self, nbytes: int, *, force: bool) -> bool:
        """See `TierMoves.reserve_device_bytes`.

        Raises:
            ValueError: if `nbytes` is negative.
            SealFailed, OSError: from moving a cache down; nothing is reserved then.
        """
        return self._moves.reserve_device_bytes(nbytes, force=force)

    def release_device_bytes(self, nbytes: int) -> None:
        """Give back a reservation of `reserve_device_bytes` (the request finished or was
        cancelled), waking a write-back that waits for device room."""
        with self._lock:
            self._moves.release_device_bytes(nbytes)
            self._writer.wake()

    def wait_for_leases(self, timeout_s: float) -> bool:
        """Wait until no session is leased (every turn let go), at most `timeout_s` seconds.
        Returns whether none is."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if not any(entry.leased for entry in self._entries.values()):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    # -- explicit moves ------------------------------------------------------------------------

    def placement(self, key: CacheKey) -> Tier | None:
        with self._lock:
            entry = self._entries.get(key)
            return entry.tier if entry else None

    def entry_bytes(self, key: CacheKey) -> int:
        with self._lock:
            entry = self._entries.get(key)
            return entry.nbytes if entry else 0

    def peek(self, key: CacheKey) -> SessionCache | None:
        """The device copy, if the cache is on the device (for inspection only)."""
        with self._lock:
            entry = self._entries.get(key)
            return entry.cache if entry and entry.tier is Tier.DEVICE else None

    def stored_cache(self, key: CacheKey) -> SessionCache | None:
        """Open a host or disk copy without moving it (for inspection); base not attached.
        `None` when nothing is stored there, its blob missing included.

        Raises:
            BlobRejected: if the stored blob does not authenticate or decode.
        """
        with self._lock:
            entry = self._entries.get(key)
            tier = entry.tier if entry else None
        if tier is None and self.has_shared_copy(key):
            tier = Tier.REDIS
        if tier not in (Tier.HOST, Tier.DISK, Tier.REDIS):
            return None
        try:
            blob = self._shared.store.get(key) if tier is Tier.REDIS and self._shared else self._stores[tier].get(key)
        except BlobMissing:
            return None
        return self._sealer.open_session(key, blob)

    def evict(self, key: CacheKey, target: Tier | None) -> Tier | None:
        """Move an idle session's cache down to `target` (`None`: drop it), then enforce the budgets
        (an over-full host moves its least recently used sessions, possibly this one, to disk).
        Returns the tier the cache ends in.

        Raises:
            LeaseHeld: if a turn is in flight on the session.
            ValueError: if `target` is above the current tier.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.tier is None:
                return None
            if entry.leased:
                raise LeaseHeld(key.name)
            order = [Tier.DEVICE, Tier.HOST, Tier.DISK]
            if target is not None and order.index(target) < order.index(entry.tier):
                raise ValueError(f"cannot evict from {entry.tier} up to {target}; restore happens on the next turn")
            while entry.tier is not None and entry.tier != target:
                self._moves.move_down(entry, drop=target is None, skip_host=target is not Tier.HOST)
            self.enforce_budgets()
            return entry.tier

    def forget(self, key: CacheKey) -> None:
        """Delete a session's cache in every tier (session deleted). A leased entry is detached and
        released when its lease ends."""
        with self._lock:
            self._forget_locally(key)
        self._delete_shared(key)

    def _forget_locally(self, key: CacheKey) -> None:
        """Under the lock: `forget` but for the shared copy."""
        entry = self._entries.pop(key, None)
        self._writer.cancel(key)
        if entry is not None and not entry.leased:
            self._moves.release_entry(entry)
        elif entry is None:
            for store in self._stores.values():
                store.delete(key)

    def forget_local(self, key: CacheKey) -> None:
        """Drop this process's copies of a session's cache and keep the shared one: another
        replica ran turns on it since, so they are stale.

        Raises:
            LeaseHeld: if a turn is in flight on the session here (a bug: a replica takes a
                session over before it leases it).
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.leased:
                raise LeaseHeld(key.name)
            self._entries.pop(key, None)
            self._writer.cancel(key)
            if entry is not None:
                self._moves.release_entry(entry)
            else:
                for store in self._stores.values():
                    store.delete(key)

    def publish(self, key: CacheKey) -> bool:
        """Make the shared tier hold the session's current version (before a replica hands the
        session over). Returns whether it does; `False` without a shared tier, without a local
        copy, or when the shared store cannot be reached."""
        if self._shared is None:
            return False
        # Redis is asked outside the tier lock (see `_delete_shared`); the publish lock keeps the
        # entry's version from being published by another thread meanwhile.
        with self._publishing(key):
            with self._lock:
                entry = self._entries.get(key)
                current = entry is not None and entry.tier is not None and entry.shared_version == entry.version
            if entry is None or entry.tier is None or current:
                if self._shared.contains(key):
                    return True
                if entry is None or entry.tier is None:
                    return False
            with self._lock:
                if self._entries.get(key) is not entry or entry.tier is None:
                    return False  # forgotten, or dropped for space, meanwhile
                version, cache, base_key = entry.version, entry.cache, entry.base_key
                blob = None if entry.tier is Tier.DEVICE else self._stores[entry.tier].get(key)
            return self._published(entry, version, self._shared.publish(key, blob, cache, base_key))

    def _publishing(self, key: CacheKey) -> threading.Lock:
        return self._publish_locks[hash(key) % PUBLISH_LOCK_STRIPES]

    def _published(self, entry: SessionEntry, version: int, stored: bool) -> bool:
        """Record a publish of `version`. An entry forgotten meanwhile keeps the shared copy: it
        was forgotten here because another replica moved the session on (a deleted session's
        copy is removed by `forget`, and the store refuses a blob whose session is gone)."""
        with self._lock:
            if self._entries.get(entry.key) is not entry:
                return False
            if stored and entry.version == version:
                entry.shared_version = version
            return stored and entry.shared_version == version

    def has_shared_copy(self, key: CacheKey) -> bool:
        """Whether the shared tier holds a copy of the session's cache (any version)."""
        return self._shared is not None and self._shared.contains(key)

    def forget_tenant(self, tenant_id: TenantId) -> None:
        """Delete every cache and base layer of a tenant."""
        with self._lock:
            forgotten = [k for k in self._entries if k.tenant_id == tenant_id]
            for key in forgotten:
                self._forget_locally(key)
            for tier, store in self._stores.items():
                for key in store.keys():
                    if key.tenant_id == tenant_id:
                        store.delete(key)
                        log.debug("removed %s blob %s", tier, key.name)
            for key in [k for k in self._base_used if k.tenant_id == tenant_id]:
                del self._base_used[key]  # in place: `TierMoves` holds the same dict
            self.pool.drop_tenant(tenant_id)
        if self._shared is not None:  # Redis outside the tier lock, as in `_delete_shared`
            for key in forgotten:
                self._delete_shared(key)
            self._shared.delete_tenant(tenant_id)

    # -- write-back: `WriteBack` runs the jobs and yields to turns; what to write is decided here --

    def _write_back_due(self, key: CacheKey) -> tuple[SessionEntry, SessionCache, int] | None:
        """Under the lock: the entry, cache and version to write, or `None` when there is nothing
        to write (deleted, moved off the device, or this version already on disk)."""
        entry = self._entries.get(key)
        if entry is None or entry.tier is not Tier.DEVICE or entry.cache is None:
            return None
        if entry.persisted_version == entry.version:
            return None
        return entry, entry.cache, entry.version

    def _write_back_one(self, key: CacheKey, pause: Callable[[], None]) -> None:
        """The write-back job of `key` (on the writer's thread): seal, calling `pause` between the
        sealing steps, then write to disk and mark the version persisted."""
        with self._lock:
            due = self._write_back_due(key)
            if due is None:
                return
            entry, cache, version = due
        blob = self._moves.seal_or_none(key, cache, pause=pause)
        if blob is None:
            return  # eviction drops it too: nothing can be stored for this tenant now
        with self._lock:
            if self._entries.get(key) is not entry or entry.version != version:
                return  # deleted or superseded while sealing; the newer version queues its own write
        # The file write (fsync included) runs without the lock so other sessions' turns go on.
        self._stores[Tier.DISK].put(key, blob)
        with self._lock:
            if self._entries.get(key) is not entry:
                self._stores[Tier.DISK].delete(key)  # the session was deleted during the write
                return
            if entry.version == version:
                entry.persisted_version = version
            if cache.base_key is not None:
                self._moves.persist_base(key.tenant_id, cache.base_key)
            # Write-back adds disk bytes between turns; keep the disk tier within its budget too.
            self._moves.enforce_disk_budget()
        if self._shared is None:
            return
        with self._publishing(key):
            with self._lock:
                # Still this version, not yet published (a hand-over may have done it meanwhile),
                # and still this replica's to publish (not being handed over, not taken over).
                unpublished = self._entries.get(key) is entry and entry.version == version != entry.shared_version
            if unpublished and self._may_publish(key):
                self._published(entry, version, self._shared.publish(key, blob, None, cache.base_key))

    def flush(self) -> None:
        """Wait for queued write-backs, which stop yielding to turns meanwhile (a failed one was
        logged; its cache is written at shutdown)."""
        self._writer.flush()

    def persist_all(self) -> None:
        """Write every cache not yet on disk there (at shutdown, so a restart resumes warm)."""
        self.flush()
        with self._lock:
            for entry in list(self._entries.values()):
                if entry.leased or entry.tier is None:
                    continue
                if entry.tier is Tier.HOST:
                    self._moves.move_down(entry, drop=False)
                elif entry.tier is Tier.DEVICE and entry.persisted_version != entry.version:
                    if entry.cache is None:
                        raise RuntimeError("bug: a device entry without its cache")
                    blob = self._moves.seal_or_none(entry.key, entry.cache)
                    if blob is None:
                        continue
                    self._stores[Tier.DISK].put(entry.key, blob)
                    if entry.cache.base_key is not None:
                        self._moves.persist_base(entry.key.tenant_id, entry.cache.base_key)
                    entry.persisted_version = entry.version
            self._moves.enforce_disk_budget()

    def close(self) -> None:
        """Stop the write-back (queued jobs still run, without yielding). Call `persist_all` first
        to keep every cache."""
        self._writer.close()
