"""Placement of session caches in the device, host and disk tiers, under byte budgets.

    device (SessionCache objects)  --evict LRU-->  host (sealed bytes in memory)  --evict LRU-->  disk (sealed files)
           ^                                              |                                          |  over budget:
           +-------------- restore on the next turn ------+------------------------------------------+  drop (rebuild)

Every session cache is in exactly one tier. After each turn (`Lease` release) the device and host
tiers are brought within budget by moving least-recently-used idle sessions down; the disk tier
drops its oldest blobs (the transcript stays, so a dropped cache is rebuilt by prefill). A leased
session (a turn in flight) is never moved or dropped. A tenant over its device quota loses its own
sessions first, so it cannot push other tenants' sessions off the device beyond its quota.

Write-back (`write_back=True`): after a turn the new cache is sealed and written to disk by a
background thread, so moving a persisted session from host to disk is instant and a crash loses
no cache. The writer steps aside while turns run: sealing holds the GIL for tens of milliseconds
per 100 MB (safetensors encoding, AES-GCM), and a turn's hundreds of short torch calls each wait
for it (a GIL convoy: measured here, a follow-up turn of a 2,000-token session took 645 ms instead
of 222 ms while another session's cache was being sealed). So a write-back starts once no turn has
been in flight for `write_back_settle_s`, pauses between its steps while one is, and goes ahead
anyway `write_back_max_defer_s` after it was queued, so a busy server still persists (bounding
what a crash loses). It does not yield when the device tier is nearly full (an eviction would then
seal the cache synchronously instead), nor while `flush()` (and so `persist_all()`) waits.

Shared base layers live in the `PrefixPool`; an offloaded session stores a reference to its base,
and the base itself is written once as its own blob.

A cache that cannot be sealed (`SealFailed`: its tenant's data key is unavailable) is dropped
instead of stored, like a cache dropped for space: the transcript rebuilds it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field

from cache.ids import PrefixKey, TenantId
from cache.prefix_pool import PrefixPool
from cache.session_cache import BaseLayer, SessionCache
from cache.tiers import BlobRejected, BlobStore, CacheKey, CacheSealer, NoEvents, SealFailed, Tier, TierEvents

log = logging.getLogger(__name__)

BaseBuilder = Callable[[TenantId, PrefixKey, tuple[int, ...]], BaseLayer]
"""Recomputes a base layer by prefill when neither the pool nor a stored blob has it."""

WRITE_BACK_SETTLE_S = 0.05
"""Seconds without a turn in flight before a write-back starts sealing."""
WRITE_BACK_MAX_DEFER_S = 2.0
"""Seconds after a write-back is queued at which it runs even if turns are still going on."""
WRITE_BACK_DEVICE_PRESSURE = 0.75
"""Device-tier use (share of its budget) above which the writer stops yielding: the next
eviction would otherwise have to seal a not-yet-persisted cache on a turn's thread, under the lock."""


class LeaseHeld(Exception):
    """The session already has a turn in flight."""


@dataclass(frozen=True)
class TierBudgets:
    """Byte budgets per tier and the per-tenant device quota. Raises `ValueError` if not positive."""

    device_bytes: int
    host_bytes: int
    disk_bytes: int
    tenant_device_quota_bytes: int

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes", "disk_bytes", "tenant_device_quota_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class _Entry:
    key: CacheKey
    tier: Tier | None = None
    cache: SessionCache | None = None
    nbytes: int = 0
    last_used: int = 0
    leased: bool = False
    version: int = 0
    persisted_version: int | None = None
    base_key: PrefixKey | None = None
    """The shared base the cache references, kept while it is offloaded (its blob stays needed)."""


@dataclass(frozen=True)
class Restored:
    """Outcome of `Lease.restore`: the cache on the device (base attached) or `None`.

    `source` is the tier it came from, `None` if nothing was stored; `rejected` is set when a
    stored blob failed authentication or decoding and was discarded; `base_prefill_tokens` counts
    base-layer tokens recomputed by prefill because neither the pool nor a blob had the base.
    """

    cache: SessionCache | None
    source: Tier | None
    seconds: float
    rejected: bool = False
    base_prefill_tokens: int = 0


@dataclass(frozen=True)
class TierUsage:
    """Bytes and session counts per tier, and per tenant on the device."""

    bytes: dict[Tier, int]
    sessions: dict[Tier, int]
    budgets: dict[Tier, int]
    device_bytes_by_tenant: dict[TenantId, int] = field(default_factory=dict)
    reserved_device_bytes: int = 0
    """Device bytes reserved by running requests' working buffers (not part of `bytes`)."""


class TierManager:
    """See the module docstring. Thread-safe; one instance per process.

    Args:
        pool: the shared base layers (their device bytes count against the device budget).
        sealer: seals and opens cache blobs.
        host, disk: the blob stores of the two lower tiers.
        base_builder: recomputes a missing base layer by prefill.
        write_back: persist each committed cache to disk in the background.
        write_back_settle_s, write_back_max_defer_s: how a write-back yields to turns (seconds;
            see the module docstring; default `WRITE_BACK_SETTLE_S`, `WRITE_BACK_MAX_DEFER_S`).
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
    ) -> None:
        self.pool = pool
        self.budgets = budgets
        self._sealer = sealer
        self._stores = {Tier.HOST: host, Tier.DISK: disk}
        self._base_builder = base_builder
        self._write_back = write_back
        self._events: TierEvents = events or NoEvents()
        self._entries: dict[CacheKey, _Entry] = {}
        self._base_used: dict[CacheKey, int] = {}
        self._lock = threading.RLock()
        self._clock = itertools.count(1)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatkv-write-back")
        self._pending: dict[CacheKey, Future[None]] = {}
        self._closed = False
        self._settle_s = WRITE_BACK_SETTLE_S if write_back_settle_s is None else write_back_settle_s
        self._max_defer_s = WRITE_BACK_MAX_DEFER_S if write_back_max_defer_s is None else write_back_max_defer_s
        self._turns_in_flight = 0
        self._hurry = 0
        self._last_turn_end = time.monotonic()
        self._turn_ended = threading.Condition(self._lock)
        self._reserved_device_bytes = 0

    # -- start-up ------------------------------------------------------------------------------

    def adopt_disk_blobs(self, keys: list[CacheKey]) -> None:
        """Register session blobs found on disk at start-up (oldest first)."""
        disk = self._stores[Tier.DISK]
        with self._lock:
            for key in keys:
                if key.is_base:
                    self._base_used[key] = next(self._clock)
                    continue
                entry = self._entries.setdefault(key, _Entry(key))
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
            entry = self._entries.setdefault(key, _Entry(key))
            if entry.leased:
                raise LeaseHeld(key.name)
            entry.leased = True
            self._turns_in_flight += 1
        lease = Lease(self, entry)
        try:
            yield lease
        finally:
            with self._lock:
                self._turns_in_flight -= 1
                self._last_turn_end = time.monotonic()
                self._turn_ended.notify_all()
                entry.leased = False
                entry.last_used = next(self._clock)
                if self._entries.get(key) is not entry:
                    self._release_entry(entry)
                committed = lease.committed
            if committed and self._write_back:
                self._queue_write_back(key)
            self.enforce_budgets()

    def _restore(self, entry: _Entry) -> Restored:
        started = time.perf_counter()
        with self._lock:
            tier, cache = entry.tier, entry.cache
        if tier is None:
            return Restored(None, None, 0.0)
        if tier is Tier.DEVICE:
            if cache is None:
                raise RuntimeError("bug: a device entry without its cache")
            return Restored(cache, Tier.DEVICE, time.perf_counter() - started)
        store = self._stores[tier]
        base_prefill = 0
        try:
            cache = self._sealer.open_session(entry.key, store.get(entry.key))
            if cache.base_key is not None:
                base, how = self.base_layer(entry.key.tenant_id, cache.base_key, cache.base_token_ids)
                base_prefill = base.token_count if how == "built" else 0
                cache = cache.with_base(base)
        except (BlobRejected, KeyError) as exc:
            log.warning("discarding the %s cache of session %s: %s", tier, entry.key.name, exc)
            self._events.rejected(tier)
            with self._lock:
                self._drop_blobs(entry)
                entry.tier, entry.cache, entry.nbytes = None, None, 0
            return Restored(None, None, time.perf_counter() - started, rejected=True)
        with self._lock:
            if tier is Tier.HOST:
                self._stores[Tier.HOST].delete(entry.key)
            self._place_on_device(entry, cache)
        seconds = time.perf_counter() - started
        self._events.restored(tier, seconds)
        return Restored(cache, tier, seconds, base_prefill_tokens=base_prefill)

    def base_layer(self, tenant_id: TenantId, key: PrefixKey, token_ids: tuple[int, ...]) -> tuple[BaseLayer, str]:
        """The base layer `key` and where it came from: `pool`, `blob` (a stored copy, decrypted)
        or `built` (recomputed by `base_builder`)."""
        found = self.find_base_layer(tenant_id, key, token_ids)
        if found is not None:
            return found
        return self.pool.put(tenant_id, self._base_builder(tenant_id, key, token_ids)), "built"

    def find_base_layer(
        self, tenant_id: TenantId, key: PrefixKey, token_ids: tuple[int, ...]
    ) -> tuple[BaseLayer, str] | None:
        """Like `base_layer` without building: `None` when neither the pool nor a stored blob has
        it (the caller computes it, e.g. in the turn's own prefill, and `Lease.adopt_base`s it)."""
        base = self.pool.get(key)
        if base is not None:
            return base, "pool"
        blob_key = CacheKey.for_base(tenant_id, key)
        for tier in (Tier.HOST, Tier.DISK):
            store = self._stores[tier]
            if not store.contains(blob_key):
                continue
            try:
                base = self._sealer.open_base(blob_key, store.get(blob_key))
            except (BlobRejected, KeyError) as exc:
                log.warning("discarding stored base layer %s: %s", key, exc)
                self._events.rejected(tier)
                store.delete(blob_key)
                continue
            if base.token_ids == token_ids:
                return self.pool.put(tenant_id, base), "blob"
        return None

    def _place_on_device(self, entry: _Entry, cache: SessionCache) -> None:
        """Under the lock: make `cache` the entry's device copy, moving the base reference."""
        if cache.base_key is not None and cache.base is None:
            raise RuntimeError(f"bug: device cache of {entry.key.name} without its base attached")
        if cache.base is not None:
            self.pool.acquire(entry.key.tenant_id, cache.base)
        if entry.tier is Tier.DEVICE and entry.cache is not None and entry.cache.base_key:
            self.pool.release(entry.cache.base_key)
        entry.tier, entry.cache, entry.nbytes = Tier.DEVICE, cache, cache.own_nbytes
        entry.base_key = cache.base_key

    def _release_entry(self, entry: _Entry) -> None:
        """Under the lock: forget an entry's device copy (base reference) and blobs."""
        if entry.tier is Tier.DEVICE and entry.cache is not None and entry.cache.base_key:
            self.pool.release(entry.cache.base_key)
        self._drop_blobs(entry)
        entry.tier, entry.cache, entry.nbytes = None, None, 0

    def _drop_blobs(self, entry: _Entry) -> None:
        for store in self._stores.values():
            store.delete(entry.key)
        entry.persisted_version = None

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

        Raises:
            BlobRejected: if the stored blob does not authenticate or decode.
        """
        with self._lock:
            entry = self._entries.get(key)
            tier = entry.tier if entry else None
        if tier not in (Tier.HOST, Tier.DISK):
            return None
        try:
            blob = self._stores[tier].get(key)
        except KeyError:
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
                self._move_down(entry, drop=target is None, skip_host=target is not Tier.HOST)
            self.enforce_budgets()
            return entry.tier

    def forget(self, key: CacheKey) -> None:
        """Delete a session's cache in every tier (session deleted). A leased entry is detached and
        released when its lease ends."""
        with self._lock:
            entry = self._entries.pop(key, None)
            future = self._pending.pop(key, None)
            if future is not None:
                future.cancel()
            if entry is not None and not entry.leased:
                self._release_entry(entry)
            elif entry is None:
                for store in self._stores.values():
                    store.delete(key)

    def forget_tenant(self, tenant_id: TenantId) -> None:
        """Delete every cache and base layer of a tenant."""
        with self._lock:
            for key in [k for k in self._entries if k.tenant_id == tenant_id]:
                self.forget(key)
            for tier, store in self._stores.items():
                for key in store.keys():
                    if key.tenant_id == tenant_id:
                        store.delete(key)
                        log.debug("removed %s blob %s", tier, key.name)
            self._base_used = {k: v for k, v in self._base_used.items() if k.tenant_id != tenant_id}
            self.pool.drop_tenant(tenant_id)

    # -- budgets -------------------------------------------------------------------------------

    def usage(self) -> TierUsage:
        with self._lock:
            sizes = {tier: 0 for tier in Tier}
            counts = {tier: 0 for tier in Tier}
            by_tenant: dict[TenantId, int] = {}
            for entry in self._entries.values():
                if entry.tier is not None:
                    sizes[entry.tier] += entry.nbytes
                    counts[entry.tier] += 1
                if entry.tier is Tier.DEVICE:
                    tenant = entry.key.tenant_id
                    by_tenant[tenant] = by_tenant.get(tenant, 0) + entry.nbytes
            sizes[Tier.DEVICE] += self.pool.nbytes()
            for tenant in list(by_tenant):
                by_tenant[tenant] += self.pool.nbytes(tenant)
            sizes[Tier.HOST] = self._stores[Tier.HOST].used_bytes()
            sizes[Tier.DISK] = self._stores[Tier.DISK].used_bytes()
            budgets = {
                Tier.DEVICE: self.budgets.device_bytes,
                Tier.HOST: self.budgets.host_bytes,
                Tier.DISK: self.budgets.disk_bytes,
            }
            return TierUsage(sizes, counts, budgets, by_tenant, self._reserved_device_bytes)

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
            self._enforce_disk_budget()

    def reserve_device_bytes(self, nbytes: int, *, force: bool) -> bool:
        """Reserve device bytes for a request's working KV buffer (the engine loop's admission),
        moving idle caches down first. Returns `False`, reserving nothing, when even then the
        device budget would be exceeded, unless `force` (a request that runs alone).

        Raises:
            ValueError: if `nbytes` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            self._reserved_device_bytes += nbytes
            self.enforce_budgets()
            if force or self.usage().bytes[Tier.DEVICE] + self._reserved_device_bytes <= self.budgets.device_bytes:
                return True
            self._reserved_device_bytes -= nbytes
            return False

    def release_device_bytes(self, nbytes: int) -> None:
        """Give back a reservation of `reserve_device_bytes` (the request finished or was cancelled)."""
        with self._lock:
            self._reserved_device_bytes = max(0, self._reserved_device_bytes - nbytes)
            self._turn_ended.notify_all()

    def _enforce_disk_budget(self) -> None:
        """Under the lock: drop the oldest disk blobs until the disk tier is within budget."""
        while self._stores[Tier.DISK].used_bytes() > self.budgets.disk_bytes:
            if not self._drop_lru_disk_blob():
                break

    def _idle(self, tier: Tier, tenant: TenantId | None = None) -> list[_Entry]:
        return sorted(
            (
                e
                for e in self._entries.values()
                if e.tier is tier and not e.leased and tenant in (None, e.key.tenant_id)
            ),
            key=lambda e: e.last_used,
        )

    def _evict_one_from_device(self, tenant: TenantId | None) -> int | None:
        """Free device bytes: first a base layer no device session uses (it is persisted and
        cheap to reload), else the least recently used idle session. Returns bytes freed."""
        bases = [(k, t, n) for k, t, n in self.pool.unreferenced() if tenant in (None, t)]
        if bases:
            key, owner, nbytes = bases[0]
            self._persist_base(owner, key)
            self.pool.remove(key)
            self._events.moved(Tier.DEVICE, Tier.DISK, nbytes)
            return nbytes
        sessions = self._idle(Tier.DEVICE, tenant)
        if not sessions:
            return None
        freed = sessions[0].nbytes
        self._move_down(sessions[0], drop=False)
        return freed

    def _move_lru(self, tier: Tier) -> bool:
        idle = self._idle(tier)
        if not idle:
            return False
        self._move_down(idle[0], drop=False)
        return True

    def _move_down(self, entry: _Entry, drop: bool, skip_host: bool = True) -> None:
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
                    self.pool.release(cache.base_key)
                entry.tier, entry.cache, entry.nbytes = Tier.DISK, None, disk.nbytes(entry.key)
                self._events.moved(source, entry.tier, entry.nbytes)
                return
            blob = None if drop else self._seal_or_none(entry.key, cache)
            if blob is None:
                self._release_entry(entry)
            else:
                if cache.base_key is not None:
                    self._persist_base(entry.key.tenant_id, cache.base_key)
                    self.pool.release(cache.base_key)
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
            self._release_entry(entry)
        if source is not None:
            self._events.moved(source, entry.tier, entry.nbytes)

    def _seal_or_none(
        self, key: CacheKey, cache: SessionCache, pause: Callable[[], None] | None = None
    ) -> bytes | None:
        try:
            return self._sealer.seal_session(key, cache, pause)
        except SealFailed as exc:
            log.warning("dropping the cache of session %s instead of storing it: %s", key.name, exc)
            return None

    def _persist_base(self, tenant_id: TenantId, key: PrefixKey) -> None:
        blob_key = CacheKey.for_base(tenant_id, key)
        self._base_used[blob_key] = next(self._clock)
        disk = self._stores[Tier.DISK]
        if disk.contains(blob_key):
            return
        base = self.pool.get(key)
        if base is None:
            return
        try:
            disk.put(blob_key, self._sealer.seal_base(blob_key, base))
        except SealFailed as exc:
            log.warning("base layer %s not stored (it is rebuilt when needed): %s", key, exc)

    def _drop_lru_disk_blob(self) -> bool:
        """Drop the oldest disk blob: an idle disk-tier session, a stale write-back copy, or a
        base layer no live session references."""
        disk = self._stores[Tier.DISK]
        # A base blob is needed as long as an offloaded session references it: it counts as used
        # as recently as the most recent of those sessions.
        base_users: dict[CacheKey, int] = {}
        for user in self._entries.values():
            if user.base_key is not None and user.tier is not None:
                blob_key = CacheKey.for_base(user.key.tenant_id, user.base_key)
                base_users[blob_key] = max(base_users.get(blob_key, 0), user.last_used)
        candidates: list[tuple[int, CacheKey]] = []
        for key in disk.keys():
            if key.is_base:
                candidates.append((max(self._base_used.get(key, 0), base_users.get(key, 0)), key))
                continue
            entry = self._entries.get(key)
            if entry is None:
                candidates.append((0, key))
            elif not entry.leased:
                candidates.append((entry.last_used, key))
        if not candidates:
            return False
        _, key = min(candidates, key=lambda item: item[0])
        entry = self._entries.get(key)
        if entry is not None and entry.tier is Tier.DISK:
            self._move_down(entry, drop=True)
        else:
            disk.delete(key)
            if entry is not None:
                entry.persisted_version = None
            self._base_used.pop(key, None)
            self._events.moved(Tier.DISK, None, 0)
        return True

    # -- write-back ----------------------------------------------------------------------------

    def _queue_write_back(self, key: CacheKey) -> None:
        with self._lock:
            if self._closed:
                return
            future = self._writer.submit(self._write_back_job, key, time.monotonic() + self._max_defer_s)
            self._pending[key] = future
        future.add_done_callback(lambda done: self._write_back_done(key, done))

    def _write_back_done(self, key: CacheKey, future: Future[None]) -> None:
        with self._lock:
            if self._pending.get(key) is future:
                del self._pending[key]
        if not future.cancelled() and future.exception() is not None:
            # The cache stays on the device and is written at eviction or shutdown instead.
            log.error("write-back of session %s failed", key.name, exc_info=future.exception())

    def _step_aside(self, deadline: float) -> None:
        """Block the writer until no turn has been in flight for the settle time, or `deadline`
        (`time.monotonic()` seconds) passes, the device tier is nearly full, a `flush()` waits,
        or the manager closes."""
        with self._lock:
            while not self._closed and not self._hurry:
                now = time.monotonic()
                if now >= deadline or self._device_pressure():
                    return
                if self._turns_in_flight:
                    timeout = deadline - now
                else:
                    quiet = now - self._last_turn_end
                    if quiet >= self._settle_s:
                        return
                    timeout = min(self._settle_s - quiet, deadline - now)
                self._turn_ended.wait(timeout)

    def _device_pressure(self) -> bool:
        """Under the lock: is the device tier above `WRITE_BACK_DEVICE_PRESSURE` of its budget?"""
        return self.usage().bytes[Tier.DEVICE] > WRITE_BACK_DEVICE_PRESSURE * self.budgets.device_bytes

    def _write_back_due(self, key: CacheKey) -> tuple[_Entry, SessionCache, int] | None:
        """Under the lock: the entry, cache and version to write, or `None` when there is nothing
        to write (deleted, moved off the device, or this version already on disk)."""
        entry = self._entries.get(key)
        if entry is None or entry.tier is not Tier.DEVICE or entry.cache is None:
            return None
        if entry.persisted_version == entry.version:
            return None
        return entry, entry.cache, entry.version

    def _write_back_job(self, key: CacheKey, deadline: float) -> None:
        with self._lock:
            if self._write_back_due(key) is None:
                return  # e.g. an earlier job already wrote this version: no need to wait for turns
        self._step_aside(deadline)
        with self._lock:
            due = self._write_back_due(key)
            if due is None:
                return
            entry, cache, version = due
        blob = self._seal_or_none(key, cache, pause=lambda: self._step_aside(deadline))
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
                self._persist_base(key.tenant_id, cache.base_key)
            # Write-back adds disk bytes between turns; keep the disk tier within its budget too.
            self._enforce_disk_budget()

    def flush(self) -> None:
        """Wait for queued write-backs, which stop yielding to turns meanwhile (a failed one was
        logged; its cache is written at shutdown)."""
        with self._lock:
            futures = list(self._pending.values())
            self._hurry += 1
            self._turn_ended.notify_all()
        try:
            wait(futures)
        finally:
            with self._lock:
                self._hurry -= 1

    def persist_all(self) -> None:
        """Write every cache not yet on disk there (at shutdown, so a restart resumes warm)."""
        self.flush()
        with self._lock:
            for entry in list(self._entries.values()):
                if entry.leased or entry.tier is None:
                    continue
                if entry.tier is Tier.HOST:
                    self._move_down(entry, drop=False)
                elif entry.tier is Tier.DEVICE and entry.persisted_version != entry.version:
                    if entry.cache is None:
                        raise RuntimeError("bug: a device entry without its cache")
                    blob = self._seal_or_none(entry.key, entry.cache)
                    if blob is None:
                        continue
                    self._stores[Tier.DISK].put(entry.key, blob)
                    if entry.cache.base_key is not None:
                        self._persist_base(entry.key.tenant_id, entry.cache.base_key)
                    entry.persisted_version = entry.version
            self._enforce_disk_budget()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._turn_ended.notify_all()
        self._writer.shutdown(wait=True)


class Lease:
    """One turn's hold on a session; created by `TierManager.lease`."""

    def __init__(self, manager: TierManager, entry: _Entry) -> None:
        self._manager = manager
        self._entry = entry
        self.committed = False

    @property
    def key(self) -> CacheKey:
        return self._entry.key

    def restore(self) -> Restored:
        """Bring the session's cache to the device (decrypt, decode, attach the base)."""
        return self._manager._restore(self._entry)

    def commit(self, cache: SessionCache) -> None:
        """Make `cache` (base attached) the session's device copy after a successful turn."""
        manager = self._manager
        with manager._lock:
            entry = self._entry
            if entry.tier in (Tier.HOST, Tier.DISK):
                manager._stores[entry.tier].delete(entry.key)
                entry.persisted_version = None
            elif entry.persisted_version is not None and not manager._write_back:
                # The disk copy is about to be stale and nothing would overwrite it before eviction.
                manager._stores[Tier.DISK].delete(entry.key)
                entry.persisted_version = None
            manager._place_on_device(entry, cache)
            entry.version += 1
            self.committed = True

    def adopt_base(self, base: BaseLayer) -> BaseLayer:
        """Put a base layer computed by this turn into the pool and return the pooled instance
        (another turn may have put the same key first; every session then shares that one). If
        the session was forgotten meanwhile (it or its tenant deleted), `base` is returned
        unpooled, so a deleted tenant's KV never enters the pool after `forget_tenant`."""
        manager = self._manager
        with manager._lock:
            if manager._entries.get(self._entry.key) is not self._entry:
                return base
            return manager.pool.put(self._entry.key.tenant_id, base)

    def discard(self) -> None:
        """Drop whatever is stored for the session (it no longer matches the transcript)."""
        with self._manager._lock:
            self._manager._release_entry(self._entry)
