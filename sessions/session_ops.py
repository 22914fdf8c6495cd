"""Per-session operations of a `SessionManager` beyond chatting: info, pinning, inspection,
pre-warming, eviction, and the manager's statistics. `SessionOps` is a base class of
`SessionManager` (sessions/manager.py), which sets the attributes it declares."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from cache.ids import SessionId, TenantId
from cache.session_cache import LayerSpan, SessionCache
from cache.tier_manager import LeaseHeld
from cache.tiers import LOCAL_TIERS, BlobRejected, CacheKey, Tier
from cache.window_policy import MIN_TURN_TOKENS
from sessions.engine import Engine
from sessions.errors import InvalidInput, SessionBusy, SessionNotFound
from sessions.metrics import Metrics
from sessions.ownership import SessionOwnership
from sessions.records import RestoreResult, SessionInfo
from sessions.tenant_ops import TenantOps, TenantRef
from sessions.validation import valid_id
from storage.metadata_store import SessionRecord
from storage.replica_store import OwnerToken


@dataclass(frozen=True)
class SessionDetail:
    """What `chatkv sessions inspect` shows: the session, its layer table and where the cache is."""

    info: SessionInfo
    layers: tuple[LayerSpan, ...]
    base_tokens: int
    cache_bytes: int
    last_ttft_s: float | None
    owner: str | None = None
    """The replica holding the session's ownership lease now (replicas only; `None`: nobody)."""
    owner_url: str | None = None
    shared_copy: bool = False
    """Whether the Redis tier holds a copy of the session's cache (any version)."""


class SessionOps(TenantOps):
    """Session operations of `SessionManager` other than turns."""

    engine: Engine
    metrics: Metrics
    context_budget_tokens: int
    ownership: SessionOwnership | None

    def _owner(self, key: CacheKey) -> AbstractContextManager[OwnerToken | None]:
        """The session's ownership lease while a turn (or a pin, or a pre-warm) runs
        (`sessions.ownership`); nothing to hold for a single process.

        Raises:
            SessionNotFound, SessionOwnedElsewhere: see `SessionOwnership.hold`.
        """
        return self.ownership.hold(key) if self.ownership is not None else nullcontext()

    @property
    def model_name(self) -> str:
        return self.engine.loaded.name

    def _session_record(self, tenant_id: TenantId, session_id: str) -> SessionRecord:
        if not valid_id(session_id):
            raise SessionNotFound(repr(session_id))
        record = self.metadata.get_session(tenant_id=tenant_id, session_id=str(session_id))
        if record is None:
            raise SessionNotFound(str(session_id))
        return record

    def session_info(self, tenant: TenantRef, session_id: str) -> SessionInfo:
        tenant_id = self._tenant_id(tenant)
        return self._info(self._session_record(tenant_id, session_id))

    def _info(self, record: SessionRecord) -> SessionInfo:
        tier = self.tiers.placement(CacheKey(TenantId(record.tenant_id), record.id))
        return SessionInfo(
            id=SessionId(record.id),
            tenant_id=TenantId(record.tenant_id),
            title=record.title,
            system_prompt=record.system_prompt,
            model_fingerprint=record.model_fingerprint,
            token_count=record.token_count,
            message_count=record.message_count,
            created_at=record.created_at,
            last_active_at=record.last_active_at,
            tier=tier.value if tier else None,
        )

    def pin_turn(self, tenant: TenantRef, session_id: str, turn_index: int) -> None:
        """Promote turn `turn_index` (0-based) into the base layer: it is never demoted.

        Raises:
            InvalidInput: if there is no such turn, it was already demoted out of the window, or
                the pinned content would leave less than `MIN_TURN_TOKENS` of the window.
        """
        tenant_id = self._tenant_id(tenant)
        record = self._session_record(tenant_id, session_id)
        turns = record.message_count // 2
        if isinstance(turn_index, bool) or not isinstance(turn_index, int) or not 0 <= turn_index < turns:
            raise InvalidInput(f"no turn {turn_index!r}: the session has {turns} turns")
        key = CacheKey(tenant_id, record.id)
        with self._owner(key):  # the owner's cached transcript must see the pin
            self._pin(key, record, turn_index)

    def _pin(self, key: CacheKey, record: SessionRecord, turn_index: int) -> None:
        tenant_id = key.tenant_id
        cache = self.tiers.peek(key) or self._open_stored(key)
        if cache is not None:
            spans = [span for span in cache.layers if span.turn_index == turn_index]
            if not spans:
                raise InvalidInput(f"turn {turn_index} was demoted out of the context window; it cannot be pinned")
            pinned = sum(s.token_count for s in cache.layers if s.pinned or s.turn_index == turn_index)
            if cache.base_tokens + pinned + MIN_TURN_TOKENS > self.context_budget_tokens:
                raise InvalidInput(
                    f"pinning turn {turn_index} would leave less than {MIN_TURN_TOKENS} tokens of the "
                    f"{self.context_budget_tokens}-token window for the conversation"
                )
        pinned_turns = sorted({*record.pinned_turns, turn_index})
        self.metadata.set_pinned_turns(tenant_id=tenant_id, session_id=record.id, pinned_turns=pinned_turns)
        with self._lock:
            cached = self._transcripts.get((tenant_id, SessionId(record.id)))
            if cached is not None:
                cached.pinned.add(turn_index)

    def inspect_session(self, tenant: TenantRef, session_id: str) -> SessionDetail:
        """Session, layer table and cache placement (a host or disk cache is opened to read it)."""
        tenant_id = self._tenant_id(tenant)
        record = self._session_record(tenant_id, session_id)
        key = CacheKey(tenant_id, record.id)
        cache = self.tiers.peek(key) or self._open_stored(key)
        lease = self.ownership.store.owner(session_id=record.id) if self.ownership is not None else None
        owner = lease.replica_id if lease is not None and lease.expires_unix_s >= time.time() else None
        return SessionDetail(
            info=self._info(record),
            layers=tuple(cache.full_layer_table()) if cache else (),
            base_tokens=cache.base_tokens if cache else 0,
            cache_bytes=self.tiers.entry_bytes(key),
            last_ttft_s=record.last_ttft_s,
            owner=owner,
            owner_url=lease.owner_url if lease is not None and owner else None,
            shared_copy=self.tiers.has_shared_copy(key),
        )

    def _open_stored(self, key: CacheKey) -> SessionCache | None:
        try:
            return self.tiers.stored_cache(key)
        except BlobRejected:
            return None

    def restore_session(self, tenant: TenantRef, session_id: str) -> RestoreResult:
        """Bring an idle session's cache up to the device now, as its next turn would (pre-warm).
        Budgets are enforced afterwards and may move it down again; `tier` says where it ended.

        Raises:
            SessionBusy: if a turn is in flight on the session (`SessionOwnedElsewhere`: on
                another replica, which kept it past `Settings.ownership_wait_s`).
        """
        tenant_id = self._tenant_id(tenant)
        record = self._session_record(tenant_id, session_id)
        key = CacheKey(tenant_id, record.id)
        try:
            with self._owner(key), self.tiers.lease(key) as lease:
                restored = lease.restore()
        except LeaseHeld:
            raise SessionBusy(f"session {session_id} has a turn in flight") from None
        tier = self.tiers.placement(key)
        return RestoreResult(
            tier=tier.value if tier else None,
            restored_from=restored.source.value if restored.source else None,
            restore_s=restored.seconds,
            rejected=restored.rejected,
        )

    def evict_session(self, tenant: TenantRef, session_id: str, to: str) -> str | None:
        """Move an idle session's cache down to `host` or `disk`, or `drop` it. Returns the tier.

        Raises:
            InvalidInput: for another target, or a target above the current tier.
            SessionBusy: if a turn is in flight on the session.
        """
        tenant_id = self._tenant_id(tenant)
        record = self._session_record(tenant_id, session_id)
        if to not in ("host", "disk", "drop"):
            raise InvalidInput(f"evict target must be host, disk or drop, got {to!r}")
        try:
            tier = self.tiers.evict(CacheKey(tenant_id, record.id), None if to == "drop" else Tier(to))
        except LeaseHeld:
            raise SessionBusy(f"session {session_id} has a turn in flight") from None
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        return tier.value if tier else None

    # -- operations ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Sessions and bytes per tier, budgets, cache hit rate, prefill tokens saved, evictions."""
        usage = self.tiers.usage()
        m = self.metrics

        def value(counter: Any, *labels: str) -> float:
            return float(counter.labels(*labels)._value.get()) if labels else float(counter._value.get())

        queries = value(m.cache_queries, "tokens")
        evictions = {
            f"{s.value}->{t}": value(m.evictions, s.value, t)
            for s in LOCAL_TIERS
            for t in ("host", "disk", "dropped")
            if value(m.evictions, s.value, t)
        }
        return {
            "tiers": {
                t.value: {
                    "sessions": usage.sessions[t],
                    "bytes": usage.bytes[t],
                    "budget_bytes": usage.budgets[t],
                    "budget_used": usage.bytes[t] / max(1, usage.budgets[t]),
                }
                for t in LOCAL_TIERS
            },
            "base_layers_in_pool": len(self.tiers.pool),
            "cache_hit_rate_tokens": value(m.cache_hits, "tokens") / queries if queries else 0.0,
            "prefill_tokens": value(m.prefill_tokens),
            "prefill_tokens_saved": value(m.prefill_tokens_saved),
            "evictions": evictions,
            "integrity_failures": sum(value(m.integrity_failures, t.value) for t in LOCAL_TIERS),
            "model": self.model_name,
            "model_fingerprint": self.engine.fingerprint,
            "context_budget_tokens": self.context_budget_tokens,
        }
