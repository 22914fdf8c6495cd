"""`TierManager` on its own: synthetic session caches (no model), the real encrypted sealer, the real
host store and a real disk store on SQLite. Budgets, exact LRU order, leases, the per-tenant
quota, bit-identical restores, rejected blobs, write-back and shared base layers."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from cache.budgets import TierBudgets
from cache.ids import PrefixKey, SessionId, TenantId
from cache.layer_table import LayerKind, LayerSpan
from cache.prefix_pool import PrefixPool
from cache.session_cache import BaseLayer, SessionCache
from cache.tier_manager import LeaseHeld, TierManager
from cache.tiers import CacheKey, CacheSealer, Tier
from sessions.offload import EncryptedCacheSealer, TierBlobStore
from storage.blob_stores import DiskBlobStore, HostBlobStore
from storage.database import open_database, upgrade
from storage.keyring import MasterKey, TenantKeys, key_id
from storage.metadata_store import MetadataStore

LAYERS, HEADS, DIM = 2, 2, 16
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * DIM * 4  # float32 keys and values of every model layer
TOKENS = 16
SESSION_BYTES = TOKENS * BYTES_PER_TOKEN  # 8 KiB of own tensors per synthetic session
BIG = 2**40
A, B = TenantId("tn_a"), TenantId("tn_b")


@dataclass
class Recorder:
    """`TierEvents` that remembers everything, in order."""

    moves: list[tuple[Tier, Tier | None]] = field(default_factory=list)
    restores: list[Tier] = field(default_factory=list)
    rejections: list[Tier] = field(default_factory=list)

    def moved(self, source: Tier, target: Tier | None, nbytes: int) -> None:
        self.moves.append((source, target))

    def restored(self, source: Tier, seconds: float) -> None:
        self.restores.append(source)

    def rejected(self, source: Tier) -> None:
        self.rejections.append(source)


@dataclass
class Rig:
    tiers: TierManager
    metadata: MetadataStore
    disk: DiskBlobStore[CacheKey]
    host: HostBlobStore[CacheKey]
    events: Recorder
    built_bases: list[PrefixKey]
    keys: TenantKeys


def tensors(tokens: int, seed: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    keys = tuple(torch.randn(1, HEADS, tokens, DIM, generator=generator) for _ in range(LAYERS))
    values = tuple(torch.randn(1, HEADS, tokens, DIM, generator=generator) for _ in range(LAYERS))
    return keys, values


def make_base(tenant: TenantId, name: str = "sys", tokens: int = 8) -> BaseLayer:
    keys, values = tensors(tokens, seed=hash((tenant, name)) % 2**31)
    return BaseLayer(PrefixKey(f"{tenant}-{name}"), tuple(range(100, 100 + tokens)), keys, values)


def make_cache(seed: int, tokens: int = TOKENS, base: BaseLayer | None = None) -> SessionCache:
    keys, values = tensors(tokens, seed)
    start = base.token_count if base else 0
    return SessionCache(
        base_key=base.key if base else None,
        base_token_ids=base.token_ids if base else (),
        own_keys=keys,
        own_values=values,
        own_token_ids=tuple(range(10000 + seed * 100, 10000 + seed * 100 + tokens)),  # same width: same blob size
        layers=(LayerSpan(LayerKind.TURN, 0, tokens, start, start),),
        base=base,
    )


def budgets(device: int = BIG, host: int = BIG, disk: int = BIG, quota: int | None = None) -> TierBudgets:
    return TierBudgets(device, host, disk, quota if quota is not None else device)


@pytest.fixture
def make_rig(tmp_path: Path) -> Iterator:
    """Builds rigs on one SQLite database and blob folder (a second rig is a restart)."""
    url = f"sqlite:///{tmp_path / 'chatkv.db'}"
    engine = open_database(url)
    upgrade(url, engine)
    metadata = MetadataStore(engine)
    master = MasterKey(bytes(32), key_id(bytes(32)), from_env=True)
    keys = TenantKeys(metadata, master)
    for tenant in (A, B):
        metadata.create_tenant(tenant_id=tenant, name=tenant, wrapped_data_key=keys.new_wrapped_key(tenant))
    rigs: list[Rig] = []

    def build(
        limits: TierBudgets | None = None,
        write_back: bool = False,
        fingerprint: str = "fp-a",
        disk_type: type[DiskBlobStore[CacheKey]] = DiskBlobStore,
        wrap_sealer: Callable[[CacheSealer], CacheSealer] = lambda sealer: sealer,
        **options: float,
    ) -> Rig:
        disk: DiskBlobStore[CacheKey] = disk_type(
            tmp_path / "blobs", metadata, fingerprint, lambda t, n: CacheKey(TenantId(t), n)
        )
        host: HostBlobStore[CacheKey] = HostBlobStore()
        events, built = Recorder(), []

        def builder(tenant: TenantId, key: PrefixKey, ids: tuple[int, ...]) -> BaseLayer:
            built.append(key)
            keys_, values_ = tensors(len(ids), seed=7)
            return BaseLayer(key, ids, keys_, values_)

        ring = TenantKeys(metadata, master)
        tiers = TierManager(
            pool=PrefixPool(),
            sealer=wrap_sealer(EncryptedCacheSealer(ring, fingerprint, torch.device("cpu"), max_payload_bytes=1 << 30)),
            host=TierBlobStore(host),
            disk=TierBlobStore(disk),
            budgets=limits or budgets(),
            base_builder=builder,
            write_back=write_back,
            events=events,
            **options,
        )
        tiers.adopt_disk_blobs(disk.reconcile())
        rig = Rig(tiers, metadata, disk, host, events, built, ring)
        rigs.append(rig)
        return rig

    yield build
    for rig in rigs:
        rig.tiers.close()
    engine.dispose()


def session_key(tenant: TenantId, number: int) -> CacheKey:
    name = SessionId(f"s_{number}")
    return CacheKey.for_session(tenant, name)


def add_rows(rig: Rig, *keys: CacheKey) -> None:
    for key in keys:
        rig.metadata.create_session(
            tenant_id=key.tenant_id, session_id=key.name, title=None, system_prompt=None, model_fingerprint="fp-a"
        )


def turn(tiers: TierManager, key: CacheKey, cache: SessionCache) -> None:
    """What a turn does with its lease: restore, then commit the new cache."""
    with tiers.lease(key) as lease:
        lease.restore()
        lease.commit(cache)


def placements(tiers: TierManager, keys: list[CacheKey]) -> list[Tier | None]:
    return [tiers.placement(key) for key in keys]


def assert_same_tensors(left: SessionCache, right: SessionCache) -> None:
    assert left.own_token_ids == right.own_token_ids
    assert left.layers == right.layers
    assert (left.base_key, left.base_token_ids) == (right.base_key, right.base_token_ids)
    for a, b in zip((*left.own_keys, *left.own_values), (*right.own_keys, *right.own_values), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


# -- budgets and LRU ---------------------------------------------------------------------------------


def test_budgets_rejects_non_positive_values() -> None:
    for bad in (dict(device=0), dict(host=-1), dict(disk=0), dict(quota=0)):
        with pytest.raises(ValueError, match="must be > 0"):
            budgets(**bad)


def test_least_recently_used_idle_sessions_move_down_in_exact_order(make_rig) -> None:
    rig = make_rig(budgets(device=2 * SESSION_BYTES + 100))
    keys = [session_key(A, n) for n in range(5)]
    add_rows(rig, *keys)
    blob_bytes = len(rig.tiers._sealer.seal_session(keys[0], make_cache(0)))
    rig.tiers.budgets = budgets(device=2 * SESSION_BYTES + 100, host=2 * blob_bytes + 100)
    for n in range(3):
        turn(rig.tiers, keys[n], make_cache(n))
    assert placements(rig.tiers, keys) == [Tier.HOST, Tier.DEVICE, Tier.DEVICE, None, None]
    turn(rig.tiers, keys[1], make_cache(11))  # s_1 is now the most recent; s_2 the least recent on the device
    turn(rig.tiers, keys[3], make_cache(3))
    assert placements(rig.tiers, keys) == [Tier.HOST, Tier.DEVICE, Tier.HOST, Tier.DEVICE, None]
    turn(rig.tiers, keys[4], make_cache(4))  # s_1 to host; the host holds two, so s_0 goes to disk
    assert placements(rig.tiers, keys) == [Tier.DISK, Tier.HOST, Tier.HOST, Tier.DEVICE, Tier.DEVICE]
    assert rig.events.moves == [
        (Tier.DEVICE, Tier.HOST),  # s_0
        (Tier.DEVICE, Tier.HOST),  # s_2
        (Tier.DEVICE, Tier.HOST),  # s_1
        (Tier.HOST, Tier.DISK),  # s_0
    ]
    usage = rig.tiers.usage()
    assert usage.bytes == {Tier.DEVICE: 2 * SESSION_BYTES, Tier.HOST: 2 * blob_bytes, Tier.DISK: blob_bytes}
    assert usage.sessions == {Tier.DEVICE: 2, Tier.HOST: 2, Tier.DISK: 1}


def test_disk_over_budget_drops_the_oldest_blob(make_rig) -> None:
    rig = make_rig()
    keys = [session_key(A, n) for n in range(4)]
    add_rows(rig, *keys)
    blob_bytes = len(rig.tiers._sealer.seal_session(keys[0], make_cache(0)))
    rig.tiers.budgets = budgets(device=SESSION_BYTES, host=blob_bytes, disk=blob_bytes + 100)
    for n in range(3):
        turn(rig.tiers, keys[n], make_cache(n))
    assert placements(rig.tiers, keys) == [Tier.DISK, Tier.HOST, Tier.DEVICE, None]
    turn(rig.tiers, keys[3], make_cache(3))
    # s_0 went device -> host -> disk, then was dropped when s_1 reached the disk.
    assert placements(rig.tiers, keys) == [None, Tier.DISK, Tier.HOST, Tier.DEVICE]
    assert rig.events.moves == [
        (Tier.DEVICE, Tier.HOST),  # s_0
        (Tier.DEVICE, Tier.HOST),  # s_1
        (Tier.HOST, Tier.DISK),  # s_0
        (Tier.DEVICE, Tier.HOST),  # s_2
        (Tier.HOST, Tier.DISK),  # s_1
        (Tier.DISK, None),  # s_0
    ]
    assert [r.name for r in rig.metadata.list_blobs()] == ["s_1"]
    with rig.tiers.lease(keys[0]) as lease:
        assert lease.restore().cache is None


def test_a_cache_larger_than_the_device_budget_moves_down_when_its_turn_ends(make_rig) -> None:
    rig = make_rig(budgets(device=SESSION_BYTES - 1))
    key = session_key(A, 0)
    with rig.tiers.lease(key) as lease:
        lease.restore()
        lease.commit(make_cache(0))
        assert rig.tiers.placement(key) is Tier.DEVICE  # not while the turn holds it
    assert rig.tiers.placement(key) is Tier.HOST
    assert rig.tiers.usage().bytes[Tier.DEVICE] == 0


# -- leases ------------------------------------------------------------------------------------------


def test_a_leased_session_is_never_moved(make_rig) -> None:
    rig = make_rig(budgets(device=SESSION_BYTES + 100))
    held, other = session_key(A, 0), session_key(A, 1)
    add_rows(rig, held, other)
    turn(rig.tiers, held, make_cache(0))
    with rig.tiers.lease(held) as lease:
        assert lease.restore().source is Tier.DEVICE
        with pytest.raises(LeaseHeld):
            rig.tiers.evict(held, Tier.DISK)
        with pytest.raises(LeaseHeld), rig.tiers.lease(held):
            pass
        turn(rig.tiers, other, make_cache(1))  # over budget: the other (newer) session moves instead
        assert placements(rig.tiers, [held, other]) == [Tier.DEVICE, Tier.HOST]
        rig.tiers.enforce_budgets()
        assert rig.tiers.placement(held) is Tier.DEVICE
    assert placements(rig.tiers, [held, other]) == [Tier.DEVICE, Tier.HOST]
    assert rig.tiers.evict(held, Tier.DISK) is Tier.DISK


def test_evict_moves_down_only(make_rig) -> None:
    rig = make_rig()
    key = session_key(A, 0)
    add_rows(rig, key)
    turn(rig.tiers, key, make_cache(0))
    assert rig.tiers.evict(key, Tier.HOST) is Tier.HOST
    with pytest.raises(ValueError, match="cannot evict from host up to device"):
        rig.tiers.evict(key, Tier.DEVICE)
    assert rig.tiers.evict(key, Tier.DISK) is Tier.DISK
    assert rig.tiers.evict(key, None) is None
    assert rig.tiers.evict(session_key(A, 9), Tier.DISK) is None
    assert rig.events.moves == [(Tier.DEVICE, Tier.HOST), (Tier.HOST, Tier.DISK), (Tier.DISK, None)]


# -- per-tenant device quota -------------------------------------------------------------------------


def test_a_tenant_over_its_quota_loses_its_own_sessions_only(make_rig) -> None:
    rig = make_rig(budgets(device=10 * SESSION_BYTES, quota=2 * SESSION_BYTES + 100))
    theirs = session_key(B, 90)
    ours = [session_key(A, n) for n in range(4)]
    turn(rig.tiers, theirs, make_cache(99))  # the least recently used session of all
    for n, key in enumerate(ours):
        turn(rig.tiers, key, make_cache(n))
    assert placements(rig.tiers, [theirs, *ours]) == [Tier.DEVICE, Tier.HOST, Tier.HOST, Tier.DEVICE, Tier.DEVICE]
    assert rig.tiers.usage().device_bytes_by_tenant == {A: 2 * SESSION_BYTES, B: SESSION_BYTES}


def test_the_quota_counts_a_tenants_base_layers(make_rig) -> None:
    base = make_base(A, tokens=TOKENS)
    rig = make_rig(budgets(device=10 * SESSION_BYTES, quota=2 * SESSION_BYTES + 100))
    keys = [session_key(A, n) for n in range(2)]
    add_rows(rig, *keys)
    for n, key in enumerate(keys):
        turn(rig.tiers, key, make_cache(n, base=base))
    # base + two sessions exceed the quota: the older session goes, the base stays (still referenced).
    assert placements(rig.tiers, keys) == [Tier.HOST, Tier.DEVICE]
    assert rig.tiers.usage().device_bytes_by_tenant == {A: 2 * SESSION_BYTES}


# -- restore -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.DISK])
def test_restore_is_bit_identical(make_rig, tier: Tier) -> None:
    rig = make_rig()
    base = make_base(A)
    key = session_key(A, 0)
    add_rows(rig, key)
    original = make_cache(0, base=base)
    turn(rig.tiers, key, original)
    assert rig.tiers.evict(key, tier) is tier
    stored = rig.tiers.stored_cache(key)
    assert stored is not None and stored.base is None
    assert_same_tensors(stored, original)
    with rig.tiers.lease(key) as lease:
        restored = lease.restore()
    assert restored.source is tier and not restored.rejected
    assert restored.cache is not None and restored.cache.base is not None
    assert_same_tensors(restored.cache, original)
    for a, b in zip(restored.cache.base.keys, base.keys, strict=True):
        assert torch.equal(a, b)
    assert rig.tiers.placement(key) is Tier.DEVICE
    assert rig.events.restores == [tier]
    assert rig.host.keys() == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_restore_keeps_the_model_dtype(make_rig, dtype: torch.dtype) -> None:
    rig = make_rig()
    key = session_key(A, 0)
    cache = make_cache(0)
    cache = SessionCache(
        None,
        (),
        tuple(t.to(dtype) for t in cache.own_keys),
        tuple(t.to(dtype) for t in cache.own_values),
        cache.own_token_ids,
        cache.layers,
    )
    turn(rig.tiers, key, cache)
    rig.tiers.evict(key, Tier.HOST)
    with rig.tiers.lease(key) as lease:
        restored = lease.restore().cache
    assert restored is not None
    assert_same_tensors(restored, cache)


def test_a_restart_adopts_disk_blobs_and_restores_them(make_rig) -> None:
    first = make_rig()
    base = make_base(A)
    keys = [session_key(A, n) for n in range(2)]
    add_rows(first, *keys)
    originals = [make_cache(n, base=base) for n in range(2)]
    for key, cache in zip(keys, originals, strict=True):
        turn(first.tiers, key, cache)
    first.tiers.persist_all()
    first.tiers.close()
    second = make_rig()
    assert placements(second.tiers, keys) == [Tier.DISK, Tier.DISK]
    with second.tiers.lease(keys[1]) as lease:
        restored = lease.restore()
    assert restored.source is Tier.DISK and restored.cache is not None
    assert_same_tensors(restored.cache, originals[1])
    assert second.built_bases == []  # the base came from its own blob, not a rebuild


def test_a_rejected_blob_is_discarded(make_rig) -> None:
    rig = make_rig()
    key = session_key(A, 0)
    add_rows(rig, key)
    turn(rig.tiers, key, make_cache(0))
    rig.tiers.evict(key, Tier.DISK)
    path = rig.disk.path_for(key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with rig.tiers.lease(key) as lease:
        restored = lease.restore()
    assert (restored.cache, restored.source, restored.rejected) == (None, None, True)
    assert rig.events.rejections == [Tier.DISK]
    assert rig.tiers.placement(key) is None
    assert not path.exists() and rig.metadata.list_blobs() == []


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.DISK])
def test_a_missing_blob_is_discarded_and_rebuilt(make_rig, tier: Tier) -> None:
    rig = make_rig()
    key = session_key(A, 0)
    add_rows(rig, key)
    turn(rig.tiers, key, make_cache(0))
    assert rig.tiers.evict(key, tier) is tier
    if tier is Tier.HOST:
        rig.host.delete(key)
    else:
        rig.disk.path_for(key).unlink()  # removed behind the store, which still lists it
    assert rig.tiers.stored_cache(key) is None
    with rig.tiers.lease(key) as lease:
        restored = lease.restore()
    assert (restored.cache, restored.source, restored.rejected) == (None, None, True)
    assert rig.events.rejections == [tier]
    assert rig.tiers.placement(key) is None


def test_a_base_blob_whose_file_vanished_is_rebuilt(make_rig) -> None:
    base = make_base(A)
    rig = make_rig()
    key = session_key(A, 0)
    add_rows(rig, key)
    turn(rig.tiers, key, make_cache(0, base=base))
    rig.tiers.evict(key, Tier.DISK)
    rig.tiers.pool.remove(base.key)
    rig.disk.path_for(CacheKey.for_base(A, base.key)).unlink()  # the store still lists it
    with rig.tiers.lease(key) as lease:
        restored = lease.restore()
    assert restored.source is Tier.DISK and restored.cache is not None and restored.cache.base is not None
    assert rig.built_bases == [base.key]
    assert rig.events.rejections == [Tier.DISK]


class BuggyDiskStore(DiskBlobStore[CacheKey]):
    """A disk store whose `get` has a bug that raises a bare `KeyError` (not `BlobNotFound`)."""

    def get(self, key: CacheKey) -> bytes:
        raise KeyError(f"bug in get({key.name})")


def test_a_key_error_from_a_buggy_store_propagates_instead_of_rebuilding(make_rig) -> None:
    rig = make_rig(disk_type=BuggyDiskStore)
    key = session_key(A, 0)
    add_rows(rig, key)
    turn(rig.tiers, key, make_cache(0))
    assert rig.tiers.evict(key, Tier.DISK) is Tier.DISK
    with pytest.raises(KeyError, match="bug in get"), rig.tiers.lease(key) as lease:
        lease.restore()
    with pytest.raises(KeyError, match="bug in get"):
        rig.tiers.stored_cache(key)
    # Nothing was taken for a missing blob: no rejection, the blob and its placement stay.
    assert rig.events.rejections == []
    assert rig.tiers.placement(key) is Tier.DISK and rig.disk.path_for(key).exists()


def test_a_blob_of_another_model_is_invalidated_at_start_up(make_rig) -> None:
    first = make_rig()
    key = session_key(A, 0)
    add_rows(first, key)
    turn(first.tiers, key, make_cache(0))
    first.tiers.persist_all()
    second = make_rig(fingerprint="fp-b")
    assert second.tiers.placement(key) is None
    assert second.metadata.list_blobs() == []


# -- write-back --------------------------------------------------------------------------------------


def test_write_back_persists_each_turn_and_makes_the_move_to_disk_free(make_rig) -> None:
    rig = make_rig(write_back=True)
    key = session_key(A, 0)
    add_rows(rig, key)
    turn(rig.tiers, key, make_cache(0))
    rig.tiers.flush()
    written = rig.disk.path_for(key).read_bytes()
    assert rig.tiers.placement(key) is Tier.DEVICE
    assert [r.name for r in rig.metadata.list_blobs()] == ["s_0"]
    rig.tiers.evict(key, Tier.DISK)
    assert rig.disk.path_for(key).read_bytes() == written  # not sealed and written again
    with rig.tiers.lease(key) as lease:
        restored = lease.restore().cache
        assert restored is not None
        assert_same_tensors(restored, make_cache(0))
        lease.commit(make_cache(5))
    rig.tiers.flush()
    assert rig.tiers.stored_cache(key) is None  # on the device; its disk copy is the new version
    assert rig.disk.path_for(key).read_bytes() != written


def test_on_evict_mode_drops_a_stale_disk_copy_when_the_session_changes(make_rig) -> None:
    rig = make_rig()
    key = session_key(A, 0)
    add_rows(rig, key)
    turn(rig.tiers, key, make_cache(0))
    rig.tiers.evict(key, Tier.DISK)
    turn(rig.tiers, key, make_cache(1))
    assert rig.tiers.placement(key) is Tier.DEVICE
    assert rig.metadata.list_blobs() == []  # the disk copy no longer matches the session
    rig.tiers.persist_all()  # at shutdown the device copy is written
    assert rig.tiers.placement(key) is Tier.DEVICE
    assert [r.name for r in rig.metadata.list_blobs()] == ["s_0"]


def test_write_back_keeps_the_disk_within_budget(make_rig) -> None:
    rig = make_rig(write_back=True)
    keys = [session_key(A, n) for n in range(3)]
    add_rows(rig, *keys)
    blob_bytes = len(rig.tiers._sealer.seal_session(keys[0], make_cache(0)))
    rig.tiers.budgets = budgets(disk=2 * blob_bytes + 100)
    for n, key in enumerate(keys):
        turn(rig.tiers, key, make_cache(n))
        rig.tiers.flush()
        assert rig.tiers.usage().bytes[Tier.DISK] <= rig.tiers.budgets.disk_bytes
    assert sorted(r.name for r in rig.metadata.list_blobs()) == ["s_1", "s_2"]


def test_a_tenant_without_a_usable_data_key_has_its_caches_dropped_not_stored(make_rig) -> None:
    """While a tenant is being deleted (key destroyed first), or under a master key that does not
    unwrap its key, nothing can be sealed: caches are dropped, and no background error surfaces."""
    rig = make_rig(write_back=True)
    base = make_base(A)
    keys = [session_key(A, n) for n in range(3)]
    add_rows(rig, *keys)
    turn(rig.tiers, keys[0], make_cache(0, base=base))
    rig.tiers.flush()
    rig.metadata.set_tenant_key(tenant_id=A, wrapped_data_key=None, master_key_id=None)
    rig.keys.forget(A)
    turn(rig.tiers, keys[1], make_cache(1, base=base))
    turn(rig.tiers, keys[2], make_cache(2))
    rig.tiers.flush()  # the write-backs found no key: nothing written, nothing raised
    assert rig.tiers.evict(keys[1], Tier.HOST) is None
    assert rig.tiers.evict(keys[0], Tier.HOST) is None  # its disk copy cannot help either: dropped
    rig.tiers.persist_all()
    assert placements(rig.tiers, keys) == [None, None, Tier.DEVICE]
    assert [r.name for r in rig.metadata.list_blobs()] == [f"base-{base.key}"]  # written before
    assert rig.host.keys() == []
    assert (Tier.DEVICE, None) in rig.events.moves


# -- shared base layers ------------------------------------------------------------------------------


def test_an_unreferenced_base_leaves_the_device_before_any_session(make_rig) -> None:
    base = make_base(A, tokens=TOKENS)
    rig = make_rig()
    keys = [session_key(A, n) for n in range(2)]
    add_rows(rig, *keys)
    turn(rig.tiers, keys[0], make_cache(0, base=base))
    rig.tiers.evict(keys[0], Tier.HOST)  # the base stays in the pool, unreferenced
    assert len(rig.tiers.pool) == 1
    rig.tiers.budgets = budgets(device=SESSION_BYTES + 100)
    turn(rig.tiers, keys[1], make_cache(1))
    assert len(rig.tiers.pool) == 0
    assert rig.tiers.placement(keys[1]) is Tier.DEVICE
    assert [r.name for r in rig.metadata.list_blobs()] == [f"base-{base.key}"]
    with rig.tiers.lease(keys[0]) as lease:
        restored = lease.restore().cache
    assert restored is not None and restored.base is not None
    assert rig.built_bases == []  # reloaded from its blob


def test_a_dropped_base_blob_is_rebuilt_and_reported(make_rig) -> None:
    base = make_base(A)
    rig = make_rig()
    key = session_key(A, 0)
    add_rows(rig, key)
    turn(rig.tiers, key, make_cache(0, base=base))
    rig.tiers.evict(key, Tier.DISK)
    rig.tiers.pool.remove(base.key)
    rig.disk.delete(CacheKey.for_base(A, base.key))
    with rig.tiers.lease(key) as lease:
        restored = lease.restore()
    assert restored.source is Tier.DISK and restored.cache is not None and restored.cache.base is not None
    assert rig.built_bases == [base.key]
    assert restored.base_prefill_tokens == base.token_count  # the recomputed base counts as prefilled


def test_a_base_blob_outlives_the_offloaded_sessions_that_reference_it(make_rig) -> None:
    """Disk LRU counts a base blob as used as recently as its most recent offloaded session, so
    an older session blob goes first, never the base a newer session still needs."""
    base = make_base(A)
    rig = make_rig()
    keys = [session_key(A, n) for n in range(3)]
    add_rows(rig, *keys)
    for n, key in enumerate(keys):  # s_0 and s_2 reference the base; s_1 does not
        turn(rig.tiers, key, make_cache(n, base=base if n != 1 else None))
        rig.tiers.evict(key, Tier.DISK)
    base_blob = CacheKey.for_base(A, base.key)
    # The base blob was written first, with s_0; by plain LRU it would be the oldest blob.
    rig.tiers.budgets = budgets(disk=rig.disk.nbytes(base_blob) + rig.disk.nbytes(keys[2]) + 10)
    rig.tiers.enforce_budgets()
    assert sorted(r.name for r in rig.metadata.list_blobs()) == sorted([base_blob.name, "s_2"])
    assert placements(rig.tiers, keys) == [None, None, Tier.DISK]
    rig.tiers.pool.remove(base.key)
    with rig.tiers.lease(keys[2]) as lease:
        assert lease.restore().base_prefill_tokens == 0  # its base came back from the blob
    assert rig.built_bases == []


def test_with_write_back_a_persisted_session_leaves_the_device_instantly_for_disk(make_rig) -> None:
    rig = make_rig(write_back=True)
    keys = [session_key(A, n) for n in range(2)]
    add_rows(rig, *keys)
    turn(rig.tiers, keys[0], make_cache(0))
    rig.tiers.flush()
    written = rig.disk.path_for(keys[0]).stat().st_mtime_ns
    rig.tiers.budgets = budgets(device=SESSION_BYTES + 100)
    turn(rig.tiers, keys[1], make_cache(1))
    assert placements(rig.tiers, keys) == [Tier.DISK, Tier.DEVICE]  # no sealing into host
    assert rig.host.keys() == [] and rig.disk.path_for(keys[0]).stat().st_mtime_ns == written
    assert rig.events.moves == [(Tier.DEVICE, Tier.DISK)]
    # An operator who asks for the host tier still gets it.
    rig.tiers.flush()
    rig.tiers.budgets = budgets()
    assert rig.tiers.evict(keys[1], Tier.HOST) is Tier.HOST


# -- forgetting ----------------------------------------------------------------------------------------


def test_forget_tenant_removes_every_copy_of_that_tenant_only(make_rig) -> None:
    rig = make_rig()
    ours = [session_key(A, n) for n in range(3)]
    theirs = session_key(B, 90)
    add_rows(rig, *ours, theirs)
    base = make_base(A)
    for n, key in enumerate(ours):
        turn(rig.tiers, key, make_cache(n, base=base))
    turn(rig.tiers, theirs, make_cache(9))
    rig.tiers.evict(ours[1], Tier.HOST)
    rig.tiers.evict(ours[2], Tier.DISK)
    rig.tiers.evict(theirs, Tier.DISK)
    rig.tiers.forget_tenant(A)
    assert placements(rig.tiers, [*ours, theirs]) == [None, None, None, Tier.DISK]
    assert rig.host.keys() == []
    assert rig.disk.keys() == [theirs]
    assert [r.tenant_id for r in rig.metadata.list_blobs()] == [B]
    assert len(rig.tiers.pool) == 0
    assert rig.tiers.usage().bytes == {Tier.DEVICE: 0, Tier.HOST: 0, Tier.DISK: rig.disk.nbytes(theirs)}


def test_forget_during_a_lease_releases_at_its_end(make_rig) -> None:
    rig = make_rig()
    base = make_base(A)
    key = session_key(A, 0)
    with rig.tiers.lease(key) as lease:
        lease.restore()
        lease.commit(make_cache(0, base=base))
        rig.tiers.forget(key)
    assert rig.tiers.placement(key) is None
    assert rig.tiers.pool.refs(base.key) == 0


def test_explicit_evictions_keep_the_host_within_budget(make_rig) -> None:
    rig = make_rig()
    keys = [session_key(A, n) for n in range(3)]
    add_rows(rig, *keys)
    blob_bytes = len(rig.tiers._sealer.seal_session(keys[0], make_cache(0)))
    rig.tiers.budgets = budgets(host=2 * blob_bytes + 100)
    for n, key in enumerate(keys):
        turn(rig.tiers, key, make_cache(n))
    for key in keys:
        rig.tiers.evict(key, Tier.HOST)
        assert rig.tiers.usage().bytes[Tier.HOST] <= rig.tiers.budgets.host_bytes
    assert placements(rig.tiers, keys) == [Tier.DISK, Tier.HOST, Tier.HOST]


# -- write-back yields to turns ------------------------------------------------------------------------


def test_write_back_waits_while_another_session_has_a_turn_in_flight(make_rig) -> None:
    rig = make_rig(write_back=True, write_back_max_defer_s=60.0)
    keys = [session_key(A, n) for n in range(2)]
    add_rows(rig, *keys)
    with rig.tiers.lease(keys[1]):  # another session's turn is running
        turn(rig.tiers, keys[0], make_cache(0))
        time.sleep(0.3)
        assert not rig.disk.path_for(keys[0]).exists()
    rig.tiers.flush()
    assert rig.disk.path_for(keys[0]).exists()
    assert rig.tiers.evict(keys[0], Tier.DISK) is Tier.DISK
    stored = rig.tiers.stored_cache(keys[0])
    assert stored is not None
    assert_same_tensors(stored, make_cache(0))


def test_write_back_goes_ahead_after_its_deferral_limit(make_rig) -> None:
    rig = make_rig(write_back=True, write_back_max_defer_s=0.1)
    keys = [session_key(A, n) for n in range(2)]
    add_rows(rig, *keys)
    with rig.tiers.lease(keys[1]):  # a busy server: some turn is always in flight
        turn(rig.tiers, keys[0], make_cache(0))
        rig.tiers.flush()
        assert rig.disk.path_for(keys[0]).exists()


class GatedSealer:
    """Wraps a sealer (`wrap`): at its pause point, signals `paused` and waits for `go` before pausing."""

    def __init__(self) -> None:
        self.paused = threading.Event()
        self.go = threading.Event()

    def wrap(self, inner: CacheSealer) -> CacheSealer:
        self.inner = inner
        return self

    def seal_session(self, key: CacheKey, cache: SessionCache, pause: Callable[[], None] | None = None) -> bytes:
        def gate() -> None:
            self.paused.set()
            self.go.wait(10)
            if pause is not None:
                pause()

        return self.inner.seal_session(key, cache, gate)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_a_write_back_pauses_between_its_steps_when_a_turn_starts(make_rig) -> None:
    gated = GatedSealer()
    rig = make_rig(write_back=True, write_back_max_defer_s=60.0, wrap_sealer=gated.wrap)
    keys = [session_key(A, n) for n in range(2)]
    add_rows(rig, *keys)
    turn(rig.tiers, keys[0], make_cache(0))
    assert gated.paused.wait(10), "the sealer never reached its pause point"
    with rig.tiers.lease(keys[1]):  # a turn starts while the cache is half sealed
        gated.go.set()
        time.sleep(0.3)
        assert not rig.disk.path_for(keys[0]).exists()
    rig.tiers.flush()
    assert rig.disk.path_for(keys[0]).exists()


def test_flush_writes_every_pending_cache_without_waiting_for_the_turns(make_rig) -> None:
    rig = make_rig(write_back=True, write_back_max_defer_s=600.0)
    keys = [session_key(A, n) for n in range(4)]
    add_rows(rig, *keys)
    with rig.tiers.lease(keys[3]):  # a turn that outlasts everything below
        for number, key in enumerate(keys[:3]):
            turn(rig.tiers, key, make_cache(number))
        rig.tiers.flush()  # would take 3 x 600 s if queued write-backs kept yielding
        assert all(rig.disk.path_for(key).exists() for key in keys[:3])
        rig.tiers.persist_all()


def test_write_back_stops_yielding_when_the_device_is_nearly_full(make_rig) -> None:
    # Otherwise the next eviction would seal the unwritten cache on a turn's thread, under the lock.
    rig = make_rig(budgets(device=SESSION_BYTES + 100), write_back=True, write_back_max_defer_s=600.0)
    keys = [session_key(A, n) for n in range(2)]
    add_rows(rig, *keys)
    with rig.tiers.lease(keys[1]):
        turn(rig.tiers, keys[0], make_cache(0))
        for _ in range(200):
            if rig.disk.path_for(keys[0]).exists():
                break
            time.sleep(0.05)
        assert rig.disk.path_for(keys[0]).exists()
