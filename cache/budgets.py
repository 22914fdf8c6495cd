"""Byte budgets of the tiers, and what the tiers use of them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from cache.entries import SessionEntry
from cache.ids import TenantId
from cache.prefix_pool import PrefixPool
from cache.tiers import LOCAL_TIERS, BlobStore, Tier


@dataclass(frozen=True)
class TierBudgets:
    """Byte budgets per tier and the per-tenant device quota. Raises `ValueError` if not positive."""

    device_bytes: int
    host_bytes: int
    disk_bytes: int
    tenant_device_quota_bytes: int

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes", "disk_bytes", "tenant_device_quota_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class TierUsage:
    """Bytes and session counts per tier, and per tenant on the device."""

    bytes: dict[Tier, int]
    sessions: dict[Tier, int]
    budgets: dict[Tier, int]
    device_bytes_by_tenant: dict[TenantId, int] = field(default_factory=dict)
    reserved_device_bytes: int = 0
    """Device bytes reserved by running requests' working buffers (not part of `bytes`)."""
    copies: dict[Tier, int] = field(default_factory=dict)
    """Sessions placed in a higher tier whose copy this tier's store also holds (the write-back's
    disk copies of device and host sessions): part of its `bytes`, not of its `sessions`."""


def measure_usage(
    entries: Iterable[SessionEntry],
    pool: PrefixPool,
    stores: Mapping[Tier, BlobStore],
    budgets: TierBudgets,
    reserved_device_bytes: int,
) -> TierUsage:
    """The usage of every tier: device bytes are the sessions' own tensors plus the pool's base
    layers (a tenant's share counts its own bases); host and disk bytes are what their stores hold
    (on disk: its sessions, the write-back's copies of sessions placed higher, counted in `copies`,
    and shared base layers)."""
    sizes = {tier: 0 for tier in LOCAL_TIERS}
    counts = {tier: 0 for tier in LOCAL_TIERS}
    by_tenant: dict[TenantId, int] = {}
    copies = {tier: 0 for tier in LOCAL_TIERS}
    for entry in entries:
        if entry.tier is not None:
            sizes[entry.tier] += entry.nbytes
            counts[entry.tier] += 1
        if entry.tier in (Tier.DEVICE, Tier.HOST) and entry.persisted_version is not None:
            copies[Tier.DISK] += 1
        if entry.tier is Tier.DEVICE:
            tenant = entry.key.tenant_id
            by_tenant[tenant] = by_tenant.get(tenant, 0) + entry.nbytes
    sizes[Tier.DEVICE] += pool.nbytes()
    for tenant in list(by_tenant):
        by_tenant[tenant] += pool.nbytes(tenant)
    sizes[Tier.HOST] = stores[Tier.HOST].used_bytes()
    sizes[Tier.DISK] = stores[Tier.DISK].used_bytes()
    limits = {
        Tier.DEVICE: budgets.device_bytes,
        Tier.HOST: budgets.host_bytes,
        Tier.DISK: budgets.disk_bytes,
    }
    return TierUsage(sizes, counts, limits, by_tenant, reserved_device_bytes, copies)
