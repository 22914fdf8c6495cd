"""The groups of settings that one part of chatkv consumes together, each a frozen dataclass
checked when built (`Settings.model_config()`, `window_config()`, `tier_config()`,
`redis_config()`, `replica_config()`; the engine loop's `SchedulerConfig` is the fifth).

Field names are the `Settings` field names (and so `CHATKV_<FIELD>`), so an error names the
setting to change. Values are resolved: derived defaults are filled in by `Settings` first.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from sessions.settings.checks import (
    BudgetAllocation,
    DtypeSetting,
    PersistMode,
    Precision,
    RoutingMode,
    WindowPolicyName,
    check_field,
    check_set,
)

DEFAULT_CONTEXT_SHARE = 0.8
"""Share of the model's context a session may fill when `context_budget_tokens` is not set."""


def _check_each(config: Any, *, required: tuple[str, ...] = ()) -> None:
    """Check every field of `config` by the shared rules (`sessions.settings.checks`); `required`
    ones may not be `None`. Raises `ValueError` naming the first bad field."""
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name in required:
            check_set(f.name, value)
        check_field(f.name, value)


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load, where and how (`sessions.model_source.load_model`).

    Attributes:
        model: `"default"` (the bundled SmolLM2-135M-Instruct), a local Hugging Face model directory,
            a `.gguf` file or a hub id (`sessions.model_source.resolve_model`).
        model_cache_dir: where the bundled GGUF is converted to safetensors once.
        device: `auto`, `cpu`, `cuda`, `cuda:N` or `mps` (`auto`: CUDA when available, else CPU).
        dtype: the weights' (and so every KV cache's) precision; `auto`: bfloat16 on CUDA (float16
            without bfloat16 support), float32 elsewhere.
        threads: torch intra-op threads; `None` keeps torch's default.

    Raises:
        ValueError: for an unknown device or dtype, threads below 1.
    """

    model: str
    model_cache_dir: Path
    device: str
    dtype: DtypeSetting
    threads: int | None

    def __post_init__(self) -> None:
        _check_each(self, required=("model_cache_dir",))


@dataclass(frozen=True)
class WindowConfig:
    """What a session keeps in its attention window (`cache.window.WindowPolicy`, pinning).

    Attributes:
        context_budget_tokens: per-session window in tokens; `None`: `DEFAULT_CONTEXT_SHARE` of
            the model's context (`budget_tokens`).
        window_policy: `turns` (whole oldest unpinned turns go), `attention` (lossy, per KV head, by
            the new turn's attention) or `agnostic` (lossy, per KV head, by scores fixed at commit).
        window_budget_allocation: under `attention` and `agnostic`, `per_head` (Ada-KV, stored
            ragged) or `uniform` (`cache.token_eviction.evict_by_scores`).
        window_recent_tokens: under `attention`, the most recent tokens never evicted.
        window_observation_tokens: under `attention`, the queries whose attention scores the cache.
        window_rebuild_chunk_tokens: under `attention` and `agnostic`, the chunk a rebuild prefills
            its kept past in, evicting after each (0: at once).
        pin_first_turn: the first turn joins the base layer (never windowed out).

    Raises:
        ValueError: for a budget below 16 tokens, an unknown policy, negative recent or
            non-positive observation tokens, negative rebuild chunk tokens, or (under
            `attention` or `agnostic`) a recent window not below the budget.
    """

    context_budget_tokens: int | None
    window_policy: WindowPolicyName
    window_budget_allocation: BudgetAllocation
    window_recent_tokens: int
    window_observation_tokens: int
    window_rebuild_chunk_tokens: int
    pin_first_turn: bool

    def __post_init__(self) -> None:
        _check_each(self)
        budget = self.context_budget_tokens
        if (
            self.window_policy in ("attention", "agnostic")
            and budget is not None
            and self.window_recent_tokens >= budget
        ):
            raise ValueError(
                f"window_recent_tokens must be below context_budget_tokens ({budget}), got {self.window_recent_tokens}"
            )

    def budget_tokens(self, max_context_tokens: int) -> int:
        """The window in tokens for a model of `max_context_tokens` positions.

        Raises:
            ValueError: if `context_budget_tokens` exceeds the model's context.
        """
        budget = self.context_budget_tokens or int(max_context_tokens * DEFAULT_CONTEXT_SHARE)
        if budget > max_context_tokens:
            raise ValueError(
                f"context_budget_tokens={budget} exceeds the model's context ({max_context_tokens} tokens)"
            )
        return budget


@dataclass(frozen=True)
class TierConfig:
    """Where session caches live and in what form (`cache.tier_manager.TierManager`, the sealer,
    the prefix pool).

    Attributes:
        device_budget_bytes, host_budget_bytes, disk_budget_bytes: KV bytes each tier may hold.
        tenant_device_quota_bytes: most device-tier bytes one tenant's idle sessions may hold.
        persist: `write_back` (sealed to disk after each turn, in the background) or `on_evict`.
        offload_precision: precision of turn layers in the host and disk tiers (`exact`, `int8`, `int4`).
        quant_residual_tokens: most recent tokens kept in full precision when quantised.
        share_base: share a tenant's base layers (system prompts) through the prefix pool.

    Raises:
        ValueError: for a missing or non-positive budget, a tenant quota above the device budget,
            an unknown persist mode or precision, negative residual tokens.
    """

    device_budget_bytes: int
    host_budget_bytes: int
    disk_budget_bytes: int
    tenant_device_quota_bytes: int
    persist: PersistMode
    offload_precision: Precision
    quant_residual_tokens: int
    share_base: bool

    def __post_init__(self) -> None:
        budgets = ("device_budget_bytes", "host_budget_bytes", "disk_budget_bytes", "tenant_device_quota_bytes")
        _check_each(self, required=budgets)
        if self.tenant_device_quota_bytes > self.device_budget_bytes:
            raise ValueError(
                f"tenant_device_quota_bytes must be in 1..device_budget_bytes ({self.device_budget_bytes}), "
                f"got {self.tenant_device_quota_bytes}"
            )

    @property
    def write_back(self) -> bool:
        """Caches are sealed and written to disk after each turn (`persist == "write_back"`)."""
        return self.persist == "write_back"


@dataclass(frozen=True)
class RedisConfig:
    """The KV tier replicas share (`sessions.replicas.startup.open_shared_store`).

    Attributes:
        redis_url: `redis://...` or `rediss://...` (TLS).
        redis_cluster: `redis_url` names a node of a Redis Cluster.
        redis_ttl_s: each blob expires this long after it was written.
        redis_budget_bytes: most bytes of blobs in Redis, oldest dropped first; `None`: the TTL bounds it.
        redis_prefix: first part of every key (several deployments can share one Redis).

    Raises:
        ValueError: for a URL that is not `redis(s)://`, a TTL outside [1 s, 100 years], a
            non-positive budget, a prefix that is not 1-32 of `A-Z a-z 0-9 _ . -`.
    """

    redis_url: str
    redis_cluster: bool
    redis_ttl_s: float
    redis_budget_bytes: int | None
    redis_prefix: str

    def __post_init__(self) -> None:
        _check_each(self, required=("redis_url",))


@dataclass(frozen=True)
class ReplicaConfig:
    """This replica's identity and ownership leases (`sessions.replicas.startup`, `sessions.replicas.ownership`).

    Attributes:
        replica_id: the id set in the settings, else `None` (one is generated once and kept in
            `replica_id_file`).
        replica_id_file: the home's file keeping a generated id.
        replica_url: the URL other replicas send clients to; `None`: the address `chatkv serve` listens on.
        ownership_lease_s: a session's lease, renewed every third of it while the replica lives.
        ownership_wait_s: how long a turn waits for another replica to hand its session over.
        ownership_idle_s: a session idle this long is published to Redis and its lease given up.
        routing: `forward` a turn to its session's live owner, or `handover` (the owner releases it).
        forward_queue_limit: an owner with more turns waiting in its engine queue is not forwarded
            to (the session is handed over).

    Raises:
        ValueError: for a malformed id or URL, or a duration out of its range, naming the setting.
    """

    replica_id: str | None
    replica_id_file: Path
    replica_url: str | None
    ownership_lease_s: float
    ownership_wait_s: float
    ownership_idle_s: float
    routing: RoutingMode
    forward_queue_limit: int

    def __post_init__(self) -> None:
        _check_each(self, required=("replica_id_file",))
