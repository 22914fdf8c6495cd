"""Wiring of the tiers: the sealer that turns caches into encrypted blobs for the host and disk stores,
and the adapter that hands those stores to the tier manager.

`cache/` declares what it needs (`CacheSealer`, `BlobStore`); `storage/` provides the codec, the
key ring and the stores; this module joins them, so neither of those packages imports the other.
A blob is the safetensors payload (tensors and header) sealed in chunks under the tenant's data
key (`storage.chunked_blobs`: each chunk's associated data binds tenant, name, model fingerprint
and format version, and the blob's id, the chunk's index and the chunk count), for every tier:
the disk and host stores keep the frame whole, the Redis store one value per chunk, and a blob
moves between them (a write-back's disk blob published to Redis) without being sealed again.
Opening authenticates the blob's header first and bounds its sizes by what a cache of this model
can hold (`max_payload_bytes`), so a forged header (a Redis manifest claiming billions of chunks)
is rejected before a chunk is asked for or a buffer allocated; then it decrypts each chunk into
one payload buffer as it arrives (from Redis: while the next
chunks are read) and decodes the tensors in place. Blobs sealed whole before chunking
(`storage.keyring.seal`, one AES-GCM over the payload) still open. Any failure to authenticate
or decode becomes `BlobRejected` and the turn rebuilds the cache from the transcript. A tenant
whose data key is unavailable (deleted, or a master key that does not unwrap it) cannot seal:
`SealFailed`, and the cache is dropped instead.
Errors are translated the same way for the stores: `storage`'s `BlobNotFound` becomes `cache`'s
`BlobMissing` (`TierBlobStore`, and `SharedBlobStore` for the Redis tier of replicas).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Generator
from contextlib import closing
from typing import TYPE_CHECKING

import torch

from cache.ids import TenantId
from cache.serialization import (
    FORMAT_VERSION,
    READABLE_VERSIONS,
    MalformedCache,
    base_layer_from_tensors,
    base_layer_to_tensors,
    session_cache_from_tensors,
    session_cache_to_tensors,
)
from cache.session_cache import BaseLayer, SessionCache
from cache.tiers import BlobMissing, BlobRejected, CacheKey, SealedBlob, SealFailed, StoreUnavailable
from storage import codec
from storage.blob_stores import BlobNotFound, DiskBlobStore, HostBlobStore
from storage.chunked_blobs import CHUNK_BYTES, is_chunked, open_chunked, seal_chunked, split_frame
from storage.keyring import AuthenticationFailed, KeyRingError, TenantKeys, blob_aad, open_sealed
from storage.redis_store import RedisBlobStore, RedisUnavailable

if TYPE_CHECKING:
    from sessions.engine import KVLayout

HEADER_ALLOWANCE_BYTES = 1 << 20
"""Payload bytes a cache's header may take beyond its per-token share (names, digests, options)."""
HEADER_BYTES_PER_TOKEN = 256
"""Header bytes a cached token may take: its id in the JSON token lists, its share of the layer table."""


def max_payload_bytes(context_tokens: int, layout: KVLayout) -> int:
    """The most payload bytes a sealed session cache or base layer of a model can be: twice what
    `context_tokens` tokens take (keys and values of every model layer in the model's dtype, the
    int32 stream index an eviction keeps per KV head, and their header share), plus
    `HEADER_ALLOWANCE_BYTES`. A cache never holds more than the context; quantised ones are
    smaller. A blob whose header claims more is rejected before anything is allocated for it.

    Raises:
        ValueError: `context_tokens` is not positive.
    """
    if context_tokens <= 0:
        raise ValueError(f"context_tokens must be positive, got {context_tokens}")
    index_bytes = 4 * layout.num_model_layers * layout.kv_heads
    per_token = layout.bytes_per_token + index_bytes + HEADER_BYTES_PER_TOKEN
    return 2 * context_tokens * per_token + HEADER_ALLOWANCE_BYTES


class EncryptedCacheSealer:
    """`CacheSealer` with AES-256-GCM under each tenant's data key.

    Args:
        keys: the tenants' data keys.
        model_fingerprint: bound into every blob; a blob of another model does not open.
        device: where opened caches are placed.
        precision: `exact`, `int8` or `int4` for unpinned turn layers (see `cache.serialization`).
        residual_tokens: most recent tokens kept exact when `precision` is lossy.
        chunk_bytes: plaintext bytes per sealed chunk (`storage.chunked_blobs.CHUNK_BYTES`; tests
            set a small one to get many chunks from small caches).
        windows: the model's sliding window per model layer (`None`: full attention); a blob
            written for other windows is rejected (`cache.serialization`).
        max_payload_bytes: the most payload bytes a blob may claim (`max_payload_bytes()` of
            the model); a blob claiming more is rejected unopened.
    """

    def __init__(
        self,
        keys: TenantKeys,
        model_fingerprint: str,
        device: torch.device,
        precision: str = "exact",
        residual_tokens: int = 0,
        chunk_bytes: int = CHUNK_BYTES,
        *,
        max_payload_bytes: int,
        windows: tuple[int | None, ...] = (),
    ) -> None:
        self._keys = keys
        self._windows = windows
        self._fingerprint = model_fingerprint
        self._device = device
        self._precision = precision
        self._residual = residual_tokens
        self.chunk_bytes = chunk_bytes
        self.max_payload_bytes = max_payload_bytes

    def _aad(self, key: CacheKey, version: int = FORMAT_VERSION) -> bytes:
        return blob_aad(key.tenant_id, key.name, self._fingerprint, version)

    def _data_key(self, key: CacheKey) -> bytes:
        try:
            return self._keys.data_key(key.tenant_id)
        except KeyRingError as exc:
            raise SealFailed(f"no usable data key for tenant {key.tenant_id}: {exc}") from exc

    def _aads(self, key: CacheKey) -> list[bytes]:
        """The associated data a blob of `key` may be bound to: the current format's, then the
        older readable ones' (a blob written before an upgrade)."""
        older = [v for v in READABLE_VERSIONS if v != FORMAT_VERSION]
        return [self._aad(key, version) for version in [FORMAT_VERSION, *older]]

    def _open(self, key: CacheKey, blob: SealedBlob) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        try:
            tensors, header = codec.decode(self._payload(key, blob))
        except (KeyRingError, codec.CodecError) as exc:
            raise BlobRejected(str(exc)) from exc
        if header.get("model_fingerprint") != self._fingerprint:
            raise BlobRejected("the blob was made with another model")
        return tensors, header

    def _payload(self, key: CacheKey, blob: SealedBlob) -> bytes | bytearray | mmap.mmap:
        """The plaintext payload of a chunked blob (whole, or in pieces: its header, then its
        chunks, each decrypted as it arrives) or of a blob sealed whole before chunking."""
        data_key = self._keys.data_key(key.tenant_id)
        if isinstance(blob, bytes | bytearray):  # a sealer's own output is a `bytearray`
            if not is_chunked(blob):
                return self._open_whole(key, data_key, bytes(blob))
            frame_head, chunks = split_frame(blob)
            return open_chunked(data_key, frame_head, chunks, self._aads(key), max_payload_bytes=self.max_payload_bytes)
        with closing(blob):
            head = next(blob, b"")
            if not is_chunked(head):  # a value written before chunking comes as one piece
                return self._open_whole(key, data_key, bytes(head))  # the manifest's value: bytes, not copied
            # `blob` is asked for its first chunk only once the header authenticated.
            return open_chunked(data_key, head, blob, self._aads(key), max_payload_bytes=self.max_payload_bytes)

    def _open_whole(self, key: CacheKey, data_key: bytes, blob: bytes) -> bytes:
        """A blob sealed whole, under the current format's associated data or an older readable
        one's. Raises the current version's `AuthenticationFailed`."""
        current: AuthenticationFailed | None = None
        for aad in self._aads(key):
            try:
                return open_sealed(data_key, blob, aad)
            except AuthenticationFailed as exc:
                current = current or exc
        raise current or AuthenticationFailed("no associated data to open the blob with")

    def seal_session(
        self, key: CacheKey, cache: SessionCache, pause: Callable[[], None] | None = None
    ) -> bytes | bytearray:
        data_key = self._data_key(key)
        tensors, header = session_cache_to_tensors(cache, self._precision, self._residual)
        header["model_fingerprint"] = self._fingerprint
        payload = codec.encode(tensors, header)
        if pause is not None:
            pause()
        return seal_chunked(data_key, payload, self._aad(key), self.chunk_bytes)

    def open_session(self, key: CacheKey, blob: SealedBlob) -> SessionCache:
        tensors, header = self._open(key, blob)
        try:
            return session_cache_from_tensors(tensors, header, self._device, self._windows)
        except MalformedCache as exc:
            raise BlobRejected(str(exc)) from exc

    def seal_base(self, key: CacheKey, base: BaseLayer) -> bytes | bytearray:
        data_key = self._data_key(key)
        tensors, header = base_layer_to_tensors(base)
        header["model_fingerprint"] = self._fingerprint
        return seal_chunked(data_key, codec.encode(tensors, header), self._aad(key), self.chunk_bytes)

    def open_base(self, key: CacheKey, blob: SealedBlob) -> BaseLayer:
        tensors, header = self._open(key, blob)
        try:
            return base_layer_from_tensors(tensors, header, self._device)
        except MalformedCache as exc:
            raise BlobRejected(str(exc)) from exc


class TierBlobStore:
    """A `storage` host or disk store as the tier manager's `BlobStore`: the same calls, with an
    absent blob raised as `cache.tiers.BlobMissing` instead of `storage`'s `BlobNotFound`. Any
    other exception (a `KeyError` from a bug included) passes through unchanged.

    Args:
        store: the store to adapt, keyed by `CacheKey`.
    """

    def __init__(self, store: HostBlobStore[CacheKey] | DiskBlobStore[CacheKey] | RedisBlobStore[CacheKey]) -> None:
        self.store = store

    def get(self, key: CacheKey) -> bytes:
        """Raises `BlobMissing` if absent."""
        try:
            return self.store.get(key)
        except BlobNotFound as exc:
            raise BlobMissing(str(exc)) from exc

    def put(self, key: CacheKey, blob: bytes | bytearray) -> None:
        self.store.put(key, blob)

    def delete(self, key: CacheKey) -> None:
        self.store.delete(key)

    def contains(self, key: CacheKey) -> bool:
        return self.store.contains(key)

    def nbytes(self, key: CacheKey) -> int:
        return self.store.nbytes(key)

    def keys(self) -> list[CacheKey]:
        return self.store.keys()

    def used_bytes(self) -> int:
        return self.store.used_bytes()


class SharedBlobStore(TierBlobStore):
    """The Redis store as the tier manager's shared `BlobStore`: an absent blob, and a Redis that
    cannot be reached, read as `cache.tiers.BlobMissing` (the turn rebuilds from the transcript:
    a Redis outage costs a prefill, never a turn); a write that cannot reach Redis raises
    `cache.tiers.StoreUnavailable` (the cache stays local).

    Args:
        store: the Redis store, keyed by `CacheKey`.
    """

    def __init__(self, store: RedisBlobStore[CacheKey]) -> None:
        super().__init__(store)
        self.redis = store

    def get(self, key: CacheKey) -> bytes:
        """Raises `BlobMissing` if absent or if Redis cannot be reached."""
        try:
            return super().get(key)
        except RedisUnavailable as exc:
            raise BlobMissing(f"Redis unavailable: {exc}") from exc

    def put(self, key: CacheKey, blob: bytes | bytearray) -> None:
        """Raises `StoreUnavailable` if Redis cannot be reached."""
        try:
            super().put(key, blob)
        except RedisUnavailable as exc:
            raise StoreUnavailable(str(exc)) from exc

    def delete_tenant(self, tenant_id: TenantId) -> None:
        """Every blob of the tenant in Redis (call it before the tenant's rows are deleted)."""
        self.redis.delete_tenant(tenant_id)

    def read(self, key: CacheKey) -> Generator[bytes | memoryview, None, None]:
        """The blob piece by piece as Redis sends it (`RedisBlobStore.read`: each piece valid until
        the next is taken). Raises `BlobMissing`,
        while iterated, if it or one of its chunks is absent or Redis fails, mid-read included."""
        try:
            yield from self.redis.read(key)
        except (BlobNotFound, RedisUnavailable) as exc:
            raise BlobMissing(f"redis blob {key.name}: {exc}") from exc
