"""The manager's sessions beyond their turns: opening one (with a history a client brings along),
deleting it, pinning a turn into the base layer, inspecting its cache, pre-warming it onto the
device and evicting it down the tiers. Records are read through the registry
(`sessions.registry`); caches through the tier manager.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cache.ids import SessionId, TenantId
from cache.layer_table import LayerSpan
from cache.session_cache import SessionCache
from cache.tier_manager import LeaseHeld, TierManager
from cache.tiers import BlobRejected, CacheKey, Tier
from cache.window_policy import MIN_TURN_TOKENS
from sessions.errors import (
    ContextTooLong,
    HistoryTooLong,
    InvalidInput,
    SessionBusy,
    SessionExists,
    SessionNotFound,
)
from sessions.records import EVICT_TARGETS, RestoreResult, SessionInfo
from sessions.registry import SESSION_ID_PREFIX, Registry, check_session_name
from sessions.replicas.role import Replicas
from sessions.transcripts import Transcripts
from sessions.turn.chat_template import ChatTemplate
from sessions.turn.runner import TurnRunner
from sessions.validation import MAX_MESSAGE_CHARS, check_text
from storage.database import secure_erase_freed_pages
from storage.errors import AlreadyExists
from storage.metadata_store import MetadataStore

MAX_TITLE_CHARS = 200
MAX_HISTORY_TURNS = 1024
"""Turns a session may be opened with (`open(history=...)`): 2,048 messages, OpenAI's limit of
messages per request."""
HISTORY_CONTEXT_MULTIPLE = 8
"""A history opened with may hold this many times the model's context window in tokens."""
HISTORY_BATCH_TURNS = 64
"""Posted turns tokenised per tokenizer call (an overlong history stops within a batch of it)."""


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
    held_per_head: tuple[int, int] | None = None
    """Under per-head budgets (a ragged cache), the fewest and most own tokens a KV head of a full
    model layer holds (the layer table's counts are their mean); `None` when every head holds the
    same."""


class SessionCatalogue:
    """Session operations of a manager other than turns. Thread-safe.

    Args:
        registry, metadata: session records.
        tiers: the session caches.
        transcripts: the cached transcripts (a deleted session's goes, a pin is marked).
        runner: cancels a deleted session's turn in flight.
        template: frames a brought-along history (its reply ids) and the system prompt.
        tokenizer: counts a brought-along history's tokens.
        replicas: the ownership lease held around a pin or a pre-warm.
        fingerprint: the model's, recorded on each new session.
        max_context_tokens: the model's context (bounds a brought-along history).
        context_budget_tokens: the window every turn must fit.
        pin_first_turn: new sessions pin turn 0.
    """

    def __init__(
        self,
        *,
        registry: Registry,
        metadata: MetadataStore,
        tiers: TierManager,
        transcripts: Transcripts,
        runner: TurnRunner,
        template: ChatTemplate,
        tokenizer: Any,
        replicas: Replicas,
        fingerprint: str,
        max_context_tokens: int,
        context_budget_tokens: int,
        pin_first_turn: bool,
    ) -> None:
        self._registry = registry
        self._metadata = metadata
        self._tiers = tiers
        self._transcripts = transcripts
        self._runner = runner
        self._template = template
        self._tokenizer = tokenizer
        self._replicas = replicas
        self._fingerprint = fingerprint
        self._max_context_tokens = max_context_tokens
        self.context_budget_tokens = context_budget_tokens
        self._pin_first_turn = pin_first_turn

    # -- lifecycle -----------------------------------------------------------------------------

    def open(
        self,
        tenant_id: TenantId,
        system_prompt: str | None,
        title: str | None,
        history: Sequence[tuple[str, str]] = (),
        *,
        origin: str = "explicit",
        name: str | None = None,
    ) -> SessionId:
        """Create a session; see `SessionManager.open_session` for the arguments and errors.
        `origin`: `explicit`, `implicit` (for a posted history) or `named` (with the client's
        `name`: `InvalidInput` if malformed, `SessionExists` if the tenant uses it)."""
        if name is not None:
            check_session_name(name)
        if system_prompt is not None:
            check_text(system_prompt, "system_prompt", MAX_MESSAGE_CHARS)
        if title is not None:
            check_text(title, "title", MAX_TITLE_CHARS)
        messages = self._history_messages(history)
        if system_prompt:
            # The system prompt is pinned in every turn's window; leave room for a short turn.
            needed = len(self._template.system_prefix_ids(system_prompt)) + MIN_TURN_TOKENS
            if needed > self.context_budget_tokens:
                raise ContextTooLong(needed, self.context_budget_tokens, what="system prompt")
        session_id = SessionId(SESSION_ID_PREFIX + secrets.token_hex(12))
        try:
            self._create(tenant_id, session_id, system_prompt, title, messages, origin, name)
        except AlreadyExists:
            raise SessionExists(f"the session {name} exists already") from None
        return session_id

    def _create(
        self,
        tenant_id: TenantId,
        session_id: SessionId,
        system_prompt: str | None,
        title: str | None,
        messages: list[tuple[str, str, tuple[int, ...]]],
        origin: str,
        name: str | None,
    ) -> None:
        self._metadata.create_session(
            tenant_id=tenant_id,
            session_id=session_id,
            title=title,
            system_prompt=system_prompt,
            model_fingerprint=self._fingerprint,
            pinned_turns=(0,) if self._pin_first_turn else (),
            messages=messages,
            origin=origin,
            name=name,
        )

    def _history_messages(self, history: Sequence[tuple[str, str]]) -> list[tuple[str, str, tuple[int, ...]]]:
        """`open`'s history as messages to store, counted against the limits as it is tokenised
        (so an overlong one costs no more than the limit's worth of tokenising)."""
        context = self._max_context_tokens
        limit_tokens = HISTORY_CONTEXT_MULTIPLE * context
        if len(history) > MAX_HISTORY_TURNS:
            raise HistoryTooLong(
                f"the history has {len(history)} turns; at most {MAX_HISTORY_TURNS} can be brought along"
            )
        messages: list[tuple[str, str, tuple[int, ...]]] = []
        tokens = 0
        # Tokenised a batch of turns per tokenizer call: one call per message costs seconds of
        # Python for a 2,000-message history, holding the GIL that every other turn needs.
        for first in range(0, len(history), HISTORY_BATCH_TURNS):
            batch = history[first : first + HISTORY_BATCH_TURNS]
            for user_text, reply_text in batch:
                check_text(user_text, "a history message", MAX_MESSAGE_CHARS)
                check_text(reply_text, "a history reply", MAX_MESSAGE_CHARS)
            for (user_text, reply_text), (user_ids, reply_ids) in zip(
                batch, self._template.history_ids(batch), strict=True
            ):
                tokens += len(reply_ids) + len(user_ids)
                if tokens > limit_tokens:
                    raise HistoryTooLong(
                        f"the history holds more than {limit_tokens:,} tokens ({HISTORY_CONTEXT_MULTIPLE} times "
                        f"the model's {context:,}-token context); bring along only its recent turns"
                    )
                messages += [("user", user_text, ()), ("assistant", reply_text, reply_ids)]
        return messages

    def delete(self, tenant_id: TenantId, session_id: str, *, erase: bool = False) -> None:
        """Delete the session: caches in every tier first (so no eviction can write a blob row for
        it meanwhile), then its rows (`erase`: and their bytes in SQLite's write-ahead log, see
        `SessionManager.delete_session`). A turn in flight on it fails with `SessionNotFound`."""
        record = self._registry.session_record(tenant_id, session_id)
        sid = SessionId(record.id)
        self._runner.cancel_requests(tenant_id, sid)
        self._tiers.forget(CacheKey.for_session(tenant_id, sid))
        self._transcripts.drop(tenant_id, sid)
        if not self._metadata.delete_session(tenant_id=tenant_id, session_id=record.id):
            raise SessionNotFound(str(session_id))
        self._tiers.forget(CacheKey.for_session(tenant_id, sid))  # a turn that finished in between
        if erase:
            secure_erase_freed_pages(self._metadata.database)

    # -- caches --------------------------------------------------------------------------------

    def pin(self, tenant_id: TenantId, session_id: str, turn_index: int) -> None:
        """Promote a turn into the base layer; see `SessionManager.pin_turn`."""
        record = self._registry.session_record(tenant_id, session_id)
        turns = record.message_count // 2
        if isinstance(turn_index, bool) or not isinstance(turn_index, int) or not 0 <= turn_index < turns:
            raise InvalidInput(f"no turn {turn_index!r}: the session has {turns} turns")
        key = CacheKey.for_session(tenant_id, SessionId(record.id))
        with self._replicas.hold(key):  # the owner's cached transcript must see the pin
            self._check_pinnable(key, turn_index)
            pinned_turns = sorted({*record.pinned_turns, turn_index})
            self._metadata.set_pinned_turns(tenant_id=tenant_id, session_id=record.id, pinned_turns=pinned_turns)
            self._transcripts.pin(tenant_id, SessionId(record.id), turn_index)

    def _check_pinnable(self, key: CacheKey, turn_index: int) -> None:
        cache = self._tiers.peek(key) or self._open_stored(key)
        if cache is None:
            return
        if not any(span.turn_index == turn_index for span in cache.layers):
            raise InvalidInput(f"turn {turn_index} was demoted out of the context window; it cannot be pinned")
        pinned = sum(s.token_count for s in cache.layers if s.pinned or s.turn_index == turn_index)
        if cache.base_tokens + pinned + MIN_TURN_TOKENS > self.context_budget_tokens:
            raise InvalidInput(
                f"pinning turn {turn_index} would leave less than {MIN_TURN_TOKENS} tokens of the "
                f"{self.context_budget_tokens}-token window for the conversation"
            )

    def inspect(self, tenant_id: TenantId, session_id: str) -> SessionDetail:
        """Session, layer table and cache placement (a host or disk cache is opened to read it)."""
        record = self._registry.session_record(tenant_id, session_id)
        key = CacheKey.for_session(tenant_id, SessionId(record.id))
        cache = self._tiers.peek(key) or self._open_stored(key)
        owner, owner_url = self._replicas.owner(record.id)
        return SessionDetail(
            info=self._registry.info(record),
            layers=tuple(cache.full_layer_table()) if cache else (),
            base_tokens=cache.base_tokens if cache else 0,
            cache_bytes=self._tiers.entry_bytes(key),
            last_ttft_s=record.last_ttft_s,
            owner=owner,
            owner_url=owner_url,
            shared_copy=self._tiers.has_shared_copy(key),
            held_per_head=_held_per_head(cache) if cache is not None and cache.ragged else None,
        )

    def _open_stored(self, key: CacheKey) -> SessionCache | None:
        try:
            return self._tiers.stored_cache(key)
        except BlobRejected:
            return None

    def restore(self, tenant_id: TenantId, session_id: str) -> RestoreResult:
        """Bring an idle session's cache up to the device now; see `SessionManager.restore_session`."""
        record = self._registry.session_record(tenant_id, session_id)
        key = CacheKey.for_session(tenant_id, SessionId(record.id))
        try:
            with self._replicas.hold(key), self._tiers.lease(key) as lease:
                restored = lease.restore()
        except LeaseHeld:
            raise SessionBusy(f"session {session_id} has a turn in flight") from None
        tier = self._tiers.placement(key)
        return RestoreResult(
            tier=tier.value if tier else None,
            restored_from=restored.source.value if restored.source else None,
            restore_s=restored.seconds,
            rejected=restored.rejected,
        )

    def evict(self, tenant_id: TenantId, session_id: str, to: str) -> str | None:
        """Move an idle session's cache down; see `SessionManager.evict_session`."""
        record = self._registry.session_record(tenant_id, session_id)
        if to not in EVICT_TARGETS:
            raise InvalidInput(f"evict target must be host, disk or drop, got {to!r}")
        try:
            tier = self._tiers.evict(
                CacheKey.for_session(tenant_id, SessionId(record.id)), None if to == "drop" else Tier(to)
            )
        except LeaseHeld:
            raise SessionBusy(f"session {session_id} has a turn in flight") from None
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        return tier.value if tier else None


def _held_per_head(cache: SessionCache) -> tuple[int, int]:
    """The fewest and most own tokens any KV head of a full model layer of `cache` holds."""
    counts = [n for layer in cache.full_layers for n in cache.head_tokens(layer)]
    return min(counts), max(counts)
