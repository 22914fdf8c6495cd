"""RESP bulk replies received into reused buffers (`storage.bulk_replies`), against a real socket
peer that sends exact bytes (well-formed, forged, truncated, silent) and against real Redis
servers (the store's chunk reads take this path, standalone and cluster)."""

from __future__ import annotations

import mmap
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from storage.bulk_replies import MAX_BULK_BYTES, BulkReader, ReplyBuffers
from storage.chunked_blobs import (
    HEADER_BYTES,
    MAPPED_PAYLOAD_BYTES,
    ChunkedHeader,
    open_chunked,
    payload_buffer,
    seal_chunked,
    split_frame,
)
from storage.metadata_store import MetadataStore
from storage.redis_store import RedisUnavailable, _bulk_reader, connect_redis
from tests.redis_servers import SilencingProxy
from tests.storage.conftest import S1, S2, Key
from tests.storage.test_redis_chunks import DATA_KEY, aad, chunk_keys, frame, make_store, opened


@pytest.fixture
def peer() -> Iterator[tuple[socket.socket, BulkReader]]:
    """A connected socket pair: the far end to send replies from, and a reader on the near end."""
    near, far = socket.socketpair()
    near.settimeout(2.0)
    reader = BulkReader(near, ReplyBuffers(max_pooled_bytes=1 << 20))
    yield far, reader
    reader.close()
    near.close()
    far.close()


def test_bulk_values_arrive_whole_and_in_order_in_one_reused_buffer(peer: tuple[socket.socket, BulkReader]) -> None:
    far, reader = peer
    big, small = bytes(range(256)) * 400, b"\r\n$3\r\nabc"  # a value may hold what looks like RESP
    far.sendall(b"$%d\r\n%s\r\n$%d\r\n%s\r\n$0\r\n\r\n$-1\r\n_\r\n" % (len(big), big, len(small), small))
    first = reader.read()
    assert first is not None and bytes(first) == big
    buffer = first.obj
    second = reader.read()
    assert second is not None and bytes(second) == small and second.obj is buffer
    with pytest.raises(ValueError):
        bytes(first)  # released when the next reply was read: a kept piece cannot show other bytes
    empty = reader.read()
    assert empty is not None and len(empty) == 0
    assert reader.read() is None  # RESP2's null bulk string
    assert reader.read() is None  # RESP3's null


def test_a_value_sent_a_byte_at_a_time_arrives_whole(peer: tuple[socket.socket, BulkReader]) -> None:
    far, reader = peer
    value = b"0123456789" * 30
    reply = b"$%d\r\n%s\r\n$1\r\nz\r\n" % (len(value), value)
    # A stream socket's reads can end anywhere: every byte is sent on its own, while the reader reads.
    sender = threading.Thread(target=lambda: [far.send(reply[i : i + 1]) for i in range(len(reply))])
    sender.start()
    got = reader.read()
    assert got is not None and bytes(got) == value
    last = reader.read()
    assert last is not None and bytes(last) == b"z"
    sender.join()


def test_an_error_reply_is_a_response_error_with_its_message(peer: tuple[socket.socket, BulkReader]) -> None:
    far, reader = peer
    far.sendall(b"-MOVED 3999 127.0.0.1:6381\r\n")
    with pytest.raises(ResponseError, match=r"MOVED 3999 127\.0\.0\.1:6381"):
        reader.read()


@pytest.mark.parametrize(
    "reply",
    [b"+OK\r\n", b":12\r\n", b"*2\r\n", b"$-2\r\n", b"$abc\r\n", b"$3\r\nabcXY", b"$%d\r\n" % (MAX_BULK_BYTES + 1)],
    ids=["status", "integer", "array", "negative length", "no length", "no CRLF after the value", "too long"],
)
def test_a_reply_that_is_not_a_bulk_string_is_an_invalid_response(
    peer: tuple[socket.socket, BulkReader], reply: bytes
) -> None:
    far, reader = peer
    far.sendall(reply)
    with pytest.raises(InvalidResponse):
        reader.read()


def test_a_line_without_an_end_is_an_invalid_response_not_a_growing_buffer(
    peer: tuple[socket.socket, BulkReader],
) -> None:
    far, reader = peer
    far.sendall(b"-" + b"x" * (70 * 1024))
    with pytest.raises(InvalidResponse, match="longer than"):
        reader.read()


@pytest.mark.parametrize("sent", [b"", b"$10", b"$10\r\nabc", b"$3\r\nabc"], ids=["nothing", "header", "value", "crlf"])
def test_a_connection_closed_in_the_middle_of_a_reply_is_a_connection_error(
    peer: tuple[socket.socket, BulkReader], sent: bytes
) -> None:
    far, reader = peer
    far.sendall(sent)
    far.shutdown(socket.SHUT_WR)
    with pytest.raises(RedisConnectionError, match="closed"):
        reader.read()


def test_a_silent_server_is_a_timeout_error() -> None:
    near, far = socket.socketpair()
    try:
        near.settimeout(0.2)
        far.sendall(b"$10\r\nabc")
        with pytest.raises(RedisTimeoutError):
            BulkReader(near, ReplyBuffers(1024)).read()
    finally:
        near.close()
        far.close()


def test_reply_buffers_are_kept_between_readers_up_to_their_limits() -> None:
    buffers = ReplyBuffers(max_pooled_bytes=100, spare=1)
    first = buffers.take(80)
    buffers.give(first)
    assert buffers.take(50) is first  # a kept buffer long enough is reused
    assert len(buffers.take(90)) == 90  # none kept now: a new one
    buffers.give(bytearray(101))  # longer than the largest kept: dropped
    buffers.give(first)
    buffers.give(bytearray(100))  # one spare only: dropped
    assert buffers.take(1) is first and len(buffers.take(1)) == 1


def test_redis_pooled_connections_expose_the_socket_the_reader_needs(redis_url: str, redis_cluster_url: str) -> None:
    """Guards the private attribute the store reads chunks through (`redis_store._bulk_reader`):
    if redis-py renames it, chunks are read through redis-py again, correct but slower, and
    this test says so."""
    standalone = connect_redis(redis_url)
    cluster = connect_redis(redis_cluster_url, cluster=True)
    assert isinstance(cluster, redis.RedisCluster)
    node = cluster.get_node_from_key("{s_1}")
    assert node.redis_connection is not None
    try:
        for pool in (standalone.connection_pool, node.redis_connection.connection_pool):
            connection = pool.get_connection()
            try:
                assert _bulk_reader(connection, ReplyBuffers(1024)) is not None
            finally:
                pool.release(connection)
    finally:
        standalone.close()
        cluster.close()


def test_the_store_hands_chunks_as_views_valid_until_the_next(
    rows: MetadataStore, redis_url: str, redis_prefix: str
) -> None:
    client = connect_redis(redis_url)
    try:
        store = make_store(client, rows, redis_prefix)
        payload, blob = frame(S1)
        store.put(S1, blob)
        pieces = store.read(S1)
        next(pieces)  # the manifest
        first = next(pieces)
        assert isinstance(first, memoryview)
        next(pieces)
        with pytest.raises(ValueError):
            bytes(first)
        pieces.close()
        assert store.get(S1) == blob and opened(store, S1) == payload  # get copies every piece
    finally:
        client.close()


def test_chunks_are_read_from_the_socket_a_health_check_reconnected_to(
    rows: MetadataStore, redis_url: str, redis_prefix: str
) -> None:
    """A client made with `health_check_interval` PINGs a pooled connection idle that long before
    its next command, and reconnects if the PING goes unanswered: the chunk reader must read
    from the new socket, not the dead one the pool handed out (it took that one before the first
    send, and the read failed as if Redis were down)."""
    target = urlparse(redis_url)
    with SilencingProxy(target.hostname or "127.0.0.1", target.port or 6379) as proxy:
        client = redis.Redis.from_url(
            proxy.url,
            socket_timeout=0.3,
            socket_connect_timeout=0.3,
            retry=Retry(NoBackoff(), 1),
            health_check_interval=0.05,
        )
        try:
            store = make_store(client, rows, redis_prefix)
            payload, blob = frame(S1)
            store.put(S1, blob)
            pieces = store.read(S1)
            next(pieces)  # the manifest: read on the one pooled connection, which the chunks reuse
            assert proxy.silence() == 1  # that connection is now dead without a word
            time.sleep(0.1)  # past the health check interval: the first chunk GET's send PINGs
            head = ChunkedHeader.parse(blob)
            chunks = [bytes(piece) for piece in pieces]
            assert len(chunks) == head.chunk_count
            opened_payload = open_chunked(DATA_KEY, blob[:HEADER_BYTES], chunks, [aad(S1)], max_payload_bytes=len(blob))
            assert opened_payload == payload
        finally:
            client.close()


def test_a_chunk_key_holding_another_type_fails_the_read_as_redis_does(
    rows: MetadataStore, redis_url: str, redis_prefix: str
) -> None:
    client = connect_redis(redis_url)
    try:
        store = make_store(client, rows, redis_prefix)
        _, blob = frame(S1)
        store.put(S1, blob)
        name = chunk_keys(store, S1, blob)[3]
        client.delete(name)
        client.rpush(name, b"x")  # WRONGTYPE for its GET
        with pytest.raises(RedisUnavailable, match="WRONGTYPE"):
            store.get(S1)
    finally:
        client.close()


def test_a_large_payload_buffer_is_zeroed_private_memory_that_its_tensor_views_keep_alive() -> None:
    small = payload_buffer(MAPPED_PAYLOAD_BYTES - 1)
    assert isinstance(small, bytearray) and not any(small)
    large = payload_buffer(MAPPED_PAYLOAD_BYTES + 5)
    assert isinstance(large, mmap.mmap) and len(large) == MAPPED_PAYLOAD_BYTES + 5
    assert large[:8] == bytes(8) and large[-8:] == bytes(8)
    view = torch.frombuffer(large, dtype=torch.uint8)
    view[-1] = 7
    del large  # the tensor holds the mapping
    assert int(view[-1]) == 7 and int(view.sum()) == 7


@pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD"), reason="per-thread fault counts are Linux's")
def test_a_large_payload_buffer_has_its_pages_in_place_before_the_payload_is_written() -> None:
    """The decryption writing every page of a fresh mapping took one page fault per 4 KiB page;
    populated when mapped (`MAP_POPULATE`), writing it faults none (this thread's own count)."""
    nbytes = MAPPED_PAYLOAD_BYTES * 2
    half = bytes(range(256)) * (nbytes // 512)  # made (and faulted in) before counting
    large = payload_buffer(nbytes)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    large[: nbytes // 2] = half
    large[nbytes // 2 :] = half
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert faults < 0.25 * nbytes / mmap.PAGESIZE, f"{faults} faults writing {nbytes // mmap.PAGESIZE} pages"


def test_a_chunked_payload_over_the_mapping_size_opens_into_its_buffer() -> None:
    payload = bytes(range(256)) * (MAPPED_PAYLOAD_BYTES // 256 + 3)
    sealed = seal_chunked(bytes(range(32)), payload, aad(S1), chunk_bytes=1 << 20)
    opened_payload = open_chunked(bytes(range(32)), *split_frame(sealed), [aad(S1)], max_payload_bytes=len(sealed))
    assert bytes(opened_payload) == payload


def test_a_payload_opened_from_redis_never_shares_the_buffer_the_next_reads_reuse(
    rows: MetadataStore, redis_url: str, redis_prefix: str
) -> None:
    """A restored cache's tensors view its payload (`codec.decode`); the chunks were received into
    the store's reused buffers, so the payload must be memory of its own: reading other blobs
    afterwards (into the same buffers) leaves it as it was."""
    client = connect_redis(redis_url)
    try:
        store = make_store(client, rows, redis_prefix)
        size = MAPPED_PAYLOAD_BYTES + 12345
        payloads = {key: os.urandom(size) for key in (S1, S2)}
        for key, payload in payloads.items():
            store.put(key, seal_chunked(DATA_KEY, payload, aad(key), chunk_bytes=1 << 20))

        def restored(key: Key) -> bytearray | mmap.mmap:
            pieces = store.read(key)
            return open_chunked(DATA_KEY, next(pieces), pieces, [aad(key)], max_payload_bytes=2 * size)

        first = restored(S1)
        tensor = torch.frombuffer(first, dtype=torch.uint8)  # as the codec views a payload
        for _ in range(2):
            assert bytes(restored(S2)) == payloads[S2]
        assert bytes(first) == payloads[S1] and tensor.numpy().tobytes() == payloads[S1]
    finally:
        client.close()
