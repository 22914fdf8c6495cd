"""The tenant-scoped pool of shared base layers (system-prompt prefixes).

Sessions of one tenant that start with the same system prompt share one read-only base-layer KV,
computed once. Keys are a SHA-256 of the token ids salted with the tenant id and the model
fingerprint (as vLLM's `cache_salt`), so two tenants with the same prompt get different keys: no
cross-tenant hit, and no timing difference a tenant could observe (invariant 2).

Entries are reference-counted by the device-resident sessions that use them; an entry with no
reference stays until the tier manager needs its bytes (least recently used first).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cache.ids import PrefixKey, TenantId
from cache.session_cache import BaseLayer


def prefix_key(tenant_id: TenantId, model_fingerprint: str, token_ids: Sequence[int]) -> PrefixKey:
    """Pool key of a base layer: SHA-256 over tenant id, model fingerprint and token ids."""
    digest = hashlib.sha256()
    digest.update(b"chatkv-prefix-v1\0")
    digest.update(tenant_id.encode() + b"\0")
    digest.update(model_fingerprint.encode() + b"\0")
    digest.update(b",".join(str(int(i)).encode() for i in token_ids))
    return PrefixKey(digest.hexdigest())


@dataclass
class _Entry:
    tenant_id: TenantId
    base: BaseLayer
    refs: int = 0


class PrefixPool:
    """Shared base layers on the device, keyed by `prefix_key`. Thread-safe."""

    def __init__(self) -> None:
        self._entries: OrderedDict[PrefixKey, _Entry] = OrderedDict()
        self._dropped: set[PrefixKey] = set()
        self._lock = threading.Lock()

    def get(self, key: PrefixKey) -> BaseLayer | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry.base

    def put(self, tenant_id: TenantId, base: BaseLayer) -> BaseLayer:
        """Insert `base`, or return the entry already there (another turn computed it first)."""
        with self._lock:
            entry = self._entries.get(base.key)
            if entry is None:
                entry = self._entries[base.key] = _Entry(tenant_id, base)
            self._entries.move_to_end(base.key)
            return entry.base

    def acquire(self, tenant_id: TenantId, base: BaseLayer) -> None:
        """Take a reference for a device-resident session (re-inserting `base` if it was evicted
        while the session's turn ran)."""
        with self._lock:
            entry = self._entries.get(base.key)
            if entry is None:
                entry = self._entries[base.key] = _Entry(tenant_id, base)
            entry.refs += 1
            self._entries.move_to_end(base.key)

    def release(self, key: PrefixKey) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None and key in self._dropped:
                return  # its tenant was deleted while a turn held the reference
            if entry is None or entry.refs <= 0:
                raise RuntimeError(f"bug: unref of base {key} without a reference")
            entry.refs -= 1

    def refs(self, key: PrefixKey) -> int:
        with self._lock:
            entry = self._entries.get(key)
            return entry.refs if entry else 0

    def unreferenced(self) -> list[tuple[PrefixKey, TenantId, int]]:
        """(key, tenant, bytes) of entries no device session uses, least recently used first."""
        with self._lock:
            return [(k, e.tenant_id, e.base.nbytes) for k, e in self._entries.items() if e.refs == 0]

    def remove(self, key: PrefixKey) -> BaseLayer | None:
        """Remove an unreferenced entry; returns it, or `None` if absent or still referenced."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.refs > 0:
                return None
            del self._entries[key]
            return entry.base

    def drop_tenant(self, tenant_id: TenantId) -> None:
        """Remove a deleted tenant's entries, referenced or not; later releases of them are no-ops."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.tenant_id == tenant_id]:
                del self._entries[key]
                self._dropped.add(key)

    def nbytes(self, tenant_id: TenantId | None = None) -> int:
        with self._lock:
            return sum(e.base.nbytes for e in self._entries.values() if tenant_id in (None, e.tenant_id))

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
