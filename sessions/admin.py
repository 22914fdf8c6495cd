"""Operator actions on one chatkv home, as JSON-ready dicts: what the admin CLI and the `/admin/`
routes share.

The server builds `AdminOps.of(manager)` over its live `SessionManager`, and its routes return these
dicts as they are; the CLI without `--server` builds `AdminOps.open_home(settings)` and prints the
same dicts. So a command gives the same answer whether it runs here or through a server.

Reads that need only the database (tenants, session listings, transcripts, stats, a `gc` dry run)
and setting a tenant's retention do not load the model, nor import torch: they go through the
registry (`sessions.registry`), the same object the manager reads through, so tenants and sessions
are found by the same rules either way; this module imports `sessions.manager` only where a manager
is needed. Anything touching caches, keys or the model loads a `SessionManager` on first use.
Without a live manager no cache is on the device or in host memory, so a session's tier is `disk`
when a cache blob row names it (the tier a manager adopts at start-up) and `None` otherwise; and the
turn counters (hit rate, prefill tokens, evictions) are those of the server process, so offline
`stats` leaves them out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from cache.ids import SessionId, TenantId
from sessions.errors import InvalidInput, ReplicaNotFound, SessionNotFound, TenantNotFound
from sessions.records import EVICT_TARGETS, TIERS
from sessions.registry import Placement, Registry
from sessions.retention import Retention, check_retention_s, expires_at
from sessions.settings import BUNDLED_MODEL_NAME, DEFAULT_MODEL, MAX_DURATION_S, Settings
from storage.database import open_database, upgrade
from storage.history_store import ExpiredSession, HistoryStore
from storage.metadata_store import MessageRecord, MetadataStore, SessionRecord, TenantRecord
from storage.replica_store import ReplicaStore

if TYPE_CHECKING:
    from sessions.catalogue import SessionDetail
    from sessions.manager import SessionManager

OFFLINE_STATS_NOTE = "turn counters are kept by the running server (use --server)"
SUMMARY_CHARS = 120

Json = dict[str, Any]


class AdminOps:
    """The admin operations over one home. Use `of` (a live manager) or `open_home` (a CLI process).

    Every method takes tenants by name or id and raises the `sessions.errors` types for bad input
    (another tenant's session id is `SessionNotFound`, as a missing one).
    """

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        load_manager: Callable[[], SessionManager],
        *,
        manager: SessionManager | None = None,
        owns_manager: bool,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.metadata = registry.metadata
        self._load_manager = load_manager
        self._manager = manager
        self._owns_manager = owns_manager

    @classmethod
    def of(cls, manager: SessionManager) -> AdminOps:
        """Operations over a live manager (the server's); `close` leaves it open."""
        return cls(manager.settings, manager.internals.registry, lambda: manager, manager=manager, owns_manager=False)

    @classmethod
    def open_home(cls, settings: Settings, load_manager: Callable[[], SessionManager] | None = None) -> AdminOps:
        """Operations on `settings.home` from this process: migrates the database to head (as a
        manager does at start-up) and loads a `SessionManager` only when an operation needs one."""
        url = settings.resolved_database_url
        db = open_database(url)
        upgrade(url, db)
        registry = Registry(MetadataStore(db))
        return cls(settings, registry, load_manager or (lambda: _new_manager(settings)), owns_manager=True)

    @property
    def manager(self) -> SessionManager:
        if self._manager is None:
            self._manager = self._load_manager()
        return self._manager

    def close(self) -> None:
        """Close a manager this object loaded (its caches persist to disk) and the database."""
        if self._owns_manager:
            if self._manager is not None:
                self._manager.close()
            self.metadata.database.dispose()

    def __enter__(self) -> AdminOps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- tenants -------------------------------------------------------------------------------

    def list_tenants(self) -> list[Json]:
        counts: dict[str, int] = {}
        for record in self.metadata.list_sessions():
            counts[record.tenant_id] = counts.get(record.tenant_id, 0) + 1
        return [_tenant_json(t, counts.get(t.id, 0)) for t in self.metadata.list_tenants()]

    def show_tenant(self, tenant: str) -> Json:
        """The tenant, its session count, tokens and sessions per tier."""
        record = self._tenant(tenant)
        sessions = self.list_sessions(tenant=record.id)
        per_tier = {tier: sum(1 for s in sessions if s["tier"] == tier) for tier in TIERS}
        return {
            **_tenant_json(record, len(sessions)),
            "default_implicit_retention_s": self.settings.implicit_retention_s,
            "tokens": sum(s["token_count"] for s in sessions),
            "sessions_by_tier": per_tier,
        }

    def set_tenant_retention(self, tenant: str, retention_s: float | None) -> Json:
        """Set the tenant's own idle TTL of implicit sessions and uncontinued forks, in seconds
        (`None`: back to `Settings.implicit_retention_s`, the server's). Needs only the database:
        every sweep reads the TTLs afresh, so a server applies it at its next sweep.

        Raises:
            InvalidInput: for a TTL that is not in (0, 100 years].
            TenantNotFound: for an unknown tenant.
        """
        retention_s = check_retention_s(retention_s)
        record = self._tenant(tenant)
        if not HistoryStore(self.metadata.database).set_retention(tenant_id=record.id, retention_s=retention_s):
            raise TenantNotFound(tenant)  # deleted meanwhile
        return {
            "id": record.id,
            "name": record.name,
            "implicit_retention_s": retention_s,
            "default_implicit_retention_s": self.settings.implicit_retention_s,
        }

    def create_tenant(self, name: str) -> Json:
        """Create a tenant and issue its API key (returned here once; only a salted hash is kept)."""
        manager = self.manager
        tenant = manager.create_tenant(name)
        api_key = manager.issue_api_key(tenant)
        return {**_tenant_json(self._tenant(tenant.id), 0), "api_key": api_key}

    def rotate_api_key(self, tenant: str) -> Json:
        """Replace the tenant's API key; the old one stops working at once."""
        record = self._tenant(tenant)
        return {"id": record.id, "name": record.name, "api_key": self.manager.issue_api_key(record.id)}

    def delete_tenant(self, tenant: str) -> Json:
        """Crypto-shred (the wrapped data key goes first), then the tenant's caches, files and rows."""
        record = self._tenant(tenant)
        self.manager.delete_tenant(record.id)
        return {"id": record.id, "name": record.name, "deleted": True}

    # -- sessions ------------------------------------------------------------------------------

    def list_sessions(
        self, *, tenant: str | None = None, tier: str | None = None, idle_for_s: float | None = None
    ) -> list[Json]:
        """Sessions, most recently active first, optionally of one tenant, in one tier, or idle for
        at least `idle_for_s` seconds."""
        if tier is not None and tier not in TIERS:
            raise InvalidInput(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
        if idle_for_s is not None and not 0 <= idle_for_s <= MAX_DURATION_S:
            raise InvalidInput(f"idle_for_s must be between 0 and 100 years in seconds, got {idle_for_s}")
        tenant_id = None if tenant is None else self._tenant(tenant).id
        idle_before = None if idle_for_s is None else datetime.now(UTC) - timedelta(seconds=idle_for_s)
        names = {t.id: t.name for t in self.metadata.list_tenants()}
        placement = self._placement()
        rows = [
            _session_json(
                record, names.get(record.tenant_id), placement(TenantId(record.tenant_id), SessionId(record.id))
            )
            for record in self.metadata.list_sessions(tenant_id=tenant_id, idle_before=idle_before)
        ]
        return [row for row in rows if tier is None or row["tier"] == tier]

    def inspect_session(self, tenant: str, session_id: str) -> Json:
        """Session, transcript summary, layer table (a stored cache is decrypted to read it),
        model fingerprints and the last turn's TTFT."""
        manager = self.manager
        record = self._tenant(tenant)
        detail = manager.inspect_session(record.id, session_id)
        messages = self._messages(record.id, session_id)
        info = detail.info
        session = self.registry.session_record(TenantId(record.id), info.id)
        expires = expires_at(info, record.implicit_retention_s, self.settings.implicit_retention_s)
        return {
            "session": _session_json(session, record.name, info.tier)
            | {"expires_at": None if expires is None else expires.isoformat()},
            "system_prompt": info.system_prompt,
            "transcript": _summary(messages),
            "model_fingerprint": info.model_fingerprint,
            "model_fingerprint_matches": info.model_fingerprint == manager.internals.engine.fingerprint,
            "last_ttft_s": detail.last_ttft_s,
            "cache_bytes": detail.cache_bytes,
            "base_tokens": detail.base_tokens,
            "layers": _layer_rows(detail),
            "owner": detail.owner,
            "owner_url": detail.owner_url,
            "redis_copy": detail.shared_copy,
            "held_per_kv_head": None
            if detail.held_per_head is None
            else {"min": detail.held_per_head[0], "max": detail.held_per_head[1]},
        }

    def evict_session(self, tenant: str, session_id: str, to: str) -> Json:
        """Move the session's cache down to `host` or `disk`, or `drop` it (the next turn rebuilds it)."""
        if to not in EVICT_TARGETS:
            raise InvalidInput(f"evict target must be one of {', '.join(EVICT_TARGETS)}, got {to!r}")
        tier = self.manager.evict_session(tenant, session_id, to)
        return {"id": session_id, "tier": tier}

    def restore_session(self, tenant: str, session_id: str) -> Json:
        """Bring the session's cache up to the device now (pre-warm), as its next turn would.

        Budgets are enforced afterwards, so an over-full device may move it (or another session)
        down again; the returned tier is where it ended up.
        """
        result = self.manager.restore_session(self._tenant(tenant).id, session_id)
        return {"id": session_id, **dataclasses.asdict(result)}

    def delete_session(self, tenant: str, session_id: str) -> Json:
        self.manager.delete_session(self._tenant(tenant).id, session_id)
        return {"id": session_id, "deleted": True}

    def export_session(self, tenant: str, session_id: str) -> Json:
        """The session and its whole transcript, with each message's exact token ids."""
        record = self._tenant(tenant)
        session = self.registry.session_record(TenantId(record.id), session_id)
        messages = self._messages(record.id, session_id)
        tier = self._placement()(TenantId(record.id), SessionId(session.id))
        return {
            "session": _session_json(session, record.name, tier),
            "system_prompt": session.system_prompt,
            "messages": [_message_json(m) for m in messages],
        }

    # -- operations ----------------------------------------------------------------------------

    def stats(self) -> Json:
        """Tenant and session totals plus, over a live manager, `SessionManager.stats()` (`live`:
        true). Offline (`open_home`), the tiers as stored (every cache on disk) and no turn counters:
        they live in the server process (`live`: false, `note` says so). Offline loads no model."""
        tenants = self.metadata.list_tenants()
        totals: Json = {"tenants": len(tenants), "sessions": len(self.metadata.list_sessions())}
        if self._owns_manager:
            return {**totals, **self._stored_stats(), "live": False, "note": OFFLINE_STATS_NOTE}
        live = self.manager.stats()
        names = {t.id: t.name for t in tenants}
        # Operators read tenants by name; a tenant deleted since its turns ran has none (`null`).
        live["prompt_tokens_by_tenant"] = {
            tenant_id: {"tenant": names.get(tenant_id), **figures}
            for tenant_id, figures in live["prompt_tokens_by_tenant"].items()
        }
        return {**totals, **live, "live": True}

    def _stored_stats(self) -> Json:
        """Tier usage from the database alone: no process holds a cache on the device or in host
        memory, and the disk tier is the `cache_blobs` rows (session caches and shared bases)."""
        blobs = self.metadata.list_blobs(location=self.settings.disk_location())
        settings = self.settings
        budgets = {
            "device": settings.device_budget_bytes or 0,
            "host": settings.host_budget_bytes or 0,
            "disk": settings.disk_budget_bytes or 0,
        }
        used = {"device": 0, "host": 0, "disk": sum(b.nbytes for b in blobs)}
        counts = {"device": 0, "host": 0, "disk": len({(b.tenant_id, b.session_id) for b in blobs if b.session_id})}
        return {
            "tiers": {
                tier: {
                    "sessions": counts[tier],
                    "copies": 0,  # no process holds a session above the disk
                    "bytes": used[tier],
                    "budget_bytes": budgets[tier],
                    "budget_used": used[tier] / max(1, budgets[tier]),
                }
                for tier in TIERS
            },
            # What a manager on these settings would load (no model is loaded to name it).
            "model": f"{BUNDLED_MODEL_NAME} (bundled)" if settings.model == DEFAULT_MODEL else settings.model,
        }

    def replicas(self) -> Json:
        """The replicas registered in this database: id, URL, last heartbeat (and its age), sessions
        owned now, KV-cache bytes held, turns queued at the last heartbeat; `alive` while the
        heartbeat is younger than a lease (`CHATKV_OWNERSHIP_LEASE_S`: a replica silent longer
        has lost its sessions); `draining` once it hands its sessions over (`drain_replica`, or
        stopping); `state` is `alive`, `draining` or `gone`."""
        now = time.time()
        lease_s = self.settings.ownership_lease_s
        rows = ReplicaStore(self.metadata.database).list_replicas(now_unix_s=now)
        return {
            "replica_mode": self.settings.replica_mode,
            "lease_s": lease_s,
            "replicas": [
                {
                    "id": r.id,
                    "url": r.url,
                    "hostname": r.hostname,
                    "pid": r.pid,
                    "started_at": r.started_at.isoformat(),
                    "last_heartbeat": r.heartbeat_at.isoformat(),
                    "heartbeat_age_s": round(max(0.0, now - r.heartbeat_unix_s), 3),
                    "alive": now - r.heartbeat_unix_s <= lease_s,
                    "draining": r.draining,
                    "state": "gone" if now - r.heartbeat_unix_s > lease_s else "draining" if r.draining else "alive",
                    "sessions_owned": r.sessions_owned,
                    "cache_bytes": r.cache_bytes,
                    "queued_turns": r.queued_turns,
                }
                for r in rows
            ],
        }

    def drain_replica(self, replica_id: str) -> Json:
        """Ask the replica `replica_id` to drain, through the database: its keeper reads the mark
        with its next heartbeat (within a third of a lease), then hands each session over as soon
        as no turn uses it; other replicas stop forwarding turns to it and send new sessions
        elsewhere. The mark stays until a new process registers under the id (a restart).

        Raises:
            ReplicaNotFound: if no replica is registered under the id.
        """
        if not ReplicaStore(self.metadata.database).set_draining(replica_id=replica_id):
            raise ReplicaNotFound(replica_id)
        return {"id": replica_id, "draining": True}

    def rotate_master_key(self, new_key: str | None = None) -> Json:
        """Re-wrap every tenant's data key under a new master key (generated unless given)."""
        manager = self.manager
        key_id = manager.rotate_master_key(new_key)
        return {"master_key_id": key_id, "from_env": manager.internals.keys.master.from_env}

    def gc(self, *, dry_run: bool = False) -> Json:
        """Delete the implicit sessions and uncontinued forks whose idle TTL ran out
        (`expired_implicit_sessions`: the sweep `chatkv serve` runs every few minutes, see
        `sessions.retention`), then any session idle longer than `Settings.session_retention_s`
        (`expired_sessions`; none when unset).

        Disk orphans (temp files, files without a row, rows without a file, blobs of another model)
        are removed whenever a manager starts, so a server has none to collect while it runs.
        """
        retention_s = self.settings.session_retention_s
        names = {t.id: t.name for t in self.metadata.list_tenants()}
        implicit = [_expired_json(e, names.get(e.tenant_id)) for e in self._expire_implicit(dry_run)]
        report: Json = {
            "retention_s": retention_s,
            "dry_run": dry_run,
            "expired_sessions": [],
            "implicit_retention_s": self.settings.implicit_retention_s,
            "expired_implicit_sessions": implicit,
        }
        if retention_s is None:
            return report
        cutoff = datetime.now(UTC) - timedelta(seconds=retention_s)
        expired = self.metadata.list_sessions(idle_before=cutoff)
        if not dry_run:
            expired = [record for record in expired if self._delete_if_idle(record, cutoff)]
        report["expired_sessions"] = [_session_json(r, names.get(r.tenant_id), None) for r in expired]
        return report

    def _expire_implicit(self, dry_run: bool) -> list[ExpiredSession]:
        """The implicit sessions and uncontinued forks whose TTL ran out: listed, or deleted
        (pass after pass, each at most 1,000, until one deletes nothing)."""
        retention = self._retention()
        if dry_run:
            return retention.due()
        expired: list[ExpiredSession] = []
        while batch := retention.expire():
            expired += batch
        return expired

    def _retention(self) -> Retention:
        """The live manager's retention (its clock, its sweeps' rules), else one over the
        database that loads a manager only to delete (caches in every tier go with a session)."""
        if self._manager is not None:
            return self._manager.internals.histories.retention
        return Retention(
            history=HistoryStore(self.metadata.database),
            delete=lambda tenant_id, session_id: self.manager.delete_session(tenant_id, session_id),
            last_active=self.registry.last_active,
            default_retention_s=self.settings.implicit_retention_s,
        )

    def _delete_if_idle(self, record: SessionRecord, cutoff: datetime) -> bool:
        """Delete a session unless a turn made it active since it was listed (or it is gone)."""
        manager = self.manager
        with contextlib.suppress(SessionNotFound):
            if manager.session_info(record.tenant_id, record.id).last_active_at < cutoff:
                manager.delete_session(record.tenant_id, record.id)
                return True
        return False

    # -- helpers -------------------------------------------------------------------------------

    def _tenant(self, tenant: str) -> TenantRecord:
        if not isinstance(tenant, str) or not tenant:
            raise InvalidInput("a tenant name or id is required")
        return self.registry.tenant_record(tenant)

    def _messages(self, tenant_id: str, session_id: str) -> list[MessageRecord]:
        return self.registry.message_records(TenantId(tenant_id), session_id)

    def _placement(self) -> Placement:
        """Where each session's cache is: the live manager's answer, else what the database says
        (on disk when a blob row names the session: what a manager adopts at start-up)."""
        if self._manager is not None:
            return self._manager.internals.registry.placement
        rows = self.metadata.list_blobs(location=self.settings.disk_location())
        on_disk = {(b.tenant_id, b.session_id) for b in rows if b.session_id}
        return lambda tenant_id, session_id: "disk" if (tenant_id, session_id) in on_disk else None


def _new_manager(settings: Settings) -> SessionManager:
    from sessions.manager import SessionManager

    return SessionManager(settings)


def _tenant_json(record: TenantRecord, sessions: int) -> Json:
    return {
        "id": record.id,
        "name": record.name,
        "created_at": record.created_at.isoformat(),
        "sessions": sessions,
        "has_api_key": record.api_key_hash is not None,
        "master_key_id": record.master_key_id,
        "implicit_retention_s": record.implicit_retention_s,
    }


def _session_json(record: SessionRecord, tenant_name: str | None, tier: str | None) -> Json:
    return {
        "id": record.id,
        "tenant_id": record.tenant_id,
        "tenant": tenant_name,
        "title": record.title,
        "name": record.name,
        "origin": record.origin,
        "parent_id": record.parent_id,
        "fork_turns": record.fork_turns,
        "tier": tier,
        "token_count": record.token_count,
        "message_count": record.message_count,
        "last_ttft_s": record.last_ttft_s,
        "model_fingerprint": record.model_fingerprint,
        "created_at": record.created_at.isoformat(),
        "last_active_at": record.last_active_at.isoformat(),
    }


def _expired_json(expired: ExpiredSession, tenant_name: str | None) -> Json:
    return {
        "id": expired.session_id,
        "tenant_id": expired.tenant_id,
        "tenant": tenant_name,
        "last_active_at": expired.last_active_at.isoformat(),
    }


def _message_json(record: MessageRecord) -> Json:
    return {
        "index": record.index,
        "role": record.role,
        "text": record.text,
        "token_ids": list(record.token_ids),
        "created_at": record.created_at.isoformat(),
    }


def _short(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= SUMMARY_CHARS else flat[: SUMMARY_CHARS - 1] + "…"


def _summary(messages: list[MessageRecord]) -> Json:
    users = [m for m in messages if m.role == "user"]
    return {
        "messages": len(messages),
        "turns": len(users),
        "tokens": sum(len(m.token_ids) for m in messages),
        "first_user_message": _short(users[0].text) if users else None,
        "last_user_message": _short(users[-1].text) if users else None,
        "last_reply": _short(messages[-1].text) if messages and messages[-1].role == "assistant" else None,
    }


def _layer_rows(detail: SessionDetail) -> list[Json]:
    """The layer table. The system-prompt prefix (`turn_index` null) lives in the tenant's shared
    prefix pool, so it has no tier or bytes of its own; each other layer's `bytes` is its share, by
    tokens, of the session cache's bytes in its tier (exact for an unquantised device cache).
    `tokens` counts what each KV head holds, `evicted` what the `attention` window policy evicted
    from the layer (per head); `positions` spans both."""
    own_tokens = sum(span.token_count for span in detail.layers if span.turn_index is not None)
    rows = []
    for span in detail.layers:
        shared = span.turn_index is None
        share = detail.cache_bytes * span.token_count // own_tokens if own_tokens else 0
        rows.append(
            {
                "kind": span.kind.value,
                "turn_index": span.turn_index,
                "tokens": span.token_count,
                "evicted": span.evicted_tokens,
                "positions": [span.position_start, span.position_end],
                "original_start": span.original_start,
                "precision": span.precision,
                "shared": shared,
                "tier": None if shared else detail.info.tier,
                "bytes": None if shared else share,
            }
        )
    return rows
