"""The parts a `SessionManager` adds when it is one of several replicas (docs/replicas.md): its
replica id, the shared Redis tier, and the ownership leases. Built once at start-up from the
settings' `ReplicaConfig` and `RedisConfig`; a single process on SQLite without Redis builds none
of them.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable

from cache.ids import TenantId
from cache.tier_manager import TierManager
from cache.tiers import CacheKey
from sessions.offload import SharedBlobStore
from sessions.replicas.ownership import SessionOwnership
from sessions.settings import RedisConfig, ReplicaConfig
from storage.atomic_files import write_atomic
from storage.metadata_store import MetadataStore
from storage.redis_store import RedisBlobStore, connect_redis
from storage.replica_store import ReplicaIdInUse, ReplicaStore

log = logging.getLogger(__name__)

_REPLICA_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")


def replica_id_for(config: ReplicaConfig) -> str:
    """`config.replica_id`, else the id kept in `config.replica_id_file` (`home/replica.id`, created
    once: a restarted replica keeps its id, so its own leases and disk blobs stay its own).

    Raises:
        ValueError: if the file holds something that is not a replica id.
    """
    if config.replica_id:
        return config.replica_id
    path = config.replica_id_file
    if path.is_file():
        text = path.read_text().strip()
        if not _REPLICA_ID.fullmatch(text):
            raise ValueError(f"{path} does not hold a replica id: {text[:40]!r}")
        return text
    replica_id = f"r_{secrets.token_hex(6)}"
    write_atomic(path, replica_id.encode())
    return replica_id


def open_shared_store(config: RedisConfig | None, metadata: MetadataStore, fingerprint: str) -> SharedBlobStore | None:
    """The Redis tier of `config` (`Settings.redis_config()`), or `None` without one. Connects
    lazily: a Redis that is down at start-up costs rebuilds until it is back, not a failed start.

    Raises:
        ValueError: for a URL redis-py cannot use.
    """
    if config is None:
        return None
    client = connect_redis(config.redis_url, cluster=config.redis_cluster)
    store: RedisBlobStore[CacheKey] = RedisBlobStore(
        client,
        metadata,
        fingerprint,
        lambda tenant, name: CacheKey(TenantId(tenant), name),
        prefix=config.redis_prefix,
        ttl_s=int(config.redis_ttl_s),
        budget_bytes=config.redis_budget_bytes or 0,
    )
    return SharedBlobStore(store)


def start_ownership(
    config: ReplicaConfig,
    replicas: ReplicaStore,
    replica_id: str,
    tiers: TierManager,
    invalidate: Callable[[CacheKey], None],
    queued_turns: Callable[[], int],
) -> SessionOwnership:
    """Register this replica and start keeping its leases (see `sessions.replicas.ownership`);
    `queued_turns` counts the turns waiting in its engine queue (reported with each heartbeat)."""

    def cache_bytes() -> int:
        return sum(tiers.usage().bytes.values())

    ownership = SessionOwnership(
        replicas,
        replica_id=replica_id,
        url=config.replica_url or "",
        lease_s=config.ownership_lease_s,
        wait_s=config.ownership_wait_s,
        idle_s=config.ownership_idle_s,
        publish=tiers.publish,
        invalidate=invalidate,
        cache_bytes=cache_bytes,
        queued_turns=queued_turns,
    )
    try:
        ownership.start()
    except ReplicaIdInUse:
        if config.replica_id:
            raise
        # The id came from the home's file: a copied home (or a home shared by two servers).
        raise ReplicaIdInUse(
            f"replica id {replica_id} (from {config.replica_id_file}) is in use by a live process; "
            "this home looks copied from another replica's: delete that file to get a new id"
        ) from None
    log.info("replica %s registered (leases of %.0f s)", replica_id, config.ownership_lease_s)
    return ownership
