"""The Redis blob store: the shared KV tier that replicas load sealed caches from (DESIGN.md, "Scale-out").

A chunked blob (`storage.chunked_blobs`: a header and independently sealed chunks of about 2 MiB)
is stored as one Redis string per chunk plus its header as the blob's **manifest**:

    <prefix>:<fingerprint[:16]>:<tenant id>:{<name>}                      the manifest (header, 53 bytes)
    <prefix>:<fingerprint[:16]>:<tenant id>:{<name>}:<blob id hex>:<i>    chunk i

namespaced by model and tenant, with the session (or base layer) name as the Redis Cluster hash
tag, so all of one session's keys live in one slot (pipelines stay legal in a cluster). A write
is one pipeline: every chunk (`SET … EX`), then the manifest (`SET … EX … GET`); Redis runs one
connection's commands in order, so a reader that sees the new manifest finds its chunks, and
the old manifest that GET returns names the previous write's chunks, deleted next (every write
draws a new blob id, so it never overwrites chunks a reader may be reading). A read GETs the
manifest, then its chunks over one connection with `READ_WINDOW` GETs in flight, handing each
chunk to the caller as it arrives (`read`), so the chunk before is decrypted while Redis sends
the next; each chunk is received from the socket straight into a buffer the store keeps between
reads (`storage.bulk_replies`: no new memory per chunk, which cost as much as the transfer). A
missing chunk reads as a missing blob. The store holds no data key, so it never trusts a
manifest's chunk count: chunk keys are made one at a time as they are read or deleted, a reader
authenticates the header before it asks for the first chunk (`storage.chunked_blobs.open_header`),
and a deletion stops at a batch of keys of which none exists. A forged manifest claiming billions
of chunks costs nothing more. Any other value (a whole blob sealed before chunking, or bytes of a
test) is one string under the manifest's key, as before. `SET … GET` and `GETDEL` need Redis 6.2 or later.

The `cache_blobs` rows at location `"redis"` say what is where (rows written by every replica
sharing the database; `nbytes` counts every chunk); a TTL on every key, and an optional byte
budget over those rows, keep the tier bounded. Redis may drop a value or a chunk behind the store
(TTL, `maxmemory` eviction, a flush): `get` then raises `BlobNotFound` and removes the stale row,
and the caller rebuilds the cache.

A Redis that cannot be reached raises `RedisUnavailable` from `put` and `get`; `delete` still
drops the row, `contains` answers `False`. The first failed call costs up to the client timeout
(a Redis that accepts connections but never answers); then a circuit breaker (`CircuitBreaker`)
fails every call at once for `retry_after_s`, after which one call tries Redis again while the
others keep failing at once. So a hung Redis costs one timeout per `retry_after_s`, not one per
call, and never stalls every turn.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Generator, Iterator, Set
from contextlib import closing, contextmanager
from itertools import islice
from typing import Generic, cast

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry

from storage.blob_stores import BlobNotFound, K, _check_name
from storage.bulk_replies import BulkReader, ReplyBuffers
from storage.chunked_blobs import HEADER_BYTES, MAX_CHUNK_BYTES, TAG_BYTES, ChunkedHeader, is_chunked, split_frame
from storage.errors import StorageError
from storage.keyring import AuthenticationFailed
from storage.metadata_store import BlobRecord, MetadataStore

log = logging.getLogger(__name__)

LOCATION = "redis"
"""`cache_blobs.location` of the rows of this tier."""

RedisClient = redis.Redis | RedisCluster
_DELETE_BATCH = 256
READ_WINDOW = 8
"""Chunk GETs in flight on the reading connection: enough that Redis always has the next chunks to
send while the caller opens one, few enough that Redis queues at most this many chunks for the
reader (not the whole blob, as one GET of a 90 MB value does)."""


def chunk_key(manifest_key: str, blob_id: bytes, index: int) -> str:
    """Key of chunk `index` of blob `blob_id` stored under `manifest_key` (the same hash tag)."""
    return f"{manifest_key}:{blob_id.hex()}:{index}"


def _manifest_header(manifest: bytes | None) -> ChunkedHeader | None:
    """The header a manifest holds; `None` for an absent value, a whole blob, or a header this
    store did not write (a frame version before header tags, or sizes no frame has)."""
    if manifest is None or not is_chunked(manifest):
        return None
    try:
        return ChunkedHeader.parse(manifest)
    except AuthenticationFailed:
        return None


def _chunk_keys(manifest_key: str, manifest: bytes | None) -> Iterator[str]:
    """Keys of the chunks a manifest names, made one at a time as they are asked for: the store
    cannot authenticate a manifest (it holds no data key), so a forged one naming four billion
    chunks must cost no more than the keys actually taken."""
    header = _manifest_header(manifest)
    if header is None:
        return
    for index in range(header.chunk_count):
        yield chunk_key(manifest_key, header.blob_id, index)


def _bulk_reader(connection: object, buffers: ReplyBuffers) -> BulkReader | None:
    """A reader of `connection`'s replies straight from its socket, or `None` (read them through
    redis-py) for a connection without one.

    redis-py has no public way to receive a reply into a caller's buffer, nor to reach a pooled
    connection's socket: `_sock` is the attribute every one of its socket connections (TCP, TLS,
    Unix) keeps it in, set by `connect()`. Take it after the first command is sent, never before:
    a send may run a health check that finds the socket dead and reconnects (a new `_sock`). Its
    parser has then nothing buffered (the pool reconnects a connection handed back with unread
    replies, and a health check reads its PING's reply before the command goes). Were it renamed, the
    chunks would be read through redis-py again, slower but the same
    (`tests/storage/test_bulk_replies.py` checks that the socket is found)."""
    sock = getattr(connection, "_sock", None)
    return BulkReader(sock, buffers) if isinstance(sock, socket.socket) else None


class RedisUnavailable(StorageError):
    """Redis could not be reached, timed out, or answered with an error (cluster errors included)."""


class CircuitBreaker:
    """Closed until a call fails; then open: `admit` refuses every call for `retry_after_s`; then
    half-open: `admit` lets exactly one call through (the trial), refusing the others until the
    trial's outcome closes or re-opens it. Thread-safe.

    pybreaker's half-open state lets every concurrent call through, so N turns arriving after
    the pause would each wait a full timeout on a hung Redis; hence this small one.

    Raises:
        ValueError: `retry_after_s` is not positive.
    """

    def __init__(self, retry_after_s: float) -> None:
        if not retry_after_s > 0:
            raise ValueError(f"retry_after_s must be positive, got {retry_after_s}")
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._opened_at: float | None = None
        self._trial = False

    def admit(self) -> bool:
        """Whether a call may go to Redis now (in half-open state, it becomes the trial)."""
        with self._lock:
            if self._opened_at is None:
                return True
            if self._trial or time.monotonic() - self._opened_at < self.retry_after_s:
                return False
            self._trial = True
            return True

    def succeeded(self) -> None:
        with self._lock:
            self._opened_at, self._trial = None, False

    def failed(self) -> None:
        with self._lock:
            self._opened_at, self._trial = time.monotonic(), False

    def abandoned(self) -> None:
        """The call ended without telling whether Redis works (the caller's own error): a trial
        slot it held is given back, the state is left as it was."""
        with self._lock:
            self._trial = False


def connect_redis(url: str, *, cluster: bool = False, timeout_s: float = 2.0) -> RedisClient:
    """A client for `url` (`redis://` or `rediss://`) whose calls give up after about `timeout_s`.

    Connect and read timeouts are `timeout_s`; a failed call is retried once at once (a pooled
    connection the server closed while idle fails on first use), so a server that is down costs at
    most about `2 * timeout_s` per call, never a hang. Responses are raw bytes.

    A standalone client connects on first use. `cluster=True` returns redis-py's `RedisCluster`,
    which reads the slot map from a node while it is built.

    Raises:
        ValueError: `url` is not a `redis://` or `rediss://` URL.
        RedisUnavailable: `cluster=True` and no node of the cluster answers.
    """
    if not url.startswith(("redis://", "rediss://")):
        raise ValueError(f"not a Redis URL (want redis://host:port/db or rediss://…): {url!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    options = {
        "socket_connect_timeout": timeout_s,
        "socket_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 1),
        "decode_responses": False,
    }
    if not cluster:
        return redis.Redis.from_url(url, **options)
    try:
        return RedisCluster.from_url(url, **options)
    except (RedisError, RedisClusterException) as exc:
        raise RedisUnavailable(f"Redis Cluster at {url} does not answer: {exc}") from exc


class RedisBlobStore(Generic[K]):
    """Sealed blobs in Redis or Redis Cluster (the shared `redis` tier), indexed in `cache_blobs`.

    Implements the same methods as `storage.blob_stores.DiskBlobStore` (the `cache.tiers.BlobStore`
    protocol, structurally). Thread-safe: redis-py clients and `MetadataStore` are.

    Args:
        client: from `connect_redis` (standalone or cluster).
        metadata: the database holding the `cache_blobs` rows.
        model_fingerprint: its first 16 characters namespace the keys; recorded in each row.
        key_factory: builds a key from `(tenant_id, name)`.
        prefix: first component of every key (lets several deployments or test runs share a Redis).
        ttl_s: seconds each value lives after its last write (> 0).
        budget_bytes: most bytes of this fingerprint's rows kept; the oldest go first. 0: TTL only.
        retry_after_s: after a failed call, seconds during which calls fail at once without
            trying Redis (> 0).

    Raises:
        ValueError: a bad `prefix`, fingerprint, `ttl_s`, `budget_bytes` or `retry_after_s`.
    """

    location = LOCATION

    def __init__(
        self,
        client: RedisClient,
        metadata: MetadataStore,
        model_fingerprint: str,
        key_factory: Callable[[str, str], K],
        *,
        prefix: str = "chatkv",
        ttl_s: int = 7 * 24 * 3600,
        budget_bytes: int = 0,
        retry_after_s: float = 5.0,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self._namespace = f"{_check_name(prefix)}:{_check_name(model_fingerprint[:16])}"
        self._client = client
        self._metadata = metadata
        self._fingerprint = model_fingerprint
        self._key_factory = key_factory
        self.ttl_s = ttl_s
        self.budget_bytes = budget_bytes
        self._down = False
        self._down_lock = threading.Lock()
        self.retry_after_s = retry_after_s
        self._breaker = CircuitBreaker(retry_after_s)
        self._reply_buffers = ReplyBuffers(MAX_CHUNK_BYTES + TAG_BYTES)

    def redis_key(self, key: K) -> str:
        """`<prefix>:<fingerprint[:16]>:<tenant id>:{<name>}`. Raises `ValueError` for an unsafe part."""
        return f"{self._namespace}:{_check_name(key.tenant_id)}:{{{_check_name(key.name)}}}"

    def put(self, key: K, blob: bytes | bytearray) -> None:
        """Store `blob` under `key` with the TTL (a chunked blob as its chunks and manifest, anything
        else as one value), delete the chunks of the value it replaced, record its row, then hold
        the byte budget.

        If the owning session or tenant is gone, the value is deleted again and nothing is kept.

        Raises:
            RedisUnavailable: Redis fails (no row is recorded then; chunks written before the
                failure expire with their TTL).
            ValueError: `blob` starts like a chunked blob but is not one (a caller's bug).
        """
        redis_key = self.redis_key(key)
        chunks: list[tuple[str, memoryview]] = []
        if not is_chunked(blob):
            manifest = bytes(blob)  # a blob sealed whole (before chunking): redis-py refuses a `bytearray`
        else:
            try:
                head, sealed = split_frame(blob)
            except AuthenticationFailed as exc:
                raise ValueError(f"put({key.name}): a malformed chunked blob: {exc}") from exc
            blob_id = ChunkedHeader.parse(head).blob_id
            manifest = bytes(head)
            chunks = [(chunk_key(redis_key, blob_id, i), chunk) for i, chunk in enumerate(sealed)]
        with self._redis(f"put {redis_key} ({len(chunks)} chunks)"):
            pipe = self._client.pipeline(transaction=False)
            for name, chunk in chunks:
                pipe.set(name, chunk, ex=self.ttl_s)
            pipe.set(redis_key, manifest, ex=self.ttl_s, get=True)
            replaced = cast(bytes | None, pipe.execute()[-1])
        # The same blob may be stored twice (a disk blob published by the write-back, then by a
        # hand-over): its own chunks, just written again, stay.
        written = {name for name, _ in chunks}
        self._delete_chunks(redis_key, replaced, keep=written)
        recorded = self._metadata.put_blob(
            tenant_id=key.tenant_id,
            session_id=None if key.name.startswith("base-") else key.name,
            name=key.name,
            tier=LOCATION,
            path=redis_key,
            nbytes=len(blob),
            # The manifest names this write's chunks alone (a random blob id, a tag over the sizes),
            # so its digest tells this write from any other as the whole blob's did (the row is
            # deleted only if it still records the write read), without a pass over 100s of MB.
            checksum=hashlib.sha256(manifest).hexdigest(),
            model_fingerprint=self._fingerprint,
            location=LOCATION,
        )
        if not recorded:
            # Its session or tenant was deleted meanwhile: the blob is not wanted any more.
            self._delete_values([redis_key])
            log.debug("dropped redis blob %s/%s: its owner is gone", key.tenant_id, key.name)
            return
        if self.budget_bytes:
            self._hold_budget(key)

    def get(self, key: K) -> bytes:
        """The blob of `key`, whole (a chunked blob's header and chunks joined).

        Raises:
            BlobNotFound: no row, or Redis no longer holds the value or one of its chunks
                (expired, evicted, flushed); a row without its value is deleted.
            RedisUnavailable: Redis cannot be reached.
        """
        with closing(self.read(key)) as pieces:
            return b"".join([bytes(piece) for piece in pieces])  # each piece lives until the next

    def read(self, key: K) -> Generator[bytes | memoryview, None, None]:
        """The blob of `key` piece by piece as Redis sends it: the manifest's value (a chunked
        blob's header, or a whole blob), then each chunk in order, each chunk a view of a buffer
        the store reuses, valid until the next piece is taken (then released: copy a piece to keep
        it). Lazy: nothing is asked of Redis before the first piece is taken. Close it to stop
        early (the reading connection, with replies still in flight, is then closed rather than
        reused).

        Raises, while it is iterated:
            BlobNotFound: no row, or Redis no longer holds the value or one of its chunks; a row
                without its value is deleted.
            RedisUnavailable: Redis cannot be reached, or fails during the read.
        """
        redis_key = self.redis_key(key)
        row = self._metadata.get_blob(tenant_id=key.tenant_id, name=key.name, location=LOCATION)
        if row is None:
            # A value without a row was deleted while Redis was down (it waits for its TTL):
            # it may be an older cache of the session, so it is never served.
            raise BlobNotFound(key.tenant_id, key.name)
        with self._redis(f"get {redis_key}"):
            manifest = cast(bytes | None, self._client.get(redis_key))
        if manifest is None:
            self._drop_row(row, "is gone (TTL, eviction or flush)")
            raise BlobNotFound(key.tenant_id, key.name)
        # A consumer that authenticates the manifest first (`open_chunked`) closes this generator
        # here for a forged one: no chunk key is made or read.
        yield manifest
        header = _manifest_header(manifest)
        count = header.chunk_count if header is not None else 0
        with closing(self._read_values(redis_key, _chunk_keys(redis_key, manifest), count)) as values:
            for index, value in enumerate(values):
                if value is None:
                    self._drop_row(row, f"lost chunk {index} of {count}")
                    raise BlobNotFound(key.tenant_id, key.name)
                yield value

    def _drop_row(self, row: BlobRecord, why: str) -> None:
        log.info("redis blob %s/%s %s: dropping its row", row.tenant_id, row.name, why)
        # Only the row read before: a writer may have stored the blob again since.
        self._metadata.delete_blob(tenant_id=row.tenant_id, name=row.name, location=LOCATION, checksum=row.checksum)

    def _read_values(
        self, slot_key: str, keys: Iterator[str], count: int
    ) -> Generator[memoryview | bytes | None, None, None]:
        """GET the `count` keys of `keys` (all in `slot_key`'s slot, taken one at a time) on one
        connection, `READ_WINDOW` in flight, yielding each value as it arrives, received straight
        into a buffer the store reuses (`storage.bulk_replies`): a view valid until the next value
        is taken. redis-py's pipelines send every command and then read every reply before
        returning any; this hands over each reply as soon as it is read, and Redis sends the next
        ones meanwhile."""
        if not count:
            return
        client = self._client
        if isinstance(client, RedisCluster):
            # Not the node's `redis_connection`: `None` for a node the client learned of from a
            # MOVED reply (a slot resharded to a new node) until a command is routed to it.
            client = client.get_redis_connection(client.get_node_from_key(slot_key))
        pool = client.connection_pool
        with self._redis(f"read {count} chunks of {slot_key}"):
            connection = pool.get_connection()
            reader: BulkReader | None = None
            done = False
            try:
                first = [("GET", next(keys)) for _ in range(min(READ_WINDOW, count))]
                connection.send_packed_command(connection.pack_commands(first))
                # The socket the GETs went out on: the send's health check (a client made with
                # `health_check_interval`) may have found the pooled socket dead and reconnected.
                reader = _bulk_reader(connection, self._reply_buffers)
                for sent in range(len(first), count + len(first)):
                    value = reader.read() if reader is not None else connection.read_response()
                    if sent < count:
                        # No health check: its PING's reply would queue behind the GETs in flight.
                        command = connection.pack_commands([("GET", next(keys))])
                        connection.send_packed_command(command, check_health=False)
                    yield cast(memoryview | bytes | None, value)
                done = True
            finally:
                if reader is not None:
                    reader.close()
                if not done:
                    connection.disconnect()  # replies may still be in flight: never reuse it
                pool.release(connection)

    def delete(self, key: K) -> None:
        """Delete value (its chunks included) and row; if Redis is down the row still goes (the TTL
        removes the value)."""
        self._delete_values([self.redis_key(key)])
        self._metadata.delete_blob(tenant_id=key.tenant_id, name=key.name, location=LOCATION)

    def contains(self, key: K) -> bool:
        """Whether Redis holds the value of `key` now (`False` if Redis cannot be reached)."""
        redis_key = self.redis_key(key)
        try:
            with self._redis(f"exists {redis_key}"):
                return bool(self._client.exists(redis_key))
        except RedisUnavailable:
            return False

    def nbytes(self, key: K) -> int:
        """Bytes of the stored blob, its chunks included (0 if absent or if Redis cannot be reached)."""
        redis_key = self.redis_key(key)
        try:
            with self._redis(f"strlen {redis_key}"):
                pipe = self._client.pipeline(transaction=False)
                pipe.strlen(redis_key)
                pipe.getrange(redis_key, 0, HEADER_BYTES - 1)
                length, head = cast(tuple[int, bytes], tuple(pipe.execute()))
        except RedisUnavailable:
            return 0
        try:
            return ChunkedHeader.parse(head).frame_bytes if is_chunked(head) else int(length)
        except AuthenticationFailed:
            return int(length)

    def keys(self) -> list[K]:
        """Keys of this fingerprint's rows, oldest first (written by any replica)."""
        return [self._key_factory(row.tenant_id, row.name) for row in self._rows()]

    def used_bytes(self) -> int:
        """Bytes recorded in this fingerprint's rows (values Redis dropped count until noticed)."""
        return sum(row.nbytes for row in self._rows())

    def reconcile(self) -> list[K]:
        """Drop this fingerprint's rows whose value Redis no longer holds; return the others' keys,
        oldest first. If Redis cannot be reached, rows are kept and all their keys returned."""
        kept: list[K] = []
        try:
            for row in self._rows():
                with self._redis(f"exists {row.path}"):
                    present = bool(self._client.exists(row.path))
                if present:
                    kept.append(self._key_factory(row.tenant_id, row.name))
                else:
                    self._metadata.delete_blob(
                        tenant_id=row.tenant_id, name=row.name, location=LOCATION, checksum=row.checksum
                    )
        except RedisUnavailable:
            return self.keys()
        return kept

    def delete_tenant(self, tenant_id: str) -> None:
        """Delete every value and row of the tenant in this tier (all fingerprints), and any key
        under this store's namespace left without a row. Call it before the tenant's rows go."""
        rows = self._metadata.list_blobs(tenant_id=tenant_id, location=LOCATION)
        pattern = f"{self._namespace}:{_check_name(tenant_id)}:*"
        orphans: list[str] = []
        try:
            with self._redis(f"scan {pattern}"):
                orphans = [k.decode() for k in self._scan(pattern)]
        except RedisUnavailable:
            pass  # already logged; the values expire with their TTL
        self._delete_keys([row.path for row in rows] + orphans)
        for row in rows:
            self._metadata.delete_blob(tenant_id=tenant_id, name=row.name, location=LOCATION)

    # -- internals -------------------------------------------------------------------------------

    def _rows(self) -> list[BlobRecord]:
        """This fingerprint's rows, oldest first."""
        return [
            row for row in self._metadata.list_blobs(location=LOCATION) if row.model_fingerprint == self._fingerprint
        ]

    def _scan(self, pattern: str) -> Iterator[bytes]:
        if isinstance(self._client, RedisCluster):
            return cast(Iterator[bytes], self._client.scan_iter(match=pattern, target_nodes=RedisCluster.PRIMARIES))
        return cast(Iterator[bytes], self._client.scan_iter(match=pattern))

    def _hold_budget(self, written: K) -> None:
        """Delete the oldest rows of this fingerprint and their values until the rows fit the budget;
        the blob just written goes last, only if it alone exceeds the budget."""
        rows = self._rows()
        total = sum(row.nbytes for row in rows)
        newest = [r for r in rows if (r.tenant_id, r.name) == (written.tenant_id, written.name)]
        for row in [r for r in rows if (r.tenant_id, r.name) != (written.tenant_id, written.name)] + newest:
            if total <= self.budget_bytes:
                return
            if row in newest:
                log.warning(
                    "redis blob %s/%s (%d bytes) alone exceeds the redis budget of %d bytes: not kept",
                    row.tenant_id,
                    row.name,
                    row.nbytes,
                    self.budget_bytes,
                )
            else:
                log.debug("redis budget: evicting %s/%s (%d bytes)", row.tenant_id, row.name, row.nbytes)
            # The row first, and only if it still records the blob read above: a replica may have
            # published that session again since (a hand-over), and its new copy must stay.
            if self._metadata.delete_blob(
                tenant_id=row.tenant_id, name=row.name, location=LOCATION, checksum=row.checksum
            ):
                self._delete_values([row.path])
            total -= row.nbytes

    def _delete_values(self, manifest_keys: list[str]) -> None:
        """Delete the values under `manifest_keys` and the chunks each manifest names (GETDEL: the
        chunks of exactly the manifest removed, even if a writer replaces it meanwhile); if Redis
        is down, leave them to their TTL."""
        try:
            with self._redis(f"delete {len(manifest_keys)} values"):
                pipe = self._client.pipeline(transaction=False)
                for key in manifest_keys:
                    pipe.getdel(key)
                removed = cast(list[bytes | None], pipe.execute())
        except RedisUnavailable:
            return  # already logged; the values expire with their TTL
        for key, value in zip(manifest_keys, removed, strict=True):
            self._delete_chunks(key, value)

    def _delete_chunks(self, manifest_key: str, manifest: bytes | None, keep: Set[str] = frozenset()) -> None:
        """DEL the chunks `manifest` names (but those in `keep`), `_DELETE_BATCH` at a time, until
        a batch finds none of its keys: a manifest's chunks were written together, so the rest
        are gone too (expired, evicted) or never existed (a forged manifest, whose claimed count
        then costs one batch, not billions of keys). Redis down: left to their TTL."""
        keys = (k for k in _chunk_keys(manifest_key, manifest) if k not in keep)
        try:
            while batch := list(islice(keys, _DELETE_BATCH)):
                with self._redis(f"delete {len(batch)} chunks of {manifest_key}"):
                    if not self._client.delete(*batch):
                        return
        except RedisUnavailable:
            pass  # already logged; the values expire with their TTL

    def _delete_keys(self, redis_keys: list[str]) -> None:
        """DEL the keys; if Redis is down, log it and leave them to their TTL."""
        try:
            for start in range(0, len(redis_keys), _DELETE_BATCH):
                batch = redis_keys[start : start + _DELETE_BATCH]
                with self._redis(f"delete {len(batch)} keys"):
                    self._client.delete(*batch)
        except RedisUnavailable:
            pass  # already logged; the values expire with their TTL

    @contextmanager
    def _redis(self, what: str) -> Iterator[None]:
        """Run the block if the circuit breaker admits it; turn redis-py's failures, and the
        breaker's refusals, into `RedisUnavailable`. Log the first failure of an outage as a
        warning (the later ones at debug) and the recovery once."""
        if not self._breaker.admit():
            log.debug("redis not tried (%s): it failed less than %g s ago", what, self.retry_after_s)
            raise RedisUnavailable(
                f"redis unavailable ({what}): not tried for {self.retry_after_s:g} s after a failure"
            )
        try:
            yield
        except (RedisError, RedisClusterException) as exc:
            self._breaker.failed()
            with self._down_lock:
                first, self._down = not self._down, True
            log.log(logging.WARNING if first else logging.DEBUG, "redis unavailable (%s): %s", what, exc)
            raise RedisUnavailable(f"redis unavailable ({what}): {exc}") from exc
        # Not a blanket catch: the caller's own error (or a generator closed early) says nothing
        # about Redis; the trial slot is given back and the error propagates unchanged.
        except BaseException:
            self._breaker.abandoned()
            raise
        self._breaker.succeeded()
        if self._down:
            with self._down_lock:
                recovered, self._down = self._down, False
            if recovered:
                log.info("redis answers again")
