"""The shared Redis tier's chunked blobs through the manager: a session one replica published is
restored by another from its chunks; a chunk tampered with in Redis (swapped, reordered, replayed
from an older write, mixed in from another session, the last one dropped) or a Redis killed in the
middle of the restore costs a rebuild with the exact reply and an integrity failure counted, never
a failed turn (a forged manifest claiming four billion chunks too, at once); a blob sealed whole by
the version before chunking still restores."""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from cache.serialization import FORMAT_VERSION
from cache.tiers import CacheKey
from sessions.engine import Engine
from sessions.manager import SessionManager
from storage.chunked_blobs import ChunkedHeader, open_chunked, split_frame
from storage.keyring import blob_aad, seal
from storage.redis_store import READ_WINDOW, RedisBlobStore, chunk_key
from tests.redis_servers import RedisServer
from tests.sessions.offload_helpers import key_of, open_manager, reference_reply

SYSTEM = "You are terse."
MESSAGES = ["Hello there", "What is two plus two?", "Tell me more about it"]
NEXT = "And then what?"
TOKENS = 6
CHUNK_BYTES = 4096
"""Small chunks, so the tiny model's caches come in many."""


@dataclass
class Published:
    tenant: str
    session: str
    other: str
    older_chunks: list[bytes]
    """The chunks of an older write of `session` (after its first turn)."""


def shared_settings(tmp_path: Path, url: str, prefix: str) -> dict[str, object]:
    return {"database_url": f"sqlite:///{tmp_path / 'shared.db'}", "redis_url": url, "redis_prefix": prefix}


def redis_of(manager: SessionManager) -> RedisBlobStore[CacheKey]:
    assert manager.internals.shared_store is not None
    return manager.internals.shared_store.redis


def chunk_names(client: redis.Redis, store: RedisBlobStore[CacheKey], key: CacheKey) -> list[str]:
    manifest = store.redis_key(key)
    header = ChunkedHeader.parse(client.get(manifest) or b"")
    return [chunk_key(manifest, header.blob_id, i) for i in range(header.chunk_count)]


def publish(
    tmp_path: Path, engine: Engine, shared: dict[str, object], client: redis.Redis, chunk_bytes: int = CHUNK_BYTES
) -> Published:
    """Replica `a` holds two sessions and stops, which publishes them to Redis."""
    with open_manager(tmp_path / "a", engine, replica_id="a", **shared) as first:
        first.internals.sealer.chunk_bytes = chunk_bytes
        tenant = first.create_tenant("acme").id
        session, other = first.open_session(tenant, SYSTEM), first.open_session(tenant, SYSTEM)
        first.chat(tenant, session, MESSAGES[0], max_new_tokens=TOKENS)
        first.internals.tiers.flush()  # its write-back published the first turn's cache
        older = [client.get(name) or b"" for name in chunk_names(client, redis_of(first), key_of(tenant, session))]
        for message in MESSAGES[1:]:
            first.chat(tenant, session, message, max_new_tokens=TOKENS)
        for message in MESSAGES:
            first.chat(tenant, other, message, max_new_tokens=TOKENS)
    return Published(tenant, session, other, older)


def redis_failures(manager: SessionManager) -> float:
    value = manager.internals.metrics.registry.get_sample_value("chatkv_integrity_failures_total", {"tier": "redis"})
    return value or 0.0


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


def test_a_session_restores_from_its_chunks_on_another_replica(
    tmp_path: Path, tiny_engine: Engine, redis_url: str, redis_prefix: str, client: redis.Redis
) -> None:
    shared = shared_settings(tmp_path, redis_url, redis_prefix)
    published = publish(tmp_path, tiny_engine, shared, client)
    with open_manager(tmp_path / "b", tiny_engine, replica_id="b", **shared) as second:
        key = key_of(published.tenant, published.session)
        assert len(chunk_names(client, redis_of(second), key)) > 3
        expected = reference_reply(second, published.tenant, published.session, NEXT, TOKENS)
        reply = second.chat(published.tenant, published.session, NEXT, max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "redis" and reply.token_ids == expected
        assert redis_failures(second) == 0


TAMPERINGS = ["swap", "reorder", "replay", "mix", "truncate", "forge"]


def tamper(how: str, client: redis.Redis, store: RedisBlobStore[CacheKey], published: Published) -> None:
    key = key_of(published.tenant, published.session)
    names = chunk_names(client, store, key)
    values = [client.get(name) or b"" for name in names]
    if how == "swap":
        values[1], values[2] = values[2], values[1]
    elif how == "reorder":
        values = values[1:] + values[:1]
    elif how == "replay":
        values[1] = published.older_chunks[1]  # the same index of the session's older write
    elif how == "mix":
        values[1] = client.get(chunk_names(client, store, key_of(published.tenant, published.other))[1]) or b""
    elif how == "truncate":  # the manifest says one chunk fewer: the last one dropped
        header = ChunkedHeader.parse(client.get(store.redis_key(key)) or b"")
        fewer = header.chunk_count - 1
        client.set(
            store.redis_key(key), ChunkedHeader(header.blob_id, fewer, CHUNK_BYTES, fewer * CHUNK_BYTES).to_bytes()
        )
    elif how == "forge":  # a manifest claiming four billion one-byte chunks
        client.set(store.redis_key(key), ChunkedHeader(b"\1" * 16, 2**32 - 1, 1, 2**32 - 1).to_bytes(), keepttl=True)
    for name, value in zip(names, values, strict=True):
        client.set(name, value, keepttl=True)


@pytest.mark.parametrize("how", TAMPERINGS)
def test_a_chunk_tampered_with_in_redis_is_rejected_and_the_turn_rebuilds(
    tmp_path: Path,
    tiny_engine: Engine,
    redis_url: str,
    redis_prefix: str,
    client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    shared = shared_settings(tmp_path, redis_url, redis_prefix)
    published = publish(tmp_path, tiny_engine, shared, client)
    with open_manager(tmp_path / "b", tiny_engine, replica_id="b", **shared) as second:
        tamper(how, client, redis_of(second), published)
        expected = reference_reply(second, published.tenant, published.session, NEXT, TOKENS)
        with caplog.at_level(logging.WARNING):
            reply = second.chat(published.tenant, published.session, NEXT, max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "rebuilt" and reply.token_ids == expected
        assert redis_failures(second) == 1
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(published.session in m and "chunk" in m for m in warnings), warnings
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        later = second.chat(published.tenant, published.session, "Thanks.", max_new_tokens=TOKENS)
        assert later.stats.restored_from == "device"
        assert len(second.history(published.tenant, published.session)) == 2 * (len(MESSAGES) + 2)


def test_a_redis_killed_in_the_middle_of_a_restore_costs_a_rebuild(
    tmp_path: Path,
    tiny_engine: Engine,
    private_redis: RedisServer,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shared = shared_settings(tmp_path, private_redis.url, "ckv")
    client = private_redis.client()
    published = publish(tmp_path, tiny_engine, shared, client, chunk_bytes=512)
    client.close()
    with open_manager(tmp_path / "b", tiny_engine, replica_id="b", **shared) as second:
        store = redis_of(second)
        # More chunks than the reader asks for at once: reads are still to be sent when Redis dies.
        assert store.nbytes(key_of(published.tenant, published.session)) > 4 * READ_WINDOW * 512
        reads = store.read

        def read_then_kill(key: CacheKey) -> Generator[bytes, None, None]:
            pieces = reads(key)
            yield next(pieces)  # the manifest
            yield next(pieces)  # the first chunk; then Redis dies
            private_redis.stop()
            yield from pieces

        monkeypatch.setattr(store, "read", read_then_kill)
        expected = reference_reply(second, published.tenant, published.session, NEXT, TOKENS)
        with caplog.at_level(logging.WARNING):
            reply = second.chat(published.tenant, published.session, NEXT, max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "rebuilt" and reply.token_ids == expected
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        later = second.chat(published.tenant, published.session, "Thanks.", max_new_tokens=TOKENS)
        assert later.stats.restored_from == "device"
        texts = [m.text for m in second.history(published.tenant, published.session)]
        assert texts[-4:] == [NEXT, reply.text, "Thanks.", later.text]  # each turn stored once
        assert len(texts) == 2 * (len(MESSAGES) + 2)


def test_a_blob_sealed_whole_before_chunking_still_restores_from_redis(
    tmp_path: Path, tiny_engine: Engine, redis_url: str, redis_prefix: str, client: redis.Redis
) -> None:
    shared = shared_settings(tmp_path, redis_url, redis_prefix)
    published = publish(tmp_path, tiny_engine, shared, client)
    with open_manager(tmp_path / "b", tiny_engine, replica_id="b", **shared) as second:
        store, key = redis_of(second), key_of(published.tenant, published.session)
        data_key = second.internals.keys.data_key(published.tenant)
        aad = blob_aad(published.tenant, published.session, tiny_engine.fingerprint, FORMAT_VERSION)
        blob = store.get(key)
        payload = open_chunked(data_key, *split_frame(blob), [aad], max_payload_bytes=len(blob))
        store.put(key, seal(data_key, bytes(payload), aad))  # what the version before wrote
        assert [k for k in client.scan_iter(match=f"{store.redis_key(key)}:*")] == []  # no chunks: one value
        expected = reference_reply(second, published.tenant, published.session, NEXT, TOKENS)
        reply = second.chat(published.tenant, published.session, NEXT, max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "redis" and reply.token_ids == expected
