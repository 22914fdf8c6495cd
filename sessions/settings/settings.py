"""Settings of a chatkv process: every field's default is the environment variable `CHATKV_<FIELD>`
when it is set (`CHATKV_DATABASE_URL`, `CHATKV_DEVICE_BUDGET_BYTES`, ...), else the default declared
below; keyword arguments win over both. So `Settings()`, `Settings.from_env()` and
`SessionManager()` all read the same environment, and a worker started with `CHATKV_DATABASE_URL`
uses that database whichever way it builds its settings.

Settings live in `sessions/` (not `app/`) because `SessionManager` takes them and dependencies point
`app -> sessions`. Byte sizes accept plain integers or units (`512MiB`, `2GB`); durations accept
seconds or `30m`, `12h`, `7d`; booleans `1/0`, `true/false`, `yes/no`, `on/off`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import platformdirs

from sessions.engine.config import SchedulerConfig
from sessions.settings.checks import (
    BudgetAllocation,
    DtypeSetting,
    PersistMode,
    Precision,
    RoutingMode,
    WindowPolicyName,
    check_field,
)
from sessions.settings.configs import ModelConfig, RedisConfig, ReplicaConfig, TierConfig, WindowConfig
from sessions.settings.parsing import env_variable, parse_field

REPLICA_ID_FILE = "replica.id"
"""File in the home that keeps a replica's generated id (`sessions.replicas.startup.replica_id_for`)."""

DEFAULT_MODEL = "default"
"""`Settings.model` value naming the bundled SmolLM2-135M-Instruct."""
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
"""The display name of the `DEFAULT_MODEL`."""


def total_memory_bytes() -> int:
    """The machine's RAM in bytes (8 GiB where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def default_home() -> Path:
    """`$CHATKV_HOME`, else the per-user data directory (`~/.local/share/chatkv` on Linux)."""
    env = os.environ.get("CHATKV_HOME")
    return Path(env) if env else _user_data_home()


def _user_data_home() -> Path:
    return Path(platformdirs.user_data_dir("chatkv", appauthor=False))


def default_model_cache_dir() -> Path:
    """The per-user cache directory every home shares (`~/.cache/chatkv/models` on Linux, under
    `$XDG_CACHE_HOME` when set): one converted copy of a model per machine and user."""
    return Path(platformdirs.user_cache_dir("chatkv", appauthor=False)) / "models"


_Cls = TypeVar("_Cls", bound=type)
_DECLARED_DEFAULTS: dict[str, Callable[[], Any]] = {}
"""Field name -> its declared default (what applies when `CHATKV_<FIELD>` is not set)."""


def _defaults_from_env(cls: _Cls) -> _Cls:
    """Give every field of `cls` the default `_from_env(name, declared default)`: the parsed
    `CHATKV_<FIELD>` when set, else the declared default. Applied before `@dataclass`, which then
    builds `__init__` with these default factories (so an explicit argument never reads the
    environment)."""
    for name in cls.__annotations__:
        declared = cls.__dict__[name]
        spec: Field[Any] = declared if isinstance(declared, Field) else field(default=declared)
        if spec.default_factory is not MISSING:
            fallback: Callable[[], Any] = spec.default_factory
        else:
            fallback = partial(_identity, spec.default)
        _DECLARED_DEFAULTS[name] = fallback
        spec.default, spec.default_factory = MISSING, partial(_from_env, os.environ, name, fallback)
        setattr(cls, name, spec)
    return cls


def _identity(value: Any) -> Any:
    return value


def _from_env(environ: Mapping[str, str], name: str, fallback: Callable[[], Any]) -> Any:
    """Field `name` from `environ`'s `CHATKV_<FIELD>` (unset or empty: `fallback()`).

    Raises:
        ValueError: naming the variable, for a value that does not parse or is out of range.
    """
    variable = env_variable(name)
    raw = environ.get(variable)
    if raw is None or raw == "":
        return fallback()
    try:
        value = parse_field(name, raw)
        check_field(name, value)
    except ValueError as exc:
        raise ValueError(f"{variable}: {exc}") from None
    return value


@dataclass(frozen=True)
@_defaults_from_env
class Settings:
    """Configuration of one `SessionManager`. Each field defaults to `CHATKV_<FIELD>` when that
    environment variable is set (see the module docstring); keyword arguments win.

    Budgets are bytes of KV cache (keys and values of every model layer, plus quantisation scales).
    `None` budgets are derived from the machine in `__post_init__`: device and host 25% of RAM each,
    disk 25% of the free space under `home` capped at 64 GiB. On CUDA a derived device budget (and a
    derived tenant quota) is replaced once the model is loaded by the GPU's free memory less a
    headroom (`sessions.device_defaults`; `derived_budgets` names the derived ones).

    Raises:
        ValueError: for impossible values (non-positive budgets, a tenant quota above the device
            budget, an unknown precision or persist mode), naming the field and the value; for a
            `CHATKV_<FIELD>` value, naming the variable.
    """

    home: Path = field(default_factory=_user_data_home)
    model: str = DEFAULT_MODEL
    """`"default"` for the bundled SmolLM2-135M-Instruct, a local Hugging Face model directory, a
    `.gguf` file (converted once into the model cache), or a hub id such as
    `HuggingFaceTB/SmolLM2-360M-Instruct` (loaded through transformers' download and cache)."""
    model_cache_dir: Path | None = None
    """Where converted models are kept (the bundled GGUF as safetensors), shared by every home on
    the machine; default `~/.cache/chatkv/models` (`default_model_cache_dir`). Set it per home to
    keep a home's own copy."""
    database_url: str | None = None
    """SQLAlchemy URL; default SQLite at `home/chatkv.db`."""
    device: str = "auto"
    """torch device for the model and the `device` tier; `auto` picks CUDA when available, else CPU."""
    dtype: DtypeSetting = "auto"
    """The model's precision: `auto` (bfloat16 on CUDA, float16 on GPUs without bfloat16, float32
    on a CPU), `float32`, `bfloat16` or `float16`."""
    threads: int | None = None
    """torch intra-op threads; `None` keeps torch's default."""

    device_budget_bytes: int | None = None
    host_budget_bytes: int | None = None
    disk_budget_bytes: int | None = None
    tenant_device_quota_bytes: int | None = None
    """Most device-tier bytes one tenant's idle sessions may hold; default the whole device budget."""
    persist: PersistMode = "write_back"
    """`write_back`: after each turn the cache is sealed and written to disk in the background, so
    eviction of a persisted session is instant and a crash loses no cache. `on_evict`: written only
    when the cache leaves the host tier (and at `close()`)."""
    master_key: str | None = field(default=None, repr=False)
    """Base64 of 32 bytes; default `$CHATKV_MASTER_KEY`, else a key file created in `home`."""

    context_budget_tokens: int | None = None
    """Per-session context window in tokens; default 80% of the model's `max_position_embeddings`."""
    window_policy: WindowPolicyName = "turns"
    """What goes when a turn would exceed the context budget: `turns` (exact per layer: whole
    oldest unpinned turns), `attention` (lossy: each KV head evicts the tokens of unpinned turns
    that the new turn's last queries attend to least, SnapKV-style) or `agnostic` (lossy: the same
    eviction by scores fixed when the earlier turns committed, whatever is asked next: KVzip's
    reconstruction of each turn's ids, one extra prefill per turn after its reply;
    docs/architecture.md)."""
    window_budget_allocation: BudgetAllocation = "per_head"
    """Under `attention` and `agnostic`, how an eviction spends the kept tokens over KV heads:
    `per_head` (default; Ada-KV: a layer's heads share its budget by score, stored ragged, the
    same bytes) or `uniform` (every head keeps the same count of each turn)."""
    window_recent_tokens: int = 64
    """Under `attention` and `agnostic`, the most recent tokens of a session never evicted (below
    the budget)."""
    window_observation_tokens: int = 32
    """Under `attention`, queries at the end of each turn's prefill whose attention scores the cache."""
    window_rebuild_chunk_tokens: int = 0
    """Under `attention` and `agnostic`, > 0: a rebuild (no stored cache, or positions past the
    model's limit) prefills the kept past (down to 1.5x the budget) in chunks of this many tokens
    (128 is a sane size), evicting down to the budget after each, so it holds at most the budget
    plus a chunk. 0 (default, the better replies in benchmarks/window_rebuild.py): `attention`
    prefills the past down to 1.25x the budget at once and evicts by the new turn's queries;
    `agnostic` drops whole oldest turns."""
    pin_first_turn: bool = False
    share_base: bool = True
    """Share the base layer (system prompt) of a tenant's sessions through the prefix pool."""
    offload_precision: Precision = "exact"
    """Precision of turn layers held in the host and disk tiers; the base layer stays exact."""
    quant_residual_tokens: int = 32
    """Most recent tokens of a session kept in full precision when turn layers are quantised (KIVI)."""

    max_step_tokens: int = 256
    """Tokens per engine step (one forward pass): every running decode's next token plus chunks of
    pending prefills."""
    max_prefill_tokens: int = 32
    """Prefill tokens per engine step, of all prefilling turns together, split max-min fairly over
    their tenants (0: only `max_step_tokens`). Bounds how long a long prefill holds every other turn
    back, an arriving one included (on a CPU a step costs about its token count); raise it on a GPU."""
    max_running_requests: int = 32
    """Turns holding a working KV buffer at once; more wait in the queue."""
    max_running_per_tenant: int = 0
    """Running turns one tenant may have (0: `max_running_requests`)."""
    max_batch_requests: int = 0
    """Turns per forward pass (0: every running turn). 1 turns batching off (turns take turns)."""

    restore_or_recompute: bool = True
    """For a cache in a lower tier, take the cheaper of restoring it and prefilling its tokens
    again, from measured rates (`sessions.turn.costs`); off, a stored cache is always restored
    (tests and benchmarks that measure the tiers themselves turn it off)."""
    fork_sessions: bool = True
    """A posted history that a session holds but is not its whole history (regenerate, edit,
    retry) forks that session, warm from its KV; off, it starts a new session that prefills it (a
    baseline for `benchmarks/chat_trace.py`)."""
    reuse_kv: bool = True
    """Continue each session from its cache. Off, every turn re-prefills the whole conversation
    (the rebuild path, without the prefix pool) and no cache is kept: a baseline for benchmarks
    (`benchmarks/http_multiturn.py`), not a mode to serve in."""
    max_concurrent_requests_per_tenant: int = 16
    """Requests one tenant may have in flight on the `/v1/` API at once; more are answered 429."""

    admin_token: str | None = field(default=None, repr=False)
    session_retention_s: float | None = None
    """Sessions idle longer than this are removed by `gc`; `None` keeps them forever."""
    implicit_retention_s: float = 30 * 86400.0
    """Sessions made for a posted history (stateless clients) and forks nobody continued expire
    after this long idle (a sliding TTL, OpenAI's 30 days for stored responses by default); a
    tenant may have its own (`chatkv tenants retention`). Explicit and named sessions are kept."""
    metrics_tenant_labels: bool = False
    """Label per-tenant metrics with the tenant id (only when the number of tenants is bounded)."""

    redis_url: str | None = None
    """The KV tier replicas share: `redis://host:6379/0` (`rediss://` with TLS). Each session's cache
    is published there, sealed, so another replica can restore it (docs/replicas.md)."""
    redis_cluster: bool = False
    """`redis_url` names a node of a Redis Cluster (redis-py's cluster client)."""
    redis_ttl_s: float = 7 * 86400.0
    """Each blob in Redis expires this long after it was written."""
    redis_budget_bytes: int | None = None
    """Most bytes of blobs in Redis (by the `cache_blobs` rows), oldest dropped first; `None`: the TTL
    (and Redis's own `maxmemory`) bound it."""
    redis_prefix: str = "chatkv"
    """First part of every Redis key (several deployments can share one Redis)."""
    replica_id: str | None = None
    """This replica's id in the shared database; default one generated once and kept in
    `home/replica.id`."""
    replica_url: str | None = None
    """The URL other replicas' clients are sent to for sessions this replica owns; default the
    address `chatkv serve` listens on."""
    ownership_lease_s: float = 15.0
    """A session's ownership lease: renewed every third of it while the replica lives; a dead
    replica's sessions are taken over this long after its last renewal."""
    ownership_wait_s: float = 10.0
    """How long a turn waits for another replica to hand its session over before it is refused
    (HTTP 409 with the owner's URL)."""
    ownership_idle_s: float = 30.0
    """A session idle this long is published to Redis and its lease given up."""
    routing: RoutingMode = "forward"
    """A turn for a session another live replica owns: `forward` it to the owner and stream its
    answer back (the KV stays where it is), or `handover` (the owner publishes the session to Redis
    and releases it, this replica restores it). Forwarding hands over too when the owner is
    draining, silent or over `forward_queue_limit`, or cannot be reached (docs/replicas.md)."""
    forward_queue_limit: int = 32
    """Turns waiting in an owner's engine queue (its last heartbeat) above which a turn is not
    forwarded to it: the session is handed over instead."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "home", Path(self.home).expanduser())
        if self.model_cache_dir is not None:
            object.__setattr__(self, "model_cache_dir", Path(self.model_cache_dir).expanduser())
        for f in fields(self):
            check_field(f.name, getattr(self, f.name))
        # The sub-configs check what spans fields: built here, so a bad combination fails at once.
        self.scheduler_config()
        self.window_config()
        self._derive_budgets()
        self.tier_config()

    def _derive_budgets(self) -> None:
        budgets = ("device_budget_bytes", "host_budget_bytes", "disk_budget_bytes", "tenant_device_quota_bytes")
        # Not a field (equality, `replace` and the environment ignore it): which budgets the
        # composition root may still set from the device it finds (a GPU's free memory).
        object.__setattr__(self, "_derived_budgets", frozenset(n for n in budgets if getattr(self, n) is None))
        ram = total_memory_bytes()
        defaults = {
            "device_budget_bytes": ram // 4,
            "host_budget_bytes": ram // 4,
            "disk_budget_bytes": self._default_disk_budget(),
        }
        for name, default in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        if self.host_budget_bytes is not None and self.host_budget_bytes > ram:
            raise ValueError(f"host_budget_bytes={self.host_budget_bytes} exceeds this machine's memory ({ram} bytes)")
        if self.tenant_device_quota_bytes is None:
            object.__setattr__(self, "tenant_device_quota_bytes", self.device_budget_bytes)

    def _default_disk_budget(self) -> int:
        probe = self.home
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            free = shutil.disk_usage(probe).free
        except OSError:
            free = 4 * 2**30
        return max(2**28, min(free // 4, 64 * 2**30))

    def _resolved_bytes(self, name: str) -> int:
        value = getattr(self, name)
        if value is None:
            raise RuntimeError(f"bug: {name} is still None after __post_init__ derived it")
        return int(value)

    # -- sub-configs: the groups of fields one part of chatkv consumes together -------------------

    def scheduler_config(self) -> SchedulerConfig:
        """The engine loop's limits from these settings."""
        return SchedulerConfig(
            max_step_tokens=self.max_step_tokens,
            max_prefill_tokens=self.max_prefill_tokens,
            max_running_requests=self.max_running_requests,
            max_running_per_tenant=self.max_running_per_tenant,
            max_batch_requests=self.max_batch_requests,
        )

    def model_config(self) -> ModelConfig:
        """Which model to load, where and how (the model cache directory resolved)."""
        return ModelConfig(
            model=self.model,
            model_cache_dir=self.resolved_model_cache_dir,
            device=self.device,
            dtype=self.dtype,
            threads=self.threads,
        )

    def window_config(self) -> WindowConfig:
        """What a session keeps in its attention window."""
        return WindowConfig(
            context_budget_tokens=self.context_budget_tokens,
            window_policy=self.window_policy,
            window_budget_allocation=self.window_budget_allocation,
            window_recent_tokens=self.window_recent_tokens,
            window_observation_tokens=self.window_observation_tokens,
            window_rebuild_chunk_tokens=self.window_rebuild_chunk_tokens,
            pin_first_turn=self.pin_first_turn,
        )

    def tier_config(self) -> TierConfig:
        """Tier budgets (derived ones filled in), persistence, offload precision, base sharing."""
        return TierConfig(
            device_budget_bytes=self._resolved_bytes("device_budget_bytes"),
            host_budget_bytes=self._resolved_bytes("host_budget_bytes"),
            disk_budget_bytes=self._resolved_bytes("disk_budget_bytes"),
            tenant_device_quota_bytes=self._resolved_bytes("tenant_device_quota_bytes"),
            persist=self.persist,
            offload_precision=self.offload_precision,
            quant_residual_tokens=self.quant_residual_tokens,
            share_base=self.share_base,
        )

    def redis_config(self) -> RedisConfig | None:
        """The shared KV tier, or `None` when `redis_url` is not set."""
        if self.redis_url is None:
            return None
        return RedisConfig(
            redis_url=self.redis_url,
            redis_cluster=self.redis_cluster,
            redis_ttl_s=self.redis_ttl_s,
            redis_budget_bytes=self.redis_budget_bytes,
            redis_prefix=self.redis_prefix,
        )

    def replica_config(self) -> ReplicaConfig:
        """This replica's id, URL and ownership leases (used in `replica_mode` only)."""
        return ReplicaConfig(
            replica_id=self.replica_id,
            replica_id_file=self.home / REPLICA_ID_FILE,
            replica_url=self.replica_url,
            ownership_lease_s=self.ownership_lease_s,
            ownership_wait_s=self.ownership_wait_s,
            ownership_idle_s=self.ownership_idle_s,
            routing=self.routing,
            forward_queue_limit=self.forward_queue_limit,
        )

    # -- derived values --------------------------------------------------------------------------

    @property
    def derived_budgets(self) -> frozenset[str]:
        """The budget fields that were not given (derived from the machine in `__post_init__`)."""
        derived: frozenset[str] = getattr(self, "_derived_budgets", frozenset())
        return derived

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'chatkv.db'}"

    @property
    def resolved_model_cache_dir(self) -> Path:
        return self.model_cache_dir or default_model_cache_dir()

    @property
    def replica_mode(self) -> bool:
        """Several replicas may share this database: a shared database (anything but SQLite) or a
        shared KV tier. Turns then take the session's ownership lease (`sessions/replicas/ownership.py`)."""
        return self.redis_url is not None or not self.resolved_database_url.startswith("sqlite")

    def disk_location(self) -> str:
        """The `cache_blobs` location of this home's disk tier, read without creating anything:
        the replica id in replica mode (if one was ever made), else `""` (a single process)."""
        if not self.replica_mode:
            return ""
        if self.replica_id:
            return self.replica_id
        path = self.home / REPLICA_ID_FILE
        return path.read_text().strip() if path.is_file() else ""

    @property
    def blob_dir(self) -> Path:
        return self.home / "blobs"

    def with_overrides(self, **changes: Any) -> Settings:
        """A copy with some fields changed (validated again); `None` values are ignored."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from `CHATKV_<FIELD>` variables of `environ`, then `overrides` (keyword
        arguments that are not `None`). With the process environment (the default) this equals
        `Settings(**overrides)`; pass `environ` to read another mapping instead (only that one).

        Raises:
            ValueError: naming the variable whose value does not parse or is out of range.
        """
        env = os.environ if environ is None else environ
        given = {k: v for k, v in overrides.items() if v is not None}
        read = {
            name: _from_env(env, name, default) for name, default in _DECLARED_DEFAULTS.items() if name not in given
        }
        return cls(**read, **given)
