"""Forks: a new session that starts from another session's KV up to the end of one of its turns
and goes its own way; the parent stays untouched (regenerate, edit, retry and branches are forks).

    parent S   | base | turn 0 | turn 1 | turn 2 | turn 3 |      (any tier: device, host, disk, Redis)
    fork(S, 2) | base | turn 0 | turn 1 |                       S' then prefills only what is new

The fork's rows (messages with their exact ids, turn digests, pins) are copied in one transaction
(`storage.history_store.HistoryStore.fork`). Its cache is the parent's cache cut where turn 1's
reply ends (`SessionCache.prefix`): the same tensors, sliced, since caches are immutable values
(no copy; the fork's first turn copies what it keeps into its own working buffer, as every turn
does). The parent's cache is read where it is, without moving it or taking its lease, so a parent
busy with a turn is forked from the version before that turn.

    fork point                     parent's cache          the fork's cache
    the parent's latest turn       any (windowed or not)   the whole cache, as it is: the fork
                                                           replies as the parent would
    an earlier turn                nothing windowed        the prefix, sliced
    an earlier turn                windowed before it      none: rebuilt from the transcript

A prefix cut before the end of a windowed cache (a demoted or evicted turn, a quantised layer,
under the `turns`, `attention` and `agnostic` policies alike) is not reused: the fork rebuilds
from its transcript, as a window change does, so it replies exactly like a fresh session with the
same history (and, when that history outgrows the budget, windows it by its own rebuild).
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

from cache.ids import SessionId, TenantId
from cache.session_cache import SessionCache
from cache.tier_manager import LeaseHeld, TierManager
from cache.tiers import BlobRejected, CacheKey, Tier
from sessions.errors import InvalidInput, SessionNotFound
from sessions.metrics import Metrics
from sessions.registry import SESSION_ID_PREFIX, Registry
from sessions.replicas.role import Replicas
from sessions.transcripts import Transcripts
from sessions.turn.chat_template import ChatTemplate, TemplateDivergence, rendering_digest
from sessions.turn.transcript import Transcript
from storage.errors import SessionGone
from storage.history_store import HistoryStore, NoSuchTurn

log = logging.getLogger(__name__)

TIER_RANK = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2}
"""Which parent to fork from when several hold the prefix: the cheapest cache to read."""


@dataclass(frozen=True)
class Fork:
    """A fork made: its id, and where its cache came from (`device`, `host`, `disk`, `redis`;
    `rebuilt`: its first turn prefills from the transcript; `new`: it starts with no turn)."""

    session_id: SessionId
    source: str


class Forks:
    """Makes forks. Thread-safe.

    Args:
        registry: session lookups (the parent must be the tenant's).
        history: the rows of the fork.
        tiers: where the parent's cache is read, and the fork's placed.
        transcripts: the fork's transcript (its cache must match it).
        template: renders the fork's conversation (the digest its cache records).
        replicas: the fork's ownership lease while its cache is placed (among replicas, a cache
            placed without it would be dropped as another replica's when the fork's turn takes it).
        metrics: counts forks by the source of their cache.
    """

    def __init__(
        self,
        *,
        registry: Registry,
        history: HistoryStore,
        tiers: TierManager,
        transcripts: Transcripts,
        template: ChatTemplate,
        replicas: Replicas,
        metrics: Metrics,
    ) -> None:
        self._registry = registry
        self._history = history
        self._tiers = tiers
        self._transcripts = transcripts
        self._template = template
        self._replicas = replicas
        self._metrics = metrics

    def fork(self, tenant_id: TenantId, parent: str, turns: int, *, origin: str = "fork") -> Fork:
        """Fork the tenant's session `parent` after its first `turns` turns.

        Raises:
            SessionNotFound: if `parent` is not the tenant's session.
            InvalidInput: if `turns` is not between 0 and the parent's turn count.
        """
        record = self._registry.session_record(tenant_id, parent)
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 0:
            raise InvalidInput(f"a fork keeps 0 or more turns, got {turns!r}")
        if turns > record.message_count // 2:
            # Checked before the database sees it: a huge count would overflow its integers.
            raise InvalidInput(f"no turn {turns}: session {parent} has {_turns(record.message_count // 2)}")
        session_id = SessionId(SESSION_ID_PREFIX + secrets.token_hex(12))
        try:
            stream_end = self._history.fork(
                tenant_id=tenant_id, parent_id=record.id, session_id=session_id, turns=turns, origin=origin
            )
        except NoSuchTurn:
            raise InvalidInput(f"no turn {turns}: session {parent} has {_turns(record.message_count // 2)}") from None
        except SessionGone:
            raise SessionNotFound(str(parent)) from None
        source = "new" if turns == 0 else "rebuilt"
        if stream_end is not None:
            source = self._seed(tenant_id, SessionId(record.id), session_id, stream_end) or "rebuilt"
        self._metrics.forks.labels(source).inc()
        log.debug("session %s forked from %s after %d turns (cache: %s)", session_id, record.id, turns, source)
        return Fork(session_id, source)

    def _seed(self, tenant_id: TenantId, parent: SessionId, fork: SessionId, stream_end: int) -> str | None:
        """Place the parent's cache, cut after the fork turn, as the fork's device copy. Returns
        the tier it was read from, or `None` when there is nothing exact to reuse."""
        found = self._parent_cache(CacheKey.for_session(tenant_id, parent))
        if found is None or not self._of_transcript(tenant_id, parent, found[0]):
            return None
        cache, tier = found
        record = self._registry.session_record(tenant_id, fork)
        transcript = self._transcripts.get(tenant_id, fork, record)
        rendered = self._rendering_digest(transcript)
        prefix = None
        if rendered is not None:
            prefix = cache.prefix(stream_end, transcript_digest=transcript.digest, rendering_digest=rendered)
        if prefix is None:
            return None
        key = CacheKey.for_session(tenant_id, fork)
        try:
            with self._replicas.hold(key), self._tiers.lease(key) as lease:
                lease.commit(prefix)
        except LeaseHeld:
            # The fork is new and not yet found by lookups (`HistoryStore.longest_prefix`), so only
            # a client that guessed its id can hold it: that client's turn rebuilds it instead.
            log.info("fork %s is busy before its cache was placed; it rebuilds", fork)
            return None
        return tier.value

    def _of_transcript(self, tenant_id: TenantId, parent: SessionId, cache: SessionCache) -> bool:
        """Whether the parent's cache was computed from the parent's transcript (through as many
        turns as it holds) as the template renders it now: KV computed from another transcript or
        another rendering is never reused."""
        if not cache.layers or cache.layers[-1].turn_index is None:
            return False
        held_turns = cache.layers[-1].turn_index + 1
        transcript = self._transcripts.get(tenant_id, parent, self._registry.session_record(tenant_id, parent))
        if held_turns > len(transcript.turns):
            return False
        held = Transcript(transcript.system_prompt, transcript.turns[:held_turns])
        # The rendering too: the fork's cache is stamped with the digest the template gives now, so
        # KV of a rendering the parent's own next turn would refuse (a date in the system header,
        # another template) would otherwise pass as the fork's.
        return held.digest == cache.transcript_digest and self._rendering_digest(held) == cache.rendering_digest

    def _parent_cache(self, key: CacheKey) -> tuple[SessionCache, Tier] | None:
        """The parent's cache where it is (not moved), its base attached, and its tier."""
        cache = self._tiers.peek(key)
        if cache is not None:
            return cache, Tier.DEVICE
        tier = self._tiers.placement(key) or (Tier.REDIS if self._tiers.has_shared_copy(key) else None)
        if tier is None:
            return None
        try:
            stored = self._tiers.stored_cache(key)
        except BlobRejected as exc:
            log.info("fork of %s rebuilds: its stored cache did not open (%s)", key.name, exc)
            return None
        if stored is None:
            return None
        if stored.base_key is not None:
            base, _ = self._tiers.base_layer(key.tenant_id, stored.base_key, stored.base_token_ids)
            stored = stored.with_base(base)
        return stored, tier

    def _rendering_digest(self, transcript: Transcript) -> str | None:
        """The digest of the template's text through the fork turn's reply (what the fork's cache
        stands for), or `None` for a template without stable cut points (the fork rebuilds)."""
        last = transcript.turns[-1]
        try:
            head = self._template.conversation(transcript.system_prompt, transcript.turns[:-1], last.user_text)
        except TemplateDivergence:
            return None
        return rendering_digest(head.rendering + last.assistant_text)


def _turns(count: int) -> str:
    return f"{count} turn" if count == 1 else f"{count} turns"
