"""Chunked blobs in the Redis store, on real servers: one value per chunk under the session's hash
tag, read piece by piece; every chunk tampered with in Redis (swapped, reordered, dropped, replayed
from an older write, mixed in from another session) fails to open; budget, TTL, rewrites and
deletions leave no chunk behind (keys counted); a Redis Cluster keeps a blob on one node; a Redis
killed in the middle of a read fails that read, never hangs or half-answers."""

from __future__ import annotations

import hashlib
import os
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from redis.crc import key_slot

from storage.blob_stores import BlobNotFound
from storage.chunked_blobs import HEADER_BYTES, ChunkedHeader, open_chunked, seal_chunked
from storage.keyring import AuthenticationFailed, blob_aad
from storage.metadata_store import MetadataStore
from storage.redis_store import LOCATION, READ_WINDOW, RedisBlobStore, RedisUnavailable, chunk_key, connect_redis
from tests.redis_servers import RedisServer
from tests.storage.conftest import OTHER, S1, S2, Key

FP = "0123456789abcdef" + "f" * 48
DATA_KEY = bytes(range(32))
CHUNK = 1000
MAX_PAYLOAD = 100 * CHUNK
TIMEOUT_S = 0.5


def make_store(
    client: redis.Redis | redis.RedisCluster, metadata: MetadataStore, prefix: str, **options: float
) -> RedisBlobStore[Key]:
    return RedisBlobStore(client, metadata, FP, Key, prefix=prefix, **options)  # type: ignore[arg-type]


def aad(key: Key) -> bytes:
    return blob_aad(key.tenant_id, key.name, FP, 2)


def frame(key: Key, size: int = 12 * CHUNK + 345) -> tuple[bytes, bytes]:
    """A payload of `size` bytes and its frame sealed for `key` in chunks of `CHUNK`."""
    payload = os.urandom(size)
    return payload, seal_chunked(DATA_KEY, payload, aad(key), chunk_bytes=CHUNK)


def opened(store: RedisBlobStore[Key], key: Key) -> bytes:
    """The payload, opened piece by piece from `store.read` as a restore does."""
    pieces = store.read(key)
    head = next(pieces)
    return bytes(open_chunked(DATA_KEY, head, pieces, [aad(key)], max_payload_bytes=MAX_PAYLOAD))


def keys_of(client: redis.Redis | redis.RedisCluster, prefix: str) -> list[str]:
    if isinstance(client, redis.RedisCluster):
        found = client.scan_iter(match=f"{prefix}:*", target_nodes=redis.RedisCluster.PRIMARIES)
    else:
        found = client.scan_iter(match=f"{prefix}:*")
    return sorted(k.decode() for k in found)


def chunk_keys(store: RedisBlobStore[Key], key: Key, blob: bytes) -> list[str]:
    header = ChunkedHeader.parse(blob)
    return [chunk_key(store.redis_key(key), header.blob_id, i) for i in range(header.chunk_count)]


@pytest.fixture
def shared(redis_url: str) -> Iterator[redis.Redis | redis.RedisCluster]:
    client = connect_redis(redis_url, timeout_s=TIMEOUT_S)
    yield client
    client.close()


def test_a_chunked_blob_is_a_manifest_and_one_value_per_chunk_each_with_the_ttl(
    rows: MetadataStore, shared: redis.Redis, redis_prefix: str
) -> None:
    store = make_store(shared, rows, redis_prefix, ttl_s=600)
    payload, blob = frame(S1)
    store.put(S1, blob)
    manifest, chunks = store.redis_key(S1), chunk_keys(store, S1, blob)
    assert len(chunks) == 13 > READ_WINDOW  # more chunks than the reader keeps in flight
    assert keys_of(shared, redis_prefix) == sorted([manifest, *chunks])
    assert {key_slot(k.encode()) for k in [manifest, *chunks]} == {key_slot(b"s_1")}
    assert all(0 < shared.ttl(k) <= 600 for k in [manifest, *chunks])
    assert shared.strlen(manifest) == HEADER_BYTES == 53
    row = rows.get_blob(tenant_id="tn_a", name="s_1", location=LOCATION)
    # The manifest's digest: it names this write's chunks alone (no pass over the whole blob).
    assert row is not None and (row.nbytes, row.checksum) == (
        len(blob),
        hashlib.sha256(blob[:HEADER_BYTES]).hexdigest(),
    )
    assert store.nbytes(S1) == len(blob) and store.used_bytes() == len(blob)
    assert store.get(S1) == blob
    assert opened(store, S1) == payload


def test_a_rewrite_deletes_the_chunks_of_the_blob_it_replaced(
    rows: MetadataStore, shared: redis.Redis, redis_prefix: str
) -> None:
    store = make_store(shared, rows, redis_prefix)
    _, first = frame(S1)
    store.put(S1, first)
    payload, second = frame(S1, size=3 * CHUNK)
    store.put(S1, second)
    store.put(S1, second)  # the same blob again (a disk blob published twice): its chunks stay
    assert keys_of(shared, redis_prefix) == sorted([store.redis_key(S1), *chunk_keys(store, S1, second)])
    assert opened(store, S1) == payload
    store.put(S1, b"a whole value, as blobs sealed before chunking are")
    assert keys_of(shared, redis_prefix) == [store.redis_key(S1)]
    assert store.get(S1) == b"a whole value, as blobs sealed before chunking are"
    with pytest.raises(ValueError, match="malformed chunked blob"):
        store.put(S1, second[:-1])


def test_two_replicas_writing_one_session_while_it_is_read_leave_one_whole_blob_and_its_row(
    rows: MetadataStore, redis_url: str, redis_prefix: str
) -> None:
    """Rows are keyed by the manifest's digest: two seals of the same payload differ (a random
    blob id), so a reader that finds a chunk gone deletes the row only if it still records the
    write it read, never the other replica's newer one. Two replicas (a store and a client
    each) write the session over and over while a third reads it: whatever interleaving, once
    they stop the row is there, Redis holds one blob and its chunks alone, and it opens."""
    clients = [connect_redis(redis_url, timeout_s=5.0) for _ in range(3)]
    try:
        stores = [make_store(client, rows, redis_prefix) for client in clients]
        payloads = [os.urandom(6 * CHUNK + 7), os.urandom(9 * CHUNK + 11)]  # one per writer

        def write(store: RedisBlobStore[Key], payload: bytes) -> None:
            for _ in range(40):
                store.put(S1, seal_chunked(DATA_KEY, payload, aad(S1), chunk_bytes=CHUNK))

        reads = Counter[str]()
        with ThreadPoolExecutor(2) as pool:
            writers = [pool.submit(write, stores[i], payloads[i]) for i in range(2)]
            while not all(writer.done() for writer in writers):
                try:
                    reads["whole" if opened(stores[2], S1) in payloads else "wrong"] += 1
                except BlobNotFound:
                    reads["missing"] += 1  # a chunk deleted by the next write during the read
            for writer in writers:
                writer.result()  # a writer's error, raised here
        assert reads["wrong"] == 0, reads
        row = rows.get_blob(tenant_id="tn_a", name="s_1", location=LOCATION)
        assert row is not None
        assert opened(stores[2], S1) in payloads
        manifest = clients[2].get(stores[2].redis_key(S1))
        assert isinstance(manifest, bytes)
        held = sorted([stores[2].redis_key(S1), *chunk_keys(stores[2], S1, manifest)])
        assert keys_of(clients[2], redis_prefix) == held
        # A reader holding the row of one seal (as `read` does before it finds a chunk gone) must
        # not delete the row of another replica's later seal of the very same payload.
        stores[0].put(S1, seal_chunked(DATA_KEY, payloads[0], aad(S1), chunk_bytes=CHUNK))
        read_row = rows.get_blob(tenant_id="tn_a", name="s_1", location=LOCATION)
        stores[1].put(S1, seal_chunked(DATA_KEY, payloads[0], aad(S1), chunk_bytes=CHUNK))
        assert read_row is not None
        assert not rows.delete_blob(tenant_id="tn_a", name="s_1", location=LOCATION, checksum=read_row.checksum)
        assert opened(stores[2], S1) == payloads[0]
    finally:
        for client in clients:
            client.close()


def reject(store: RedisBlobStore[Key], key: Key) -> None:
    with pytest.raises(AuthenticationFailed):
        opened(store, key)


def test_chunks_swapped_reordered_or_replayed_from_an_older_write_in_redis_are_rejected(
    rows: MetadataStore, shared: redis.Redis, redis_prefix: str
) -> None:
    store = make_store(shared, rows, redis_prefix)
    _, old = frame(S1)
    store.put(S1, old)
    old_values = [shared.get(k) for k in chunk_keys(store, S1, old)]
    _, blob = frame(S1)
    store.put(S1, blob)
    names = chunk_keys(store, S1, blob)
    values = [shared.get(k) for k in names]

    def write(order: list[bytes | None]) -> None:
        for name, value in zip(names, order, strict=True):
            shared.set(name, value or b"")

    write([values[0], values[2], values[1], *values[3:]])  # two chunks swapped
    reject(store, S1)
    write(values[1:] + values[:1])  # all of them moved one place
    reject(store, S1)
    write([*values[:5], old_values[5], *values[6:]])  # a chunk of the session's older write
    reject(store, S1)
    write(values)
    assert store.get(S1) == blob  # put back in place, it opens again


def test_a_truncated_blob_or_a_chunk_of_another_session_is_rejected(
    rows: MetadataStore, shared: redis.Redis, redis_prefix: str
) -> None:
    store = make_store(shared, rows, redis_prefix)
    _, blob = frame(S1)
    _, other = frame(S2)
    store.put(S1, blob)
    store.put(S2, other)
    names, others = chunk_keys(store, S1, blob), chunk_keys(store, S2, other)
    shared.set(names[4], shared.get(others[4]) or b"")  # mixed in from another session
    reject(store, S1)
    store.put(S1, blob)
    # A manifest that claims one chunk fewer (the last chunk dropped): every chunk's sizes disagree.
    header = ChunkedHeader.parse(blob)
    shorter = ChunkedHeader(header.blob_id, header.chunk_count - 1, CHUNK, (header.chunk_count - 1) * CHUNK)
    shared.set(store.redis_key(S1), shorter.to_bytes())
    reject(store, S1)
    shared.set(store.redis_key(S1), blob[:HEADER_BYTES])
    shared.delete(names[-1])  # the last chunk gone from Redis: the blob is missing, its row dropped
    with pytest.raises(BlobNotFound):
        store.get(S1)
    assert rows.get_blob(tenant_id="tn_a", name="s_1", location=LOCATION) is None


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Calls of each command since the last `CONFIG RESETSTAT` (`INFO commandstats`)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(entry["calls"]) for name, entry in stats.items()}


def test_a_forged_manifest_claiming_four_million_chunks_is_rejected_without_reading_or_making_a_chunk_key(
    rows: MetadataStore, private_redis: RedisServer
) -> None:
    client = private_redis.client()
    try:
        store = make_store(client, rows, "chatkv")
        store.put(S1, frame(S1)[1])
        forged = ChunkedHeader(os.urandom(16), 4_000_000, 1, 4_000_000)  # header-valid, tag of zeros
        client.set(store.redis_key(S1), forged.to_bytes())
        client.config_resetstat()
        tracemalloc.start()
        try:
            pieces = store.read(S1)
            with pytest.raises(AuthenticationFailed, match="header of a chunked blob of 4000000 chunks"):
                # A bound as large as a real model's: the header's tag is what rejects it.
                open_chunked(DATA_KEY, next(pieces), pieces, [aad(S1)], max_payload_bytes=1 << 30)
            pieces.close()
            peak_bytes = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert command_calls(client)["get"] == 1  # the manifest; not one chunk
        assert peak_bytes < 1 << 20  # four million chunk keys would be hundreds of MB

        # Deleting what a forged manifest names costs one batch of DELs, not four million keys.
        client.config_resetstat()
        store.delete(S1)
        assert command_calls(client)["del"] == 1
        assert client.get(store.redis_key(S1)) is None
    finally:
        client.close()


def test_a_rewrite_over_a_forged_manifest_deletes_one_batch_and_keeps_the_new_blob(
    rows: MetadataStore, private_redis: RedisServer
) -> None:
    client = private_redis.client()
    try:
        store = make_store(client, rows, "chatkv")
        client.set(store.redis_key(S1), ChunkedHeader(os.urandom(16), 4_000_000, 1, 4_000_000).to_bytes())
        payload, blob = frame(S1)
        client.config_resetstat()
        store.put(S1, blob)
        assert command_calls(client)["del"] == 1
        assert keys_of(client, "chatkv") == sorted([store.redis_key(S1), *chunk_keys(store, S1, blob)])
        assert opened(store, S1) == payload
    finally:
        client.close()


def test_budget_ttl_and_deletions_leave_no_chunk(rows: MetadataStore, shared: redis.Redis, redis_prefix: str) -> None:
    sizes = {S1: 3 * CHUNK, S2: 4 * CHUNK, OTHER: 2 * CHUNK}
    blobs = {key: frame(key, size)[1] for key, size in sizes.items()}
    store = make_store(shared, rows, redis_prefix, budget_bytes=len(blobs[S2]) + len(blobs[OTHER]))
    for key, blob in blobs.items():
        store.put(key, blob)  # OTHER's put takes S1, the oldest, over the budget
    assert store.keys() == [S2, OTHER] and store.used_bytes() == len(blobs[S2]) + len(blobs[OTHER])
    expected = [store.redis_key(S2), *chunk_keys(store, S2, blobs[S2])]
    expected += [store.redis_key(OTHER), *chunk_keys(store, OTHER, blobs[OTHER])]
    assert keys_of(shared, redis_prefix) == sorted(expected)  # 2 manifests + 4 + 2 chunks

    store.delete(S2)
    assert keys_of(shared, redis_prefix) == sorted(expected[5:])
    store.put(S1, blobs[S1])
    store.delete_tenant("tn_a")
    assert keys_of(shared, redis_prefix) == sorted(expected[5:])
    rows.delete_session(tenant_id="tn_b", session_id="s_3")
    store.put(OTHER, frame(OTHER)[1])  # its session is gone: neither manifest nor chunks stay
    assert store.keys() == []
    store.delete_tenant("tn_b")
    assert keys_of(shared, redis_prefix) == []

    short = make_store(shared, rows, redis_prefix, ttl_s=1)
    blob = frame(S1, 3 * CHUNK)[1]
    short.put(S1, blob)
    assert all(0 < shared.pttl(k) <= 1000 for k in [short.redis_key(S1), *chunk_keys(short, S1, blob)])
    time.sleep(1.2)
    assert keys_of(shared, redis_prefix) == []


def test_a_redis_killed_in_the_middle_of_a_read_fails_that_read(
    rows: MetadataStore, private_redis: RedisServer
) -> None:
    client = connect_redis(private_redis.url, timeout_s=TIMEOUT_S)
    try:
        store = make_store(client, rows, "chatkv")
        payload, blob = frame(S1, 40 * CHUNK)
        store.put(S1, blob)
        assert opened(store, S1) == payload
        pieces = store.read(S1)
        taken = [next(pieces), next(pieces)]  # the header and the first chunk
        assert len(taken[1]) == CHUNK + 16
        private_redis.stop()
        started = time.monotonic()
        with pytest.raises(RedisUnavailable):
            list(pieces)
        assert time.monotonic() - started < 4 * TIMEOUT_S + 1
        with pytest.raises(RedisUnavailable):
            store.get(S1)  # the breaker: refused at once
        assert rows.get_blob(tenant_id="tn_a", name="s_1", location=LOCATION) is not None  # kept: Redis may be back
    finally:
        client.close()


def test_a_read_abandoned_half_way_leaves_the_client_usable(
    rows: MetadataStore, shared: redis.Redis, redis_prefix: str
) -> None:
    store = make_store(shared, rows, redis_prefix)
    payload, blob = frame(S1, 30 * CHUNK)
    store.put(S1, blob)
    for _ in range(3):
        pieces = store.read(S1)
        next(pieces), next(pieces), next(pieces)
        pieces.close()  # replies still in flight: the connection is closed, not reused
        assert shared.get(store.redis_key(S1)) == blob[:HEADER_BYTES]
    assert opened(store, S1) == payload


def test_cluster_round_trip_of_a_chunked_blob_on_one_node(
    rows: MetadataStore, redis_cluster_url: str, redis_cluster_prefix: str
) -> None:
    client = connect_redis(redis_cluster_url, cluster=True, timeout_s=TIMEOUT_S)
    assert isinstance(client, redis.RedisCluster)
    try:
        store = make_store(client, rows, redis_cluster_prefix, ttl_s=600)
        blobs = {key: frame(key) for key in (S1, S2, OTHER)}
        for key, (_, blob) in blobs.items():
            store.put(key, blob)
        for key, (payload, blob) in blobs.items():
            assert opened(store, key) == payload and store.get(key) == blob and store.nbytes(key) == len(blob)
            names = [store.redis_key(key), *chunk_keys(store, key, blob)]
            assert len({client.get_node_from_key(k).name for k in names}) == 1
        _, newer = frame(S1)
        store.put(S1, newer)  # the old chunks go, on their node
        store.delete_tenant("tn_a")
        expected = [store.redis_key(OTHER), *chunk_keys(store, OTHER, blobs[OTHER][1])]
        assert keys_of(client, redis_cluster_prefix) == sorted(expected)
        store.delete(OTHER)
        assert keys_of(client, redis_cluster_prefix) == []
    finally:
        client.close()


def test_chunks_are_read_from_a_cluster_node_the_client_has_no_connection_to_yet(
    rows: MetadataStore, redis_cluster_url: str, redis_cluster_prefix: str
) -> None:
    """A MOVED reply to another thread's command names a node the client did not know (a slot
    resharded to a new node): redis-py adds it without a connection, made when a command is
    first routed there. A restore that had read its manifest before reads its chunks from that
    node (the state is set as redis-py leaves it: a node whose `redis_connection` is `None`)."""
    client = connect_redis(redis_cluster_url, cluster=True, timeout_s=TIMEOUT_S)
    assert isinstance(client, redis.RedisCluster)
    try:
        store = make_store(client, rows, redis_cluster_prefix)
        payload, blob = frame(S1)
        store.put(S1, blob)
        pieces = store.read(S1)
        head = next(pieces)  # the manifest, read through the client
        node = client.get_node_from_key(store.redis_key(S1))
        assert node.redis_connection is not None
        node.redis_connection.close()
        node.redis_connection = None
        opened_payload = open_chunked(DATA_KEY, head, pieces, [aad(S1)], max_payload_bytes=MAX_PAYLOAD)
        assert bytes(opened_payload) == payload
    finally:
        client.close()
