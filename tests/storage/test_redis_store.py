"""The Redis blob store on real servers: the machine's Redis (under a per-test key prefix), a private
redis-server that is flushed, killed or stopped, and a three-master Redis Cluster; rows in SQLite and
PostgreSQL."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from redis.crc import key_slot

from storage.blob_stores import BlobNotFound
from storage.metadata_store import MetadataStore
from storage.redis_store import LOCATION, RedisBlobStore, RedisUnavailable, connect_redis
from tests.redis_servers import RedisServer, free_port
from tests.storage.conftest import BASE, OTHER, S1, S2, Key

FP = "0123456789abcdef" + "f" * 48
TIMEOUT_S = 0.5
FAST_S = 4 * TIMEOUT_S + 1.0
"""Time a call to an unreachable Redis may take: one try and one retry of `TIMEOUT_S`, plus slack."""


def make_store(
    client: redis.Redis | redis.RedisCluster, metadata: MetadataStore, prefix: str, **options: float
) -> RedisBlobStore[Key]:
    return RedisBlobStore(client, metadata, FP, Key, prefix=prefix, **options)  # type: ignore[arg-type]


@pytest.fixture
def shared(redis_url: str) -> Iterator[redis.Redis | redis.RedisCluster]:
    client = connect_redis(redis_url, timeout_s=TIMEOUT_S)
    yield client
    client.close()


@pytest.fixture
def private(private_redis: RedisServer) -> Iterator[redis.Redis | redis.RedisCluster]:
    client = connect_redis(private_redis.url, timeout_s=TIMEOUT_S)
    yield client
    client.close()


def redis_rows(metadata: MetadataStore) -> dict[tuple[str, str], tuple[str, str, int, str]]:
    return {
        (r.tenant_id, r.name): (r.tier, r.path, r.nbytes, r.checksum) for r in metadata.list_blobs(location=LOCATION)
    }


def blob(n: int, seed: int = 1) -> bytes:
    return bytes((seed * 31 + i * 7) % 256 for i in range(n))


def test_round_trip_is_one_value_with_a_ttl_and_one_row(
    rows: MetadataStore, shared: redis.Redis, redis_prefix: str
) -> None:
    store = make_store(shared, rows, redis_prefix, ttl_s=600)
    data, base = blob(1000), blob(300, seed=2)
    store.put(S1, b"an older version")
    store.put(S1, data)
    store.put(BASE, base)

    assert store.get(S1) == data and store.get(BASE) == base
    key = f"{redis_prefix}:{FP[:16]}:tn_a:{{s_1}}"
    assert store.redis_key(S1) == key
    assert sorted(shared.scan_iter(match=f"{redis_prefix}:*")) == sorted(
        [key.encode(), f"{redis_prefix}:{FP[:16]}:tn_a:{{base-0123abcd}}".encode()]
    )
    assert 0 < shared.ttl(key) <= 600
    assert redis_rows(rows) == {
        ("tn_a", "s_1"): ("redis", key, 1000, hashlib.sha256(data).hexdigest()),
        ("tn_a", "base-0123abcd"): ("redis", store.redis_key(BASE), 300, hashlib.sha256(base).hexdigest()),
    }
    assert rows.list_blobs(location="") == []  # the disk tier's rows are another location
    assert store.contains(S1) and not store.contains(S2)
    assert (store.nbytes(S1), store.nbytes(S2)) == (1000, 0)
    assert store.keys() == [S1, BASE] and store.used_bytes() == 1300

    store.delete(S1)
    assert not shared.exists(key) and store.keys() == [BASE]
    with pytest.raises(BlobNotFound):
        store.get(S1)


def test_one_sessions_keys_share_a_cluster_slot(rows: MetadataStore) -> None:
    client = connect_redis("redis://127.0.0.1:1/0")  # never contacted: keys are computed locally
    store = make_store(client, rows, "chatkv")
    key = store.redis_key(S1)
    sibling = key.replace("{s_1}", "{s_1}:other")
    assert key.endswith(":tn_a:{s_1}")
    assert key_slot(key.encode()) == key_slot(sibling.encode()) == key_slot(b"s_1")
    assert key_slot(store.redis_key(S2).encode()) == key_slot(b"s_2") != key_slot(b"s_1")


def test_other_fingerprints_and_tenants_get_other_keys(rows: MetadataStore) -> None:
    client = connect_redis("redis://127.0.0.1:1/0")
    store = make_store(client, rows, "chatkv")
    other_model = RedisBlobStore(client, rows, "9" * 64, Key)
    assert store.redis_key(S1) != other_model.redis_key(S1)
    assert store.redis_key(S1) != store.redis_key(Key("tn_b", "s_1"))


@pytest.mark.parametrize("part", ["../x", "a:b", "a{b}", "", "a b"])
def test_unsafe_key_parts_are_refused_and_nothing_is_written(
    rows: MetadataStore, shared: redis.Redis, redis_prefix: str, part: str
) -> None:
    store = make_store(shared, rows, redis_prefix)
    for key in (Key(part, "s_1"), Key("tn_a", part)):
        with pytest.raises(ValueError, match="unsafe"):
            store.put(key, b"x")
    assert list(shared.scan_iter(match=f"{redis_prefix}:*")) == [] and redis_rows(rows) == {}
    with pytest.raises(ValueError, match="unsafe"):
        make_store(shared, rows, "bad:prefix")


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "127.0.0.1:6379", "", "postgresql://x/y"])
def test_a_url_that_is_not_redis_is_a_value_error(url: str) -> None:
    with pytest.raises(ValueError, match="not a Redis URL"):
        connect_redis(url)
    with pytest.raises(ValueError, match="not a Redis URL"):
        connect_redis(url, cluster=True)


def test_bad_store_options_are_value_errors(rows: MetadataStore) -> None:
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        connect_redis("redis://127.0.0.1:6379/0", timeout_s=0)
    client = connect_redis("redis://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="ttl_s must be positive"):
        make_store(client, rows, "chatkv", ttl_s=0)
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        make_store(client, rows, "chatkv", budget_bytes=-1)
    with pytest.raises(ValueError, match="retry_after_s must be positive"):
        make_store(client, rows, "chatkv", retry_after_s=0)


def test_budget_evicts_the_oldest_first(
    rows: MetadataStore, shared: redis.Redis, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store(shared, rows, redis_prefix, budget_bytes=250)
    store.put(S1, blob(100))
    store.put(S2, blob(100))
    store.put(BASE, blob(100))  # 300 > 250: S1, the oldest, goes
    assert store.keys() == [S2, BASE] and store.used_bytes() == 200
    assert not shared.exists(store.redis_key(S1))
    store.put(S2, blob(160))  # rewritten, now the newest: 260 > 250, and BASE is the oldest
    assert store.keys() == [S2] and not shared.exists(store.redis_key(BASE))

    with caplog.at_level(logging.WARNING, logger="storage.redis_store"):
        store.put(OTHER, blob(300))  # alone over the budget: everything goes, itself last
    assert store.keys() == [] and redis_rows(rows) == {}
    assert list(shared.scan_iter(match=f"{redis_prefix}:*")) == []
    assert "tn_b/s_3 (300 bytes) alone exceeds the redis budget of 250 bytes" in caplog.text


def test_budget_eviction_keeps_a_blob_written_again_since_it_read_the_rows(
    rows: MetadataStore, shared: redis.Redis, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another replica hands S1 over (publishes it again) while this one's budget pass, which read
    # the rows before, evicts S1 as the oldest: the new copy must stay.
    store = make_store(shared, rows, redis_prefix, budget_bytes=150)
    store.put(S1, blob(100, seed=1))
    read_before = store._rows()
    store.put(S1, blob(100, seed=2))
    current = store._rows
    monkeypatch.setattr(store, "_rows", lambda: [*read_before, *[r for r in current() if r.name != S1.name]])
    store.put(S2, blob(100))  # 200 > 150 by the rows it read: it tries to evict S1's old copy
    monkeypatch.undo()
    assert store.get(S1) == blob(100, seed=2)
    assert {name for _, name in redis_rows(rows)} == {"s_1", "s_2"}


def test_a_put_for_a_deleted_session_leaves_no_key_and_no_row(
    rows: MetadataStore, shared: redis.Redis, redis_prefix: str
) -> None:
    store = make_store(shared, rows, redis_prefix)
    rows.delete_session(tenant_id="tn_a", session_id="s_1")
    store.put(S1, blob(50))
    assert not shared.exists(store.redis_key(S1)) and redis_rows(rows) == {}
    assert not store.contains(S1) and store.keys() == []


def test_puts_of_one_key_at_once_leave_the_value_and_its_row(
    rows: MetadataStore, shared: redis.Redis, redis_prefix: str
) -> None:
    # A replica's write-back and its hand-over publish one session at the same instant; neither
    # may take the other's row for a deleted session and delete the value (a next owner rebuilt).
    store = make_store(shared, rows, redis_prefix)
    writers = 4
    for attempt in range(10):
        start = threading.Barrier(writers)

        def put(seed: int, start: threading.Barrier = start) -> None:
            start.wait()
            store.put(S1, blob(4096, seed))

        with ThreadPoolExecutor(writers) as pool:
            list(pool.map(put, range(writers)))
        assert store.get(S1) in [blob(4096, seed) for seed in range(writers)], f"attempt {attempt}"
        assert (S1.tenant_id, S1.name) in redis_rows(rows)


def test_a_value_redis_dropped_reads_as_absent_and_its_row_goes(
    rows: MetadataStore, private: redis.Redis, private_redis: RedisServer
) -> None:
    store = make_store(private, rows, "chatkv")
    for key in (S1, S2, OTHER):
        store.put(key, blob(64))
    private.pexpire(store.redis_key(S1), 1)
    time.sleep(0.05)
    assert store.keys() == [S1, S2, OTHER]  # the rows say so until the store notices
    with pytest.raises(BlobNotFound):
        store.get(S1)
    assert store.keys() == [S2, OTHER]

    private.flushall()  # a private server: the shared one is never flushed
    assert store.reconcile() == [] and redis_rows(rows) == {}
    with pytest.raises(BlobNotFound):
        store.get(S2)


def test_reconcile_keeps_rows_whose_values_are_there(rows: MetadataStore, private: redis.Redis) -> None:
    store = make_store(private, rows, "chatkv")
    for key in (S1, S2, OTHER):
        store.put(key, blob(64))
    private.delete(store.redis_key(S2))
    assert store.reconcile() == [S1, OTHER]
    assert set(redis_rows(rows)) == {("tn_a", "s_1"), ("tn_b", "s_3")}


def test_a_killed_redis_fails_fast_and_delete_still_drops_the_row(
    rows: MetadataStore, private: redis.Redis, private_redis: RedisServer
) -> None:
    store = make_store(private, rows, "chatkv")
    store.put(S1, blob(64))
    private_redis.stop()

    started = time.monotonic()
    with pytest.raises(RedisUnavailable):
        store.put(S2, blob(64))
    with pytest.raises(RedisUnavailable):
        store.get(S1)
    assert not store.contains(S1) and store.nbytes(S1) == 0
    assert set(redis_rows(rows)) == {("tn_a", "s_1")}  # the failed put recorded nothing
    store.delete(S1)
    store.delete_tenant("tn_a")
    assert time.monotonic() - started < 4 * FAST_S
    assert redis_rows(rows) == {} and store.keys() == []


def test_a_stalled_redis_times_out_and_a_value_deleted_meanwhile_is_never_served(
    rows: MetadataStore, private: redis.Redis, private_redis: RedisServer
) -> None:
    store = make_store(private, rows, "chatkv")
    store.put(S1, blob(64))
    with private_redis.hung():
        started = time.monotonic()
        with pytest.raises(RedisUnavailable):
            store.get(S1)
        assert time.monotonic() - started < FAST_S
        store.delete(S1)  # the DEL times out; the row goes
    assert private.exists(store.redis_key(S1))  # left to its TTL...
    with pytest.raises(BlobNotFound):
        store.get(S1)  # ...but without its row it is never served
    assert not redis_rows(rows)


def test_a_hung_redis_is_not_tried_again_until_retry_after_s(
    rows: MetadataStore, private: redis.Redis, private_redis: RedisServer
) -> None:
    store = make_store(private, rows, "chatkv", retry_after_s=3.0)
    store.put(S1, blob(64))
    with private_redis.hung():
        with pytest.raises(RedisUnavailable) as first:
            store.get(S1)  # this one waits for the timeout...
        failed_at = time.monotonic()
        assert "not tried" not in str(first.value)
        for call in (lambda: store.get(S1), lambda: store.put(S2, blob(64))):
            with pytest.raises(RedisUnavailable, match=r"not tried for 3 s after a failure"):
                call()  # ...these are refused at once by the open breaker
        assert not store.contains(S1) and store.nbytes(S1) == 0
    time.sleep(max(0.0, failed_at + 3.2 - time.monotonic()))
    assert store.get(S1) == blob(64)  # after retry_after_s one call tries Redis again, and it answers
    store.put(S2, blob(64))
    assert set(redis_rows(rows)) == {("tn_a", "s_1"), ("tn_a", "s_2")}


def test_after_retry_after_s_one_call_tries_a_hung_redis_and_the_others_fail_at_once(
    rows: MetadataStore, private: redis.Redis, private_redis: RedisServer
) -> None:
    store = make_store(private, rows, "chatkv", retry_after_s=1.0)
    store.put(S1, blob(64))
    outcomes: list[str] = []
    with private_redis.hung():
        with pytest.raises(RedisUnavailable):
            store.get(S1)  # opens the breaker
        time.sleep(1.1)
        barrier = threading.Barrier(6)

        def call() -> None:
            barrier.wait()
            try:
                store.get(S1)
                outcomes.append("answered")
            except RedisUnavailable as exc:
                outcomes.append("refused" if "not tried" in str(exc) else "tried")

        threads = [threading.Thread(target=call) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert sorted(outcomes) == ["refused"] * 5 + ["tried"]  # one trial waited on Redis, not six


def test_delete_tenant_removes_its_values_rows_and_strays(
    rows: MetadataStore, shared: redis.Redis, redis_prefix: str
) -> None:
    store = make_store(shared, rows, redis_prefix)
    for key in (S1, BASE, OTHER):
        store.put(key, blob(32))
    stray = store.redis_key(S2)
    shared.set(stray, b"written by a replica that died before its row")
    store.delete_tenant("tn_a")
    assert list(shared.scan_iter(match=f"{redis_prefix}:*")) == [store.redis_key(OTHER).encode()]
    assert set(redis_rows(rows)) == {("tn_b", "s_3")} and store.get(OTHER) == blob(32)


# -- Redis Cluster ---------------------------------------------------------------------------------


def test_cluster_round_trip_one_slot_per_session_and_delete_tenant(
    rows: MetadataStore, redis_cluster_url: str, redis_cluster_prefix: str
) -> None:
    client = connect_redis(redis_cluster_url, cluster=True, timeout_s=TIMEOUT_S)
    assert isinstance(client, redis.RedisCluster) and len(client.get_primaries()) == 3
    try:
        store = make_store(client, rows, redis_cluster_prefix, ttl_s=600)
        values = {key: blob(500, seed=i) for i, key in enumerate((S1, S2, BASE, OTHER))}
        for key, value in values.items():
            store.put(key, value)
        assert {key: store.get(key) for key in values} == values
        key = store.redis_key(S1)
        sibling = key.replace("{s_1}", "{s_1}:other")
        client.set(sibling, b"another key of the session")
        assert client.keyslot(key) == client.keyslot(sibling) == key_slot(b"s_1")
        assert client.get_node_from_key(key) == client.get_node_from_key(sibling)
        assert 0 < client.ttl(key) <= 600
        assert store.keys() == [S1, S2, BASE, OTHER]

        store.delete_tenant("tn_a")  # rows, values, and the stray sibling, across the nodes
        pattern = f"{redis_cluster_prefix}:*"
        assert list(client.scan_iter(match=pattern, target_nodes=redis.RedisCluster.PRIMARIES)) == [
            store.redis_key(OTHER).encode()
        ]
        assert store.keys() == [OTHER]
    finally:
        client.close()


def test_an_unreachable_cluster_is_redis_unavailable() -> None:
    started = time.monotonic()
    with pytest.raises(RedisUnavailable, match="does not answer"):
        connect_redis(f"redis://127.0.0.1:{free_port()}/0", cluster=True, timeout_s=TIMEOUT_S)
    assert time.monotonic() - started < FAST_S
