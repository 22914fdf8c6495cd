"""Preparing a turn: restore or rebuild its cache and fit the window, on the caller's thread.

Two ways to the first new token:

- **reuse** (the cache is on the device or restored from host/disk and matches the transcript):
  prefill only the previous reply's unfed tokens, the template's closing of that turn and the new
  turn's framing and message (`ChatTemplate.next_turn`).
- **rebuild** (first turn, no cache stored, a stored cache rejected, another model, or a template
  that renders history differently, now or than when the cache was made): splice the whole
  conversation from the transcript (`ChatTemplate.conversation`, or `whole_conversation` for a
  template that rewrites history), take the base layer from the tenant's prefix pool when it is
  there, and prefill the kept turns plus the new one. A base that is nowhere yet (the first
  session with this system prompt) is prefilled in the same forward pass as the turn and then
  copied into the pool, so a first turn costs one pass, like a plain full prefill.

Either way the window step first makes the turn fit (`sessions.turn.window`: whole oldest turns
demoted, or tokens evicted by attention under the `attention` policy).
What is restored, pooled and kept is the `KvReuse` policy's (`NO_REUSE`, the benchmarks' baseline:
every turn takes the rebuild path without the pool).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cache.ids import PrefixKey, SessionId, TenantId
from cache.layer_table import LayerKind, LayerSpan
from cache.lease import Lease
from cache.prefix_pool import prefix_key
from cache.restore import Restored
from cache.session_cache import BaseLayer, SessionCache
from cache.tier_manager import TierManager
from cache.tiers import Tier
from cache.window_policy import LOSSY_POLICIES, ContextOverflow, WindowPolicy
from sessions.cancellation import CancelToken
from sessions.engine import Engine
from sessions.errors import ContextTooLong
from sessions.records import RestoreSource
from sessions.sampling import SamplingParams
from sessions.turn.chat_template import ChatTemplate, ConversationTokens, TemplateDivergence
from sessions.turn.costs import RestoreChoice, RestoreCosts
from sessions.turn.prepared import PendingBase, PreparedTurn, TurnIds, TurnPlan, TurnStart
from sessions.turn.transcript import Transcript
from sessions.turn.window import TurnWindow, restack_kept

log = logging.getLogger(__name__)

REBUILD_SLACK = 0.25
"""Past a rebuild prefilled at once (`window_rebuild_chunk_tokens` 0) takes beyond the budget, as a
share of the budget: what its eviction chooses from (more keeps more of the old turns by
attention, at a dearer rebuild that also holds it all at once)."""
CHUNKED_REBUILD_SLACK = 0.5
"""Past a chunked rebuild prefills beyond the budget, as a share of the budget: it holds at most the
budget plus a chunk whatever this is, so only its cost grows with it (each token past the budget
is prefilled once, in a chunk that then evicts: benchmarks/window_rebuild.py)."""

_MEASURED = (Tier.HOST, Tier.DISK, Tier.REDIS)
"""Tiers a turn restores from, whose cost it measures (the device costs nothing)."""
_TIER_SOURCES: dict[Tier, RestoreSource] = {
    Tier.DEVICE: "device",
    Tier.HOST: "host",
    Tier.DISK: "disk",
    Tier.REDIS: "redis",
}


@dataclass(frozen=True, slots=True)
class KvReuse:
    """What a turn keeps of the KV cache for the next: the policy the composition root hands the
    preparer, the runner and the turn service. chatkv's own (`keeps`): a session's cache restored
    from its tier (or, with `restore_or_recompute`, prefilled again when estimated cheaper:
    `sessions.turn.costs`) and committed after the turn; base layers shared through the tenant's
    prefix pool. `NO_REUSE`, the benchmarks' baseline, is a stateless server: every turn prefills
    its whole conversation and nothing is kept."""

    keeps: bool = True
    restore_or_recompute: bool = False

    def restore(self, lease: Lease) -> Restored:
        return lease.restore() if self.keeps else Restored(None, None, 0.0)

    def pooled_base(
        self, tiers: TierManager, tenant_id: TenantId, key: PrefixKey, base_ids: tuple[int, ...]
    ) -> tuple[BaseLayer, str] | None:
        return tiers.find_base_layer(tenant_id, key, base_ids) if self.keeps else None

    def adopt_base(self, lease: Lease, base: BaseLayer) -> BaseLayer:
        return lease.adopt_base(base) if self.keeps else base

    def keep(self, lease: Lease, cache: SessionCache | None) -> None:
        """Commit the turn's cache; `None` (a stop string cut the reply inside what the cache
        holds) discards the stored one, so the next turn rebuilds."""
        if self.keeps and cache is not None:
            lease.commit(cache)
        elif self.keeps:
            lease.discard()


NO_REUSE = KvReuse(keeps=False)


class TurnPreparer:
    """Prepares the turns of a `TurnRunner` (see the module docstring)."""

    def __init__(
        self,
        *,
        engine: Engine,
        template: ChatTemplate,
        tiers: TierManager,
        window: WindowPolicy,
        share_base: bool,
        reuse: KvReuse,
    ) -> None:
        self.engine = engine
        self.costs = RestoreCosts()
        self.template = template
        self.tiers = tiers
        self.window = window
        self.fitting = TurnWindow(engine, window, accountant=tiers)
        self.share_base = share_base
        self.reuse = reuse

    def base_key(self, tenant_id: TenantId, session_id: SessionId, base_ids: Sequence[int]) -> PrefixKey:
        """Pool key of a session's base: salted with the tenant (and the session when sharing is off)."""
        salt = tenant_id if self.share_base else TenantId(f"{tenant_id}/{session_id}")
        return prefix_key(salt, self.engine.fingerprint, base_ids)

    def prepare(
        self,
        tenant_id: TenantId,
        session_id: SessionId,
        transcript: Transcript,
        user_text: str,
        params: SamplingParams,
        lease: Lease,
        cancel: CancelToken | None,
    ) -> PreparedTurn:
        """Restore or rebuild, and fit the window: the turn ready for the engine loop. `cancel`
        is checked between the steps.

        Raises:
            ContextTooLong: if the turn cannot fit the window.
            TurnCancelled: if `cancel` was set.
        """
        if cancel is not None:
            cancel.check()
        choice = self._restore_choice(lease, transcript) if self.reuse.restore_or_recompute else None
        if choice is not None and choice.recompute:
            log.info("session %s: prefilling again is estimated cheaper than restoring its cache", session_id)
            restored = Restored(None, None, 0.0)
        else:
            restored = self.reuse.restore(lease)
            if restored.cache is not None and restored.source in _MEASURED:
                self.costs.restored(restored.source.value, restored.cache.total_tokens, restored.seconds)
        cache = restored.cache
        if cache is not None and not self._matches(cache, transcript):
            log.info("session %s: stored cache does not match the transcript; rebuilding", session_id)
            lease.discard()
            cache = None
        source: RestoreSource = "rebuilt" if transcript.turns else "new"
        if restored.cache is None and transcript.turns and self.reuse.keeps:
            log.info("session %s: no stored cache in any tier; rebuilding from the transcript", session_id)
        if cache is not None and restored.source is not None:
            source = _TIER_SOURCES[restored.source]
        if cancel is not None:
            cancel.check()
        plan = None if cache is None else self._reuse_plan(session_id, cache, transcript, user_text, params)
        if cache is not None and plan is None:
            lease.discard()
            cache = None
            source = "rebuilt"
        if cache is not None and plan is not None:
            ids = TurnIds.after(transcript, plan)
            start = self._prepare_reuse(cache, transcript, plan, params, restored.base_prefill_tokens)
        else:
            ids, start = self._prepare_rebuild(tenant_id, session_id, transcript, user_text, params)
        if cancel is not None:
            cancel.check()
        _log_prepared(session_id, "reuse" if cache is not None else "rebuild", source, start, len(ids.turn))
        return PreparedTurn(ids, start, source, restored.seconds, choice)

    def _restore_choice(self, lease: Lease, transcript: Transcript) -> RestoreChoice | None:
        """Restore or recompute, when the session's cache is in a lower tier (`None` on the device
        or nowhere). The tokens either way: the conversation, at most the window."""
        tier = self.tiers.placement(lease.key)
        if tier is None and transcript.turns and self.tiers.has_shared_copy(lease.key):
            tier = Tier.REDIS
        if tier not in _MEASURED:
            return None
        tokens = min(transcript.token_count, self.window.budget_tokens)
        return self.costs.choose(tier.value, tokens)

    # -- reuse ---------------------------------------------------------------------------------

    def _matches(self, cache: SessionCache, transcript: Transcript) -> bool:
        """A restored cache is used only if it was computed from exactly this transcript (an
        edited message, or a cache older than the last stored turn, does not match)."""
        if not transcript.turns or not cache.layers:
            return False
        last = cache.layers[-1]
        return (
            cache.transcript_digest == transcript.digest
            and cache.next_original_index == transcript.token_count
            and last.turn_index == len(transcript.turns) - 1
        )

    def _reuse_plan(
        self,
        session_id: SessionId,
        cache: SessionCache,
        transcript: Transcript,
        user_text: str,
        params: SamplingParams,
    ) -> TurnPlan | None:
        """The turn's ids after the matching `cache`, or `None` when the turn must rebuild (the
        template diverges, or the positions would pass the model's limit)."""
        plan = self._plan_reuse(cache, transcript, user_text)
        if plan is not None and self.fitting.positions_overflow(
            cache, len(plan.closing) + len(plan.turn), params.max_new_tokens
        ):
            log.info("session %s: positions would pass the model's limit; rebuilding the window", session_id)
            return None
        return plan

    def _plan_reuse(self, cache: SessionCache, transcript: Transcript, user_text: str) -> TurnPlan | None:
        try:
            delta = self.template.next_turn(
                transcript.system_prompt, transcript.turns, user_text, cached_digest=cache.rendering_digest
            )
        except TemplateDivergence as exc:
            log.info("chat template diverges (%s); re-prefilling from the transcript", exc)
            return None
        last = transcript.turns[-1].assistant_ids
        # The last generated token was never fed; a stop token is replaced by the template's own
        # closing, any other token (length limit) must be fed first.
        unfed = () if not last or last[-1] in self.engine.stop_token_ids else (last[-1],)
        return TurnPlan(closing=unfed + delta.closing_ids, turn=delta.turn_ids, rendering=delta.rendering)

    def _prepare_reuse(
        self, cache: SessionCache, transcript: Transcript, plan: TurnPlan, params: SamplingParams, base_computed: int
    ) -> TurnStart:
        """`base_computed`: base tokens the restore recomputed (no copy of the base was stored)."""
        fitted = self.fitting.fit(_apply_pins(cache, transcript.pinned), plan.closing, plan.turn, params.max_new_tokens)
        cache = fitted.cache
        closing = () if fitted.last_demoted else plan.closing
        spans: tuple[LayerSpan, ...] = ()
        if closing:
            spans = (replace(cache.layers[-1], token_count=cache.layers[-1].token_count + len(closing)),)
        return TurnStart(
            cache,
            feed=closing,
            spans=spans,
            reused_tokens=cache.total_tokens - fitted.recomputed_tokens,
            base_reused=cache.base_tokens,
            demoted_tokens=fitted.demoted_tokens,
            base_computed=base_computed + fitted.recomputed_tokens,
            working=fitted.working,
            prefilled_tokens=fitted.prefilled_tokens,
            peak_tokens=fitted.peak_tokens,
        )

    # -- rebuild -------------------------------------------------------------------------------

    def _prepare_rebuild(
        self,
        tenant_id: TenantId,
        session_id: SessionId,
        transcript: Transcript,
        user_text: str,
        params: SamplingParams,
    ) -> tuple[TurnIds, TurnStart]:
        conversation = self._conversation(transcript, user_text)
        ids = TurnIds.of_conversation(transcript, conversation)
        past_spans = _past_spans(conversation, transcript.pinned)
        if self.window.policy in LOSSY_POLICIES and self.reuse.keeps:
            by_eviction = self._rebuild_by_eviction(
                tenant_id, session_id, transcript, conversation, past_spans, ids.turn, params
            )
            if by_eviction is not None:
                return ids, by_eviction
        base_tokens = conversation.base_tokens
        window = self.fitting.plan_layers(past_spans, base_tokens, 0, len(ids.turn), params.max_new_tokens)
        base, pending_base = self._pooled_or_pending_base(tenant_id, session_id, conversation)
        kept = restack_kept(_stream_layers(conversation.token_ids, past_spans), window.demote, base_tokens)
        base_reused = base_tokens if base is not None else 0
        return ids, TurnStart(
            self.engine.empty_cache(base),
            feed=(*(pending_base.token_ids if pending_base is not None else ()), *kept.ids),
            spans=kept.spans,
            reused_tokens=base_reused,
            base_reused=base_reused,
            demoted_tokens=window.demoted_tokens,
            pending_base=pending_base,
        )

    def _conversation(self, transcript: Transcript, user_text: str) -> ConversationTokens:
        try:
            return self.template.conversation(transcript.system_prompt, transcript.turns, user_text)
        except TemplateDivergence as exc:
            # No stable cut points: the template's own rendering of everything, history as one layer.
            log.warning("chat template has no stable prefix (%s); history becomes one layer", exc)
            return self.template.whole_conversation(transcript.system_prompt, transcript.turns, user_text)

    def _pooled_or_pending_base(
        self, tenant_id: TenantId, session_id: SessionId, conversation: ConversationTokens
    ) -> tuple[BaseLayer | None, PendingBase | None]:
        """The plain rebuild's base layer: from the pool, or else pending (computed in this turn's
        own forward pass and adopted into the pool afterwards). Neither without a base."""
        base_ids = tuple(conversation.token_ids[: conversation.base_tokens])
        if not base_ids:
            return None, None
        key = self.base_key(tenant_id, session_id, base_ids)
        found = self.reuse.pooled_base(self.tiers, tenant_id, key, base_ids)
        if found is None:
            return None, PendingBase(key, base_ids)
        return found[0], None

    def _rebuild_by_eviction(
        self,
        tenant_id: TenantId,
        session_id: SessionId,
        transcript: Transcript,
        conversation: ConversationTokens,
        past_spans: list[LayerSpan],
        new_turn: tuple[int, ...],
        params: SamplingParams,
    ) -> TurnStart | None:
        """The rebuild under a lossy policy: the past is fitted into the budget by the same per-head
        eviction as a reuse turn, instead of dropping whole turns down to the budget, so a rebuild
        (after a restart without a stored cache, or positions that outgrew the model) keeps the
        tokens attention uses, from more of the conversation.

        The cost follows the budget, not the conversation (issue 31). Whole oldest turns still go
        until the past fits the budget plus a share of it (`CHUNKED_REBUILD_SLACK` when chunked,
        `REBUILD_SLACK` at once; at most half-way to the model's position limit, since kept keys
        keep their positions). What is left is prefilled at contiguous positions:

        - at once (`window_rebuild_chunk_tokens` 0, the default; `attention` only, `agnostic`
          drops whole turns): the whole kept past, up to 1.25x the budget;
        - in chunks (> 0, `attention` and `agnostic`): each chunk scores what is held and evicts
          down to the budget before the next (`TurnWindow.prefill_evicting`), so no buffer holds
          more than the budget plus a chunk, at the price of worse replies in
          benchmarks/window_rebuild.py (each eviction is judged by one chunk's queries).

        Then the turn's own prefill fits the rest (`TurnWindow.fit`: by the new turn's queries
        under `attention`, by the scores the chunks left under `agnostic`).

        Returns `None` when nothing needs evicting (the plain rebuild then does the same work in
        the turn's own prefill), when eviction cannot make the turn fit (the plain rebuild drops
        whole turns, or raises `ContextTooLong`), or for a model without full-attention layers."""
        chunked = self.window.rebuild_chunk_tokens > 0
        if not chunked and self.window.policy != "attention":
            return None
        ids, base_tokens = conversation.token_ids, conversation.base_tokens
        budget = self.window.budget_tokens
        slack = int(budget * (CHUNKED_REBUILD_SLACK if chunked else REBUILD_SLACK))
        positions = budget + min(slack, max(0, self.engine.max_context_tokens - budget) // 2)
        by_positions = replace(self.window, budget_tokens=positions)
        try:
            window = by_positions.plan(past_spans, base_tokens, 0, len(new_turn), params.max_new_tokens)
        except ContextOverflow:
            return None
        if window.needed_tokens <= budget:
            return None
        base = None
        base_reused = 0
        if base_tokens:
            key = self.base_key(tenant_id, session_id, ids[:base_tokens])
            base, origin = self.tiers.base_layer(tenant_id, key, tuple(ids[:base_tokens]))
            base_reused = 0 if origin == "built" else base_tokens
        empty = self.engine.empty_cache(base)
        if not empty.full_layers:
            return None
        kept = restack_kept(_stream_layers(ids, past_spans), window.demote, base_tokens)
        try:
            if chunked:
                past = self.fitting.prefill_evicting(empty, kept)
                cache, peak = past.cache, past.peak_tokens
            else:
                cache = self.fitting.prefill_layers(empty, kept.ids, kept.spans)
                peak = cache.total_tokens
            fitted = self.fitting.fit(_apply_pins(cache, transcript.pinned), (), new_turn, params.max_new_tokens)
        except ContextTooLong:  # the base, pins and recent window alone are too large: whole turns must go
            return None
        evicted = sum(span.evicted_tokens for span in fitted.cache.layers)
        return TurnStart(
            fitted.cache,
            reused_tokens=base_reused,
            base_reused=base_reused,
            demoted_tokens=window.demoted_tokens + evicted,
            base_computed=base_tokens - base_reused + len(kept.ids),
            working=fitted.working,
            prefilled_tokens=fitted.prefilled_tokens,
            peak_tokens=max(peak, fitted.peak_tokens),
        )


def _past_spans(conversation: ConversationTokens, pinned: set[int]) -> list[LayerSpan]:
    """One row per past turn of the whole stream, at its stream position."""
    starts = conversation.turn_starts
    return [
        LayerSpan(
            LayerKind.BASE if index in pinned else LayerKind.TURN,
            index,
            starts[index + 1] - starts[index],
            starts[index],
            starts[index],
        )
        for index in range(len(starts) - 1)
    ]


def _stream_layers(ids: Sequence[int], spans: Sequence[LayerSpan]) -> list[tuple[LayerSpan, Sequence[int]]]:
    """Each of `spans` (rows of the conversation stream `ids`) with the ids it covers."""
    return [(span, ids[span.original_start : span.original_start + span.original_tokens]) for span in spans]


def _apply_pins(cache: SessionCache, pinned: set[int]) -> SessionCache:
    layers = [
        replace(span, kind=LayerKind.BASE) if span.turn_index in pinned and not span.pinned else span
        for span in cache.layers
    ]
    return cache.replace_layers(layers) if layers != list(cache.layers) else cache


def _log_prepared(session_id: SessionId, path: str, source: RestoreSource, start: TurnStart, turn_tokens: int) -> None:
    """One debug line per turn: the way it starts and what it costs before its own prefill."""
    log.debug(
        "session %s: %s from %s: %d cached tokens reused (%d of them the base), %d fed before the turn's %d, "
        "%d demoted, %d prefilled while preparing",
        session_id,
        path,
        source,
        start.reused_tokens,
        start.base_reused,
        len(start.feed),
        turn_tokens,
        start.demoted_tokens,
        start.base_computed,
    )
