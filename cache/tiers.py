"""Tiers, and the two small protocols through which the tier manager moves caches.

`cache/` never imports `storage/`: the tier manager is handed a `CacheSealer` (turns a cache into
sealed bytes and back: codec plus encryption) and one `BlobStore` per lower tier (bytes by key:
process memory, files). `sessions/` wires the storage implementations in.

Each protocol names the exceptions it may raise (`BlobRejected`, `SealFailed`, `BlobMissing`); the
tier manager treats those as "nothing usable stored here: rebuild from the transcript" and lets any
other exception, a `KeyError` included, propagate as the bug it is.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Protocol

from cache.errors import CacheError
from cache.ids import PrefixKey, SessionId, TenantId
from cache.session_cache import BaseLayer, SessionCache


class Tier(enum.StrEnum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REDIS = "redis"
    """The tier replicas share (`cache/shared_tier.py`): a copy beside the local placement, never
    a session's only placement in this process."""


LOCAL_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)
"""The tiers of one process, each under its byte budget; every session cache is in one of them."""


BASE_BLOB_PREFIX = "base-"


@dataclass(frozen=True)
class CacheKey:
    """Names a stored cache: a session's (`name` = session id) or a shared base layer's
    (`name` = `base-<prefix key>`). The tenant is part of every key."""

    tenant_id: TenantId
    name: str

    @classmethod
    def for_session(cls, tenant_id: TenantId, session_id: SessionId) -> CacheKey:
        return cls(tenant_id, session_id)

    @classmethod
    def for_base(cls, tenant_id: TenantId, key: PrefixKey) -> CacheKey:
        return cls(tenant_id, BASE_BLOB_PREFIX + key)

    @property
    def is_base(self) -> bool:
        return self.name.startswith(BASE_BLOB_PREFIX)

    @property
    def session_id(self) -> SessionId | None:
        return None if self.is_base else SessionId(self.name)


SealedBlob = bytes | Generator[bytes | memoryview, None, None]
"""A sealed blob as the sealer opens it: whole, or piece by piece as a store reads it (the shared
tier: a chunked blob's header, then each sealed chunk in order), so that the sealer opens one
piece while the store reads the next. A piece is valid only until the next is taken (the store
receives each into the buffer of the one before). Taking a piece may raise `BlobMissing`."""


class BlobRejected(CacheError):
    """A stored blob failed authentication or decoding (tampered, truncated, moved to another
    session or tenant, another model fingerprint, wrong key). It must not be used; rebuild."""


class BlobMissing(CacheError):
    """A `BlobStore` holds no blob for the key (never stored, dropped, or its file deleted behind
    the store). Declared here, not in `storage/`, because `cache/` and `storage/` do not import each
    other: `sessions/offload.py` adapts the storage stores' own `BlobNotFound` to it. A named
    exception instead of `KeyError`, so a `KeyError` from a bug is not mistaken for an absent blob."""


class StoreUnavailable(CacheError):
    """A shared `BlobStore` cannot be reached (Redis down or timing out). Only `put` raises it: a
    read from an unreachable store is `BlobMissing` (the turn rebuilds), and a delete is retried by
    the store's TTL. The cache stays in this process's tiers."""


class SealFailed(CacheError):
    """A cache cannot be sealed for its key: the tenant's data key is unavailable (the tenant was
    deleted, or the master key does not unwrap its key). The cache is dropped instead of stored;
    the transcript rebuilds it."""


class CacheSealer(Protocol):
    """Turns caches into sealed bytes bound to their key, and back."""

    def seal_session(
        self, key: CacheKey, cache: SessionCache, pause: Callable[[], None] | None = None
    ) -> bytes | bytearray:
        """Raises `SealFailed` if the cache cannot be sealed for this key.

        `pause`, if given, is called between the sealing steps (encoding, encryption), each of
        which holds the GIL for tens of milliseconds per 100 MB: a background writer uses it to
        step aside while a turn runs (see `TierManager`)."""
        ...

    def open_session(self, key: CacheKey, blob: SealedBlob) -> SessionCache:
        """Raises `BlobRejected` if the blob does not authenticate or decode for this key, and
        `BlobMissing` if a piece of it cannot be read."""
        ...

    def seal_base(self, key: CacheKey, base: BaseLayer) -> bytes | bytearray:
        """Raises `SealFailed` if the base layer cannot be sealed for this key."""
        ...

    def open_base(self, key: CacheKey, blob: SealedBlob) -> BaseLayer:
        """Raises `BlobRejected` if the blob does not authenticate or decode for this key, and
        `BlobMissing` if a piece of it cannot be read."""
        ...


class BlobStore(Protocol):
    """Sealed bytes by key, in one tier (after LMCache's storage-backend interface)."""

    def put(self, key: CacheKey, blob: bytes | bytearray) -> None: ...

    def get(self, key: CacheKey) -> bytes:
        """Raises `BlobMissing` if absent."""
        ...

    def delete(self, key: CacheKey) -> None: ...

    def contains(self, key: CacheKey) -> bool: ...

    def nbytes(self, key: CacheKey) -> int:
        """Stored size in bytes, 0 if absent."""
        ...

    def keys(self) -> list[CacheKey]: ...

    def used_bytes(self) -> int:
        """Bytes of every blob in the store."""
        ...


class SharedBlobStore(BlobStore, Protocol):
    """The store replicas share (Redis): a `BlobStore` that can also drop a whole tenant's blobs,
    those it has no index of included (they are still named by the tenant)."""

    def delete_tenant(self, tenant_id: TenantId) -> None: ...

    def read(self, key: CacheKey) -> Generator[bytes | memoryview, None, None]:
        """The blob of `key` piece by piece as it is read (see `SealedBlob`). Raises `BlobMissing`,
        while iterated, if the blob or a piece of it is absent or cannot be read."""
        ...


class TierEvents(Protocol):
    """What the tier manager reports (metrics implement it)."""

    def moved(self, source: Tier, target: Tier | None, nbytes: int) -> None:
        """A cache left `source` for `target` (`None`: dropped)."""

    def restored(self, source: Tier, seconds: float) -> None: ...

    def rejected(self, source: Tier) -> None: ...


class NoEvents:
    def moved(self, source: Tier, target: Tier | None, nbytes: int) -> None:
        pass

    def restored(self, source: Tier, seconds: float) -> None:
        pass

    def rejected(self, source: Tier) -> None:
        pass
