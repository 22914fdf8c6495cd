"""The tier manager's record of each session's cache, and the least-recently-used orders over those
records that decide what leaves a tier first. Pure functions: the tier manager calls them under its
lock and makes the moves."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cache.ids import PrefixKey, TenantId
from cache.session_cache import SessionCache
from cache.tiers import CacheKey, Tier


@dataclass
class SessionEntry:
    """The tier manager's record of one session's cache. Only the tier manager changes its fields,
    under its lock; a `Lease` holds one as the handle it passes back."""

    key: CacheKey
    tier: Tier | None = None
    cache: SessionCache | None = None
    nbytes: int = 0
    last_used: int = 0
    leased: bool = False
    version: int = 0
    persisted_version: int | None = None
    shared_version: int | None = None
    """The version the shared tier (Redis) holds a copy of, if any (`cache/shared_tier.py`)."""
    base_key: PrefixKey | None = None
    """The shared base the cache references, kept while it is offloaded (its blob stays needed)."""


def idle_lru(entries: Iterable[SessionEntry], tier: Tier, tenant: TenantId | None = None) -> list[SessionEntry]:
    """The entries in `tier` without a turn in flight (of `tenant` only, if given), least recently
    used first."""
    return sorted(
        (e for e in entries if e.tier is tier and not e.leased and tenant in (None, e.key.tenant_id)),
        key=lambda e: e.last_used,
    )


def oldest_disk_blob(
    entries: Mapping[CacheKey, SessionEntry], disk_keys: Iterable[CacheKey], base_used: Mapping[CacheKey, int]
) -> CacheKey | None:
    """The disk blob to drop first, `None` if every one belongs to a leased session: an idle
    disk-tier session, a stale write-back copy, or a base layer no live session references.

    Args:
        entries: the sessions' records by key.
        disk_keys: the keys of the blobs on disk, in the store's order (ties go to the first).
        base_used: when each base blob was last written or adopted (the entries' clock).
    """
    # A base blob is needed as long as an offloaded session references it: it counts as used
    # as recently as the most recent of those sessions.
    base_users: dict[CacheKey, int] = {}
    for user in entries.values():
        if user.base_key is not None and user.tier is not None:
            blob_key = CacheKey.for_base(user.key.tenant_id, user.base_key)
            base_users[blob_key] = max(base_users.get(blob_key, 0), user.last_used)
    candidates: list[tuple[int, CacheKey]] = []
    for key in disk_keys:
        if key.is_base:
            candidates.append((max(base_used.get(key, 0), base_users.get(key, 0)), key))
            continue
        entry = entries.get(key)
        if entry is None:
            candidates.append((0, key))
        elif not entry.leased:
            candidates.append((entry.last_used, key))
    if not candidates:
        return None
    return min(candidates, key=lambda item: item[0])[1]
