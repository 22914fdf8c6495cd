"""The composition root: every object of a `SessionManager`, built once from its settings and
wired together here, so that each object takes what it needs as arguments and none reaches into
another (`SessionManager` is the thin front over them).

    database  -> metadata store, idempotency keys, stored responses
    engine    (the model and its loop; loaded unless given)
    keys      (tenants' data keys under the master key)
    replicas  (id; leases started last, once the tiers they publish through exist)
    tiers     <- sealer (keys, engine), host/disk/redis stores (database)
    registry  (records, torch-free)  ->  tenants, catalogue, turns  <- runner (engine, template, tiers)

`close_parts` takes them down in the reverse order of what depends on what.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace

import torch
from sqlalchemy import Engine as Database

from cache.budgets import TierBudgets
from cache.ids import PrefixKey, SessionId, TenantId
from cache.prefix_pool import PrefixPool
from cache.session_cache import BaseLayer
from cache.tier_manager import LeaseHeld, TierManager
from cache.tiers import CacheKey, Tier
from cache.window_policy import WindowPolicy
from sessions import startup_log
from sessions.catalogue import SessionCatalogue
from sessions.conversations import ConversationRecords
from sessions.device_defaults import default_device_budget_bytes, probe_device, resolve_dtype
from sessions.engine import Engine
from sessions.errors import ModelUnavailable, SessionBusy
from sessions.forks import Forks
from sessions.idempotency import IdempotentRequests
from sessions.metrics import Metrics
from sessions.model_cache import old_home_copy
from sessions.model_source import load_model
from sessions.offload import EncryptedCacheSealer, SharedBlobStore, TierBlobStore, max_payload_bytes
from sessions.registry import Registry, TenantRef
from sessions.replicas.role import Replicas
from sessions.replicas.startup import open_shared_store, replica_id_for, start_ownership
from sessions.responses import ResponseRecords
from sessions.retention import Retention
from sessions.settings import ModelConfig, Settings, TierConfig
from sessions.settings.settings import total_memory_bytes
from sessions.tenants import Tenants
from sessions.transcripts import Transcripts
from sessions.turn.chat_template import ChatTemplate
from sessions.turn.preparer import NO_REUSE, KvReuse, TurnPreparer
from sessions.turn.runner import TurnRunner
from sessions.turn_door import TurnDoor
from sessions.turn_service import TurnService
from storage.atomic_files import remove_temp_files
from storage.blob_stores import DiskBlobStore, HostBlobStore
from storage.database import open_database, upgrade
from storage.history_store import HistoryStore
from storage.keyring import TenantKeys, load_master_key
from storage.metadata_store import MetadataStore
from storage.replica_store import ReplicaStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ApiRecords:
    """What the HTTP APIs keep beside sessions: services of their own, handed to the faces
    (`sessions.Services`) rather than reached through the manager."""

    responses: ResponseRecords
    conversations: ConversationRecords
    idempotency: IdempotentRequests


@dataclass(frozen=True, slots=True)
class HistoryParts:
    """The parts that find sessions by posted histories, fork them, plan turns and expire them."""

    history: HistoryStore
    forks: Forks
    door: TurnDoor
    retention: Retention


@dataclass(frozen=True, slots=True)
class ManagerParts:
    """The objects of one manager (see the module docstring)."""

    settings: Settings
    database: Database
    metadata: MetadataStore
    engine: Engine
    owns_engine: bool
    """Whether `assemble` loaded the engine (closed with the parts) or was handed it (shared: it
    outlives the manager)."""
    context_budget_tokens: int
    keys: TenantKeys
    metrics: Metrics
    disk_store: DiskBlobStore[CacheKey]
    shared_store: SharedBlobStore | None
    sealer: EncryptedCacheSealer
    tiers: TierManager
    template: ChatTemplate
    runner: TurnRunner
    transcripts: Transcripts
    registry: Registry
    replicas: Replicas
    tenants: Tenants
    catalogue: SessionCatalogue
    turns: TurnService
    histories: HistoryParts
    records: ApiRecords

    def tiers_key(self, tenant: TenantRef, session_id: str) -> CacheKey:
        """The tier manager's key of the tenant's session."""
        return CacheKey.for_session(self.registry.tenant_id(tenant), SessionId(str(session_id)))


def assemble(settings: Settings, engine: Engine | None = None) -> ManagerParts:
    """Build every part of a manager on `settings.home` (migrating its database, reconciling its
    disk tier, registering it as a replica when it is one).

    Raises:
        ModelUnavailable: if the model cannot be loaded (or its device is not on this machine).
        ValueError: for settings that cannot work with this model (a window above its context).
    """
    # One straight line in dependency order (the module docstring's picture), over 60 lines:
    # split further, the pieces would only hand the same dozen parts to each other.
    started = time.perf_counter()
    model = settings.model_config()
    if model.threads:
        torch.set_num_threads(model.threads)
    with startup_log.step(
        "database %s: bringing its schema up to date", startup_log.safe_url(settings.resolved_database_url)
    ):
        database = open_database(settings.resolved_database_url)
        upgrade(settings.resolved_database_url, database)
    metadata = MetadataStore(database)
    owns_engine = engine is None
    if engine is None:
        engine = _load_engine(model)
    engine.loop.configure(settings.scheduler_config())
    old_copy = old_home_copy(settings.home, model.model_cache_dir)
    if old_copy is not None:
        log.info(
            "%s holds a model copy from before the shared model cache (%s); it can be deleted",
            old_copy,
            model.model_cache_dir,
        )
    window = settings.window_config()
    tier_config = _device_tier_config(settings, engine)
    budget = window.budget_tokens(engine.max_context_tokens)
    startup_log.budgets(tier_config, settings.derived_budgets)
    startup_log.window(window, budget, engine.max_context_tokens, engine.loop.config)
    keys = _tenant_keys(settings, metadata)
    replica_config = settings.replica_config()
    replicas = Replicas(
        replica_id_for(replica_config) if settings.replica_mode else None,
        settings.replica_url,
        forward=replica_config.routing == "forward",
        forward_queue_limit=replica_config.forward_queue_limit,
    )
    metrics = Metrics(tenant_labels=settings.metrics_tenant_labels, replica=replicas.replica_id)
    disk_store: DiskBlobStore[CacheKey] = DiskBlobStore(
        settings.blob_dir,
        metadata,
        engine.fingerprint,
        lambda t, n: CacheKey(TenantId(t), n),  # session and base-layer blobs alike
        location=replicas.replica_id or "",
    )
    startup_log.redis_tier(settings.redis_config())
    shared_store = open_shared_store(settings.redis_config(), metadata, engine.fingerprint)
    sealer = EncryptedCacheSealer(
        keys,
        engine.fingerprint,
        engine.device,
        tier_config.offload_precision,
        tier_config.quant_residual_tokens,
        windows=engine.layout.windows,
        max_payload_bytes=max_payload_bytes(engine.max_context_tokens, engine.layout),
    )
    tiers = _tier_manager(tier_config, engine, sealer, disk_store, shared_store, metrics, replicas)
    remove_temp_files(settings.home)
    template = ChatTemplate(engine.tokenizer, engine.stop_token_ids)
    # `reuse_kv` off is the benchmarks' stateless baseline: a policy of its own, not a flag.
    reuse = KvReuse(restore_or_recompute=settings.restore_or_recompute) if settings.reuse_kv else NO_REUSE
    preparer = TurnPreparer(
        engine=engine,
        template=template,
        tiers=tiers,
        window=WindowPolicy(
            budget,
            policy=window.window_policy,
            allocation=window.window_budget_allocation,
            recent_tokens=window.window_recent_tokens,
            observation_tokens=window.window_observation_tokens,
            rebuild_chunk_tokens=window.window_rebuild_chunk_tokens,
        ),
        share_base=tier_config.share_base,
        reuse=reuse,
    )
    runner = TurnRunner(engine=engine, tiers=tiers, preparer=preparer)
    metrics.watch_tiers(tiers.usage)
    metrics.watch_engine(engine.loop.stats, runner.preparing_by_tenant)
    engine.loop.add_observer(metrics)
    transcripts = Transcripts(metadata, engine.tokenizer)
    registry = Registry(metadata, placement=lambda t, s: _tier_name(tiers.placement(CacheKey.for_session(t, s))))

    def forget_caches(tenant_id: TenantId) -> None:
        runner.cancel_requests(tenant_id)
        tiers.forget_tenant(tenant_id)
        transcripts.drop_tenant(tenant_id)

    tenants = Tenants(
        registry=registry,
        metadata=metadata,
        keys=keys,
        database=database,
        home=settings.home,
        forget_caches=forget_caches,
        remove_files=disk_store.remove_tenant_folder,
    )
    catalogue = SessionCatalogue(
        registry=registry,
        metadata=metadata,
        tiers=tiers,
        transcripts=transcripts,
        runner=runner,
        template=template,
        tokenizer=engine.tokenizer,
        replicas=replicas,
        fingerprint=engine.fingerprint,
        max_context_tokens=engine.max_context_tokens,
        context_budget_tokens=budget,
        pin_first_turn=window.pin_first_turn,
    )
    turns = TurnService(
        registry=registry,
        metadata=metadata,
        tiers=tiers,
        transcripts=transcripts,
        runner=runner,
        replicas=replicas,
        metrics=metrics,
        fingerprint=engine.fingerprint,
        reuse=reuse,
    )
    # Stored responses and conversations: each may keep a session the other let go of.
    conversations = ConversationRecords(
        database, release_session=lambda tenant_id, session_id: responses.release_session(tenant_id, session_id)
    )
    responses = ResponseRecords(database, delete_session=catalogue.delete, held_by_conversation=conversations.holds)
    idempotency = IdempotentRequests(
        database, incarnation=lambda: replicas.incarnation, live_within_s=replica_config.ownership_lease_s
    )
    history = HistoryStore(database)
    forks = Forks(
        registry=registry,
        history=history,
        tiers=tiers,
        transcripts=transcripts,
        template=template,
        replicas=replicas,
        metrics=metrics,
    )
    door = TurnDoor(
        history=history,
        registry=registry,
        tiers=tiers,
        forks=forks,
        fork_histories=settings.fork_sessions,
        open_session=catalogue.open,
        delete_session=catalogue.delete,
        responses=responses,
        conversations=conversations,
        replicas=replicas,
        metrics=metrics,
    )
    retention = Retention(
        history=history,
        delete=catalogue.delete,
        last_active=registry.last_active,
        default_retention_s=settings.implicit_retention_s,
        hold=lambda tenant_id, session_id: _idle(tiers, CacheKey.for_session(tenant_id, session_id)),
    )
    parts = ManagerParts(
        settings=settings,
        database=database,
        metadata=metadata,
        engine=engine,
        owns_engine=owns_engine,
        context_budget_tokens=budget,
        keys=keys,
        metrics=metrics,
        disk_store=disk_store,
        shared_store=shared_store,
        sealer=sealer,
        tiers=tiers,
        template=template,
        runner=runner,
        transcripts=transcripts,
        registry=registry,
        replicas=replicas,
        tenants=tenants,
        catalogue=catalogue,
        turns=turns,
        histories=HistoryParts(history, forks, door, retention),
        records=ApiRecords(responses, conversations, idempotency),
    )
    if replicas.replica_id is not None:
        invalidate = _local_invalidation(transcripts, tiers)

        def queued_turns() -> int:
            return sum(engine.loop.stats().waiting.values())

        replicas.start(
            start_ownership(
                replica_config, ReplicaStore(database), replicas.replica_id, tiers, invalidate, queued_turns
            )
        )
    startup_log.ready(started)
    return parts


def _load_engine(model: ModelConfig) -> Engine:
    """The engine of `model` (its device and dtype resolved for this machine), logged as it loads."""
    device = resolve_device(model.device)
    dtype = resolve_dtype(model.dtype, probe_device(device, total_memory_bytes()))
    loading = startup_log.model_loading(model.model, device, dtype)
    engine = Engine(load_model(model.model, model.model_cache_dir, device, dtype))
    startup_log.model_loaded(engine, loading)
    return engine


@contextmanager
def _idle(tiers: TierManager, key: CacheKey) -> Iterator[None]:
    """The session's tier lease, so no turn of this process runs on it meanwhile (a turn on
    another replica meets its commit fence). Raises `SessionBusy` while a turn is in flight."""
    with ExitStack() as held:
        try:
            held.enter_context(tiers.lease(key))
        except LeaseHeld:  # raised on entering, never by the body
            raise SessionBusy(f"session {key.name} has a turn in flight") from None
        yield


def close_parts(parts: ManagerParts, lease_wait_s: float) -> None:
    """Stop a manager's parts once its turns were cancelled: wait up to `lease_wait_s` for them to
    let go of their sessions, hand sessions over (replicas), persist caches to disk (a restart
    resumes warm), stop the write-back, close the database; last, even if one of those failed,
    stop and join the engine loop if the manager loaded the engine (a shared one keeps serving
    its other users)."""
    try:
        if not parts.tiers.wait_for_leases(lease_wait_s):
            log.warning("turns still hold sessions %.0f s after close(); their caches are not persisted", lease_wait_s)
        parts.engine.loop.remove_observer(parts.metrics)
        parts.replicas.close()  # publishes the sessions it holds, so others take them at once
        parts.tiers.persist_all()
        parts.tiers.close()
        parts.database.dispose()
    finally:
        if parts.owns_engine:
            parts.engine.close()


def resolve_device(device: str) -> str:
    """The torch device for a `Settings.device` value. Raises `ModelUnavailable` for an
    accelerator this machine does not have."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        cpu_build = torch.version.cuda is None
        why = "a CPU build: `make run TORCH=cuda` installs the CUDA one" if cpu_build else "no GPU found"
        raise ModelUnavailable(
            f"device {device!r} asked for, but CUDA is not available on this machine (torch {torch.__version__}, {why})"
        )
    if device == "mps" and not torch.backends.mps.is_available():
        raise ModelUnavailable("device 'mps' asked for, but MPS is not available on this machine")
    return device


def _device_tier_config(settings: Settings, engine: Engine) -> TierConfig:
    """The tier budgets, with a derived device budget (and tenant quota) taken from the GPU's free
    memory now that the weights are on it (`sessions.device_defaults`); unchanged off CUDA or when
    the budget was given."""
    tier_config = settings.tier_config()
    derived = settings.derived_budgets
    if engine.device.type != "cuda" or "device_budget_bytes" not in derived:
        return tier_config
    facts = probe_device(str(engine.device), total_memory_bytes())
    budget = default_device_budget_bytes(facts)
    quota = budget if "tenant_device_quota_bytes" in derived else min(tier_config.tenant_device_quota_bytes, budget)
    log.info(
        "device KV budget %.1f GiB: %s's free memory (%.1f of %.1f GiB) less headroom; set CHATKV_DEVICE_BUDGET_BYTES "
        "to choose",
        budget / 2**30,
        engine.device,
        (facts.free_bytes or 0) / 2**30,
        (facts.total_bytes or 0) / 2**30,
    )
    return replace(tier_config, device_budget_bytes=budget, tenant_device_quota_bytes=quota)


def _tenant_keys(settings: Settings, metadata: MetadataStore) -> TenantKeys:
    in_use = {t.master_key_id for t in metadata.list_tenants() if t.master_key_id}
    keys = TenantKeys(metadata, load_master_key(settings.home, settings.master_key, in_use))
    where = "CHATKV_MASTER_KEY" if keys.master.from_env else str(settings.home / "master.key")
    startup_log.log.debug("master key id %s from %s; %d tenants' data keys wrapped", keys.master.id, where, len(in_use))
    if in_use and keys.master.id not in in_use:
        log.error(
            "the master key (id %s) did not wrap any tenant's data key (ids %s): stored caches cannot "
            "be opened and are rebuilt from transcripts; set CHATKV_MASTER_KEY to the right key",
            keys.master.id,
            ", ".join(sorted(in_use)),
        )
    return keys


def _tier_manager(
    config: TierConfig,
    engine: Engine,
    sealer: EncryptedCacheSealer,
    disk_store: DiskBlobStore[CacheKey],
    shared_store: SharedBlobStore | None,
    metrics: Metrics,
    replicas: Replicas,
) -> TierManager:
    """The tiers over the host, disk (and Redis) stores, with the disk blobs found at start-up."""

    def build_base(tenant_id: TenantId, key: PrefixKey, token_ids: tuple[int, ...]) -> BaseLayer:
        keys, values = engine.compute_prefix(token_ids)
        return BaseLayer(key, token_ids, keys, values)

    tiers = TierManager(
        pool=PrefixPool(),
        sealer=sealer,
        host=TierBlobStore(HostBlobStore[CacheKey]()),
        disk=TierBlobStore(disk_store),
        budgets=TierBudgets(
            device_bytes=config.device_budget_bytes,
            host_bytes=config.host_budget_bytes,
            disk_bytes=config.disk_budget_bytes,
            tenant_device_quota_bytes=config.tenant_device_quota_bytes,
        ),
        base_builder=build_base,
        write_back=config.write_back,
        events=metrics,
        shared=shared_store,
        may_publish=replicas.may_publish,
    )
    found = disk_store.reconcile()
    startup_log.disk_blobs(len(found), disk_store.root)
    tiers.adopt_disk_blobs(found)
    if disk_store.damaged_at_start:
        metrics.integrity_failures.labels(Tier.DISK.value).inc(disk_store.damaged_at_start)
    return tiers


def _local_invalidation(transcripts: Transcripts, tiers: TierManager) -> Callable[[CacheKey], None]:
    """What a replica drops when another replica moved a session on: its transcript and its
    local caches; a turn in flight here keeps its own (its commit fence decides)."""

    def invalidate(key: CacheKey) -> None:
        transcripts.drop(key.tenant_id, SessionId(key.name))
        try:
            tiers.forget_local(key)
        except LeaseHeld:
            log.debug("session %s: a local turn holds it; its stale copies are left to the fence", key.name)

    return invalidate


def _tier_name(tier: Tier | None) -> str | None:
    return tier.value if tier else None
