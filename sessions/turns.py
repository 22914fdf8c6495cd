"""One turn of one session: restore or rebuild the cache, fit the window, prefill, decode, store.

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

Either way the window step first makes the turn fit (`sessions.turn_prep`: whole oldest turns
demoted, or tokens evicted by attention under the `attention` policy).
With `reuse_kv` off (a benchmark baseline) every turn takes the rebuild path without the pool.

A turn with stop strings ends early once its text contains one (`sessions.stop_strings`): the
request is finished at the loop's next step and the reply returned is cut before the stop string.
The turn stores what its client saw, as a posted history of it would (the cut text, its ids and a
stop token), so continuing the session answers as a fresh post of that history does: the cache is
cropped back to the end of the cut text when those ids are the first generated ones, and is not
kept otherwise (a cut inside a token), so that the next turn rebuilds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

from cache.ids import PrefixKey, SessionId, TenantId
from cache.lease import Lease
from cache.prefix_pool import prefix_key
from cache.restore import Restored
from cache.session_cache import BaseLayer, LayerKind, LayerSpan, SessionCache, WorkingCache
from cache.tier_manager import TierManager
from cache.tiers import CacheKey, Tier
from cache.window_policy import MIN_TURN_TOKENS, ContextOverflow, WindowPlan, WindowPolicy
from sessions.cancellation import CancelToken
from sessions.chat_template import ChatTemplate, ConversationTokens, PastTurn, TemplateDivergence, rendering_digest
from sessions.detokenizer import IncrementalDetokenizer
from sessions.engine import Engine, Request, RequestResult
from sessions.errors import ContextTooLong, SessionNotFound
from sessions.records import FinishReason, Reply, RestoreSource, TurnStats
from sessions.sampling import SamplingParams
from sessions.stop_strings import NO_STOP, StopScanner, StopStrings
from sessions.transcript import Transcript, transcript_digest
from sessions.turn_prep import TurnWindow

log = logging.getLogger(__name__)

_TIER_SOURCES: dict[Tier, RestoreSource] = {
    Tier.DEVICE: "device",
    Tier.HOST: "host",
    Tier.DISK: "disk",
    Tier.REDIS: "redis",
}


@dataclass(frozen=True)
class TurnPlan:
    """Ids of the turn and how they split: `closing` ends the previous turn's layer (dropped when
    that layer is demoted), `turn` starts the new layer. `rendering`: the template's text of the
    conversation up to the generation prompt."""

    closing: tuple[int, ...]
    turn: tuple[int, ...]
    rendering: str = ""


@dataclass(frozen=True)
class TurnOutcome:
    """Everything the manager stores after the turn."""

    reply: Reply
    cache: SessionCache | None
    """The session's cache after the turn; `None` when it is not kept (a stop string cut the reply
    where no cache ends: the next turn rebuilds from the transcript)."""
    user_token_ids: tuple[int, ...]
    reply_token_ids: tuple[int, ...]
    """Ids the transcript stores for the reply: the generated ids (`Reply.token_ids`), or after a
    stop string the returned text's ids and a stop token, as a posted history of that text has."""
    token_count: int
    """Conversation-stream length once the reply's stored ids are fed (all but the last)."""
    unpinned_turn: int | None = None
    """A turn due to be pinned (`pin_first_turn`) that was left unpinned: pinning it would have
    left less than `MIN_TURN_TOKENS` of the window."""


class TurnRunner:
    """Runs turns; shared by all sessions of a `SessionManager`."""

    def __init__(
        self,
        *,
        engine: Engine,
        template: ChatTemplate,
        tiers: TierManager,
        window: WindowPolicy,
        share_base: bool,
        reuse_kv: bool = True,
    ) -> None:
        self.engine = engine
        self.template = template
        self.tiers = tiers
        self.window = window
        self.fitting = TurnWindow(engine, window, accountant=tiers)
        self.share_base = share_base
        self.reuse_kv = reuse_kv
        self._active: dict[CacheKey, Request] = {}
        self._active_lock = threading.Lock()
        self._preparing: Counter[TenantId] = Counter()
        self._closed_error: BaseException | None = None

    @contextmanager
    def _running(self, key: CacheKey, request: Request, cancel: CancelToken | None) -> Iterator[None]:
        """Track the session's request while the turn reads it; a turn abandoned by its caller
        (a closed stream, or `cancel` set) cancels it, so the loop frees its KV at the next step."""
        with self._active_lock:
            self._active[key] = request
            if self._closed_error is not None:
                request.cancel(self._closed_error)
        unregister = cancel.on_cancel(request.cancel) if cancel is not None else None
        try:
            yield
        finally:
            if unregister is not None:
                unregister()
            with self._active_lock:
                if self._active.get(key) is request:
                    del self._active[key]
            request.cancel()
            self.engine.loop.wake()

    @contextmanager
    def _preparation(self, tenant_id: TenantId) -> Iterator[None]:
        """Count a turn as preparing (restore, template, window) until it reaches the engine loop:
        that work runs on the caller's thread and can be long, so it shows as a running turn."""
        with self._active_lock:
            self._preparing[tenant_id] += 1
        try:
            yield
        finally:
            with self._active_lock:
                self._preparing[tenant_id] -= 1
                if not self._preparing[tenant_id]:
                    del self._preparing[tenant_id]

    def preparing_by_tenant(self) -> dict[TenantId, int]:
        """Turns being prepared now, per tenant (see `_preparation`)."""
        with self._active_lock:
            return dict(self._preparing)

    def cancel_requests(self, tenant_id: TenantId, session_id: SessionId | None = None) -> None:
        """Cancel the requests in flight of one session (or, with `None`, of every session of the
        tenant), which was deleted: their turns raise `SessionNotFound` instead of finishing."""
        with self._active_lock:
            doomed = [
                (key, request)
                for key, request in self._active.items()
                if key.tenant_id == tenant_id and session_id in (None, key.name)
            ]
        for key, request in doomed:
            request.cancel(SessionNotFound(key.name))
        self.engine.loop.wake()

    def cancel_all(self, error: BaseException) -> None:
        """Cancel every request in flight, and every later one: their turns raise `error` (the
        manager is closing)."""
        with self._active_lock:
            self._closed_error = error
            doomed = list(self._active.values())
        for request in doomed:
            request.cancel(error)
        self.engine.loop.wake()

    def base_key(self, tenant_id: TenantId, session_id: SessionId, base_ids: Sequence[int]) -> PrefixKey:
        """Pool key of a session's base: salted with the tenant (and the session when sharing is off)."""
        salt = tenant_id if self.share_base else TenantId(f"{tenant_id}/{session_id}")
        return prefix_key(salt, self.engine.fingerprint, base_ids)

    def run(
        self,
        *,
        tenant_id: TenantId,
        session_id: SessionId,
        transcript: Transcript,
        user_text: str,
        params: SamplingParams,
        lease: Lease,
        stop: StopStrings = NO_STOP,
        cancel: CancelToken | None = None,
    ) -> Iterator[str | TurnOutcome]:
        """Yield reply text pieces (up to the first stop string), then one `TurnOutcome`. Nothing
        is stored here.

        Args:
            cancel: stops the turn between its preparation steps, or its request in the loop.

        Raises:
            ContextTooLong: if the turn cannot fit the window; raised before any model work.
            TurnCancelled: if `cancel` was set before the reply was complete.
        """
        started = time.perf_counter()
        with self._preparation(tenant_id):
            prepared, source, restore_s = self._prepare(
                tenant_id, session_id, transcript, user_text, params, lease, cancel
            )
        yield from self._generate(
            prepared, transcript, user_text, params, stop, started, source, restore_s, lease, cancel
        )

    def _prepare(
        self,
        tenant_id: TenantId,
        session_id: SessionId,
        transcript: Transcript,
        user_text: str,
        params: SamplingParams,
        lease: Lease,
        cancel: CancelToken | None,
    ) -> tuple[_Prepared, RestoreSource, float]:
        """Restore or rebuild, and fit the window: the turn ready for the engine loop, where its
        cache came from, and the restore's seconds. `cancel` is checked between the steps."""
        if cancel is not None:
            cancel.check()
        restored = lease.restore() if self.reuse_kv else Restored(None, None, 0.0)
        cache = restored.cache
        if cache is not None and not self._matches(cache, transcript):
            log.info("session %s: stored cache does not match the transcript; rebuilding", session_id)
            lease.discard()
            cache = None
        source: RestoreSource = "rebuilt" if transcript.turns else "new"
        if restored.cache is None and transcript.turns and self.reuse_kv:
            log.info("session %s: no stored cache in any tier; rebuilding from the transcript", session_id)
        if cache is not None and restored.source is not None:
            source = _TIER_SOURCES[restored.source]
        if cancel is not None:
            cancel.check()
        plan = None
        if cache is not None:
            plan = self._plan_reuse(cache, transcript, user_text)
            if plan is not None and self.fitting.positions_overflow(
                cache, len(plan.closing) + len(plan.turn), params.max_new_tokens
            ):
                log.info("session %s: positions would pass the model's limit; rebuilding the window", session_id)
                plan = None
            if plan is None:
                lease.discard()
                cache = None
                source = "rebuilt"
        if cache is not None and plan is not None:
            prepared = self._prepare_reuse(cache, transcript, plan, params)
            # A base recomputed during the restore was prefilled too.
            prepared = replace(prepared, base_computed=restored.base_prefill_tokens)
        else:
            prepared = self._prepare_rebuild(tenant_id, session_id, transcript, user_text, params)
        if cancel is not None:
            cancel.check()
        return prepared, source, restored.seconds

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
        self, cache: SessionCache, transcript: Transcript, plan: TurnPlan, params: SamplingParams
    ) -> _Prepared:
        fitted = self.fitting.fit(_apply_pins(cache, transcript.pinned), plan.closing, plan.turn, params.max_new_tokens)
        cache = fitted.cache
        closing = () if fitted.last_demoted else plan.closing
        spans: list[LayerSpan] = []
        if closing:
            spans.append(replace(cache.layers[-1], token_count=cache.layers[-1].token_count + len(closing)))
        turn_index = len(transcript.turns)
        spans.append(
            self._turn_span(
                turn_index,
                transcript,
                transcript.token_count + len(plan.closing),
                cache.next_position + len(closing),
            )
        )
        return _Prepared(
            cache=cache,
            prefill=closing + plan.turn,
            spans=tuple(spans),
            new_turn_prefill=len(plan.turn),
            reused_tokens=cache.total_tokens,
            base_reused=cache.base_tokens,
            demoted_tokens=fitted.demoted_tokens,
            base_computed=0,
            user_token_ids=plan.closing + plan.turn,
            stream_before_reply=transcript.token_count + len(plan.closing) + len(plan.turn),
            rendering=plan.rendering,
        )

    # -- rebuild -------------------------------------------------------------------------------

    def _prepare_rebuild(
        self,
        tenant_id: TenantId,
        session_id: SessionId,
        transcript: Transcript,
        user_text: str,
        params: SamplingParams,
    ) -> _Prepared:
        try:
            conversation = self.template.conversation(transcript.system_prompt, transcript.turns, user_text)
        except TemplateDivergence as exc:
            # No stable cut points: the template's own rendering of everything, history as one layer.
            log.warning("chat template has no stable prefix (%s); history becomes one layer", exc)
            conversation = self.template.whole_conversation(transcript.system_prompt, transcript.turns, user_text)
        ids, base_tokens, starts = conversation.token_ids, conversation.base_tokens, conversation.turn_starts
        base_ids = ids[:base_tokens]
        past_spans = []
        for index in range(len(starts) - 1):
            kind = LayerKind.BASE if index in transcript.pinned else LayerKind.TURN
            past_spans.append(LayerSpan(kind, index, starts[index + 1] - starts[index], starts[index], starts[index]))
        new_turn = tuple(ids[starts[-1] :])
        if self.window.policy == "attention" and self.reuse_kv:
            by_attention = self._rebuild_by_attention(
                tenant_id, session_id, transcript, conversation, past_spans, new_turn, params
            )
            if by_attention is not None:
                return by_attention
        window = self._plan_window(past_spans, base_tokens, TurnPlan((), new_turn), params)
        dropped = {span.original_start for span in window.demote}
        kept = [span for span in past_spans if span.original_start not in dropped]
        base_reused = 0
        base = None
        pending_base = None
        prefill: list[int] = []
        if base_tokens:
            key = self.base_key(tenant_id, session_id, base_ids)
            found = self.tiers.find_base_layer(tenant_id, key, tuple(base_ids)) if self.reuse_kv else None
            if found is None:
                # Computed in this turn's own forward pass and adopted into the pool afterwards.
                pending_base = _PendingBase(key, tuple(base_ids))
                prefill.extend(base_ids)
            else:
                base = found[0]
                base_reused = base_tokens
        cache = self.engine.empty_cache(base)
        spans: list[LayerSpan] = []
        position = base_tokens
        for span in kept:
            prefill.extend(ids[span.original_start : span.original_start + span.token_count])
            spans.append(replace(span, position_start=position))
            position += span.token_count
        prefill.extend(new_turn)
        turn_index = len(transcript.turns)
        spans.append(self._turn_span(turn_index, transcript, starts[-1], position))
        return _Prepared(
            cache=cache,
            prefill=tuple(prefill),
            spans=tuple(spans),
            new_turn_prefill=len(new_turn),
            reused_tokens=base_reused,
            base_reused=base_reused,
            demoted_tokens=window.demoted_tokens,
            base_computed=0,
            # The same ids the reuse path records: everything after the previous turn's fed tokens.
            user_token_ids=tuple(ids[min(transcript.token_count, starts[-1]) :]),
            stream_before_reply=len(ids),
            rendering=conversation.rendering,
            pending_base=pending_base,
        )

    def _rebuild_by_attention(
        self,
        tenant_id: TenantId,
        session_id: SessionId,
        transcript: Transcript,
        conversation: ConversationTokens,
        past_spans: list[LayerSpan],
        new_turn: tuple[int, ...],
        params: SamplingParams,
    ) -> _Prepared | None:
        """The rebuild under the `attention` policy: the past that stays is prefilled here, at
        once, and then fitted into the budget by the same scoring and per-head eviction as a reuse
        turn, so a rebuild (after a restart without a stored cache, or positions that outgrew the
        model) keeps the tokens attention uses instead of dropping whole turns down to the budget.

        Kept keys keep their positions, so what the rebuild keeps also spends positions: whole
        oldest turns still go until the turn fits half-way between the budget and the model's
        position limit. Half of the positions above the budget hold older turns (by attention),
        half are left for the turns that follow before the next rebuild.

        Returns `None` when nothing needs evicting (the plain rebuild then does the same work in
        the turn's own prefill), or when eviction cannot make the turn fit (the plain rebuild
        drops whole turns, or raises `ContextTooLong`)."""
        ids, base_tokens, starts = conversation.token_ids, conversation.base_tokens, conversation.turn_starts
        budget = self.window.budget_tokens
        positions = budget + max(0, self.engine.max_context_tokens - budget) // 2
        by_positions = replace(self.window, budget_tokens=positions)
        try:
            window = by_positions.plan(past_spans, base_tokens, 0, len(new_turn), params.max_new_tokens)
        except ContextOverflow:
            return None
        if window.needed_tokens <= budget:
            return None
        dropped = {span.original_start for span in window.demote}
        base = None
        base_reused = base_computed = 0
        if base_tokens:
            key = self.base_key(tenant_id, session_id, ids[:base_tokens])
            base, origin = self.tiers.base_layer(tenant_id, key, tuple(ids[:base_tokens]))
            base_reused, base_computed = (0, base_tokens) if origin == "built" else (base_tokens, 0)
        cache = self.engine.empty_cache(base)
        spans: list[LayerSpan] = []
        past_ids: list[int] = []
        position = base_tokens
        for span in past_spans:
            if span.original_start in dropped:
                continue
            past_ids.extend(ids[span.original_start : span.original_start + span.token_count])
            spans.append(replace(span, position_start=position))
            position += span.token_count
        cache = self.fitting.prefill_layers(cache, past_ids, spans)
        try:
            fitted = self.fitting.fit(_apply_pins(cache, transcript.pinned), (), new_turn, params.max_new_tokens)
        except ContextTooLong:  # the recent window alone is too large: whole turns must go
            return None
        turn_index = len(transcript.turns)
        return _Prepared(
            cache=fitted.cache,
            prefill=new_turn,
            spans=(self._turn_span(turn_index, transcript, starts[-1], fitted.cache.next_position),),
            new_turn_prefill=len(new_turn),
            reused_tokens=base_reused,
            base_reused=base_reused,
            demoted_tokens=window.demoted_tokens + fitted.demoted_tokens,
            base_computed=base_computed + len(past_ids),
            user_token_ids=tuple(ids[min(transcript.token_count, starts[-1]) :]),
            stream_before_reply=len(ids),
            rendering=conversation.rendering,
        )

    # -- shared --------------------------------------------------------------------------------

    def _plan_window(
        self, layers: Sequence[LayerSpan], base_tokens: int, plan: TurnPlan, params: SamplingParams
    ) -> WindowPlan:
        return self.fitting.plan_layers(layers, base_tokens, len(plan.closing), len(plan.turn), params.max_new_tokens)

    def _turn_span(self, turn_index: int, transcript: Transcript, original_start: int, position: int) -> LayerSpan:
        kind = LayerKind.BASE if turn_index in transcript.pinned else LayerKind.TURN
        return LayerSpan(kind, turn_index, 0, original_start, position)

    def _generate(
        self,
        prepared: _Prepared,
        transcript: Transcript,
        user_text: str,
        params: SamplingParams,
        stop: StopStrings,
        started: float,
        source: RestoreSource,
        restore_s: float,
        lease: Lease,
        cancel: CancelToken | None,
    ) -> Iterator[str | TurnOutcome]:
        engine = self.engine
        request = Request(
            tenant_id=lease.key.tenant_id,
            prefill_ids=prepared.prefill,
            params=params,
            start=prepared.cache,
            stop_token_ids=engine.stop_token_ids,
            accountant=self.tiers,
            bytes_per_token=engine.layout.bytes_per_token,
        )
        detokenizer = IncrementalDetokenizer(engine.tokenizer)
        scanner = StopScanner(stop)
        generated: list[int] = []
        ttft_s = 0.0
        decode_started = time.perf_counter()
        with self._running(lease.key, request, cancel):
            stream = engine.submit(request).tokens()
            while True:
                try:
                    token = next(stream)
                except StopIteration as done:
                    result: RequestResult = done.value
                    break
                if not generated:
                    ttft_s = time.perf_counter() - started
                    decode_started = time.perf_counter()
                generated.append(token)
                # After a stop string the loop may have sampled a few more tokens: they are fed to
                # the cache, so they are kept (and decoded for the stored text) but not returned.
                if token in engine.stop_token_ids or not detokenizer.push(token) or scanner.cut is not None:
                    continue
                piece = scanner.push(detokenizer.text)
                if scanner.cut is not None:
                    request.finish_early()
                    engine.loop.wake()
                if piece:
                    yield piece
        working = result.working
        detokenizer.finish()
        tail = scanner.finish(detokenizer.text)
        if tail:
            yield tail
        decode_s = time.perf_counter() - decode_started
        start, prefilled = prepared.cache, prepared.prefill
        if prepared.pending_base is not None:
            start = self.engine.empty_cache(self._adopt_base(prepared.pending_base, working, lease))
            prefilled = prefilled[start.base_tokens :]
        cut = scanner.cut
        text = detokenizer.text if cut is None else detokenizer.text[:cut]
        stored_ids, keep = (tuple(generated), True) if cut is None else self._cut_reply(text, generated)
        # The reply's part of the stream: every stored id but the last (the generated one never
        # fed, or the stop token after a cut, replaced by the template's closing next turn).
        reply_tokens = len(stored_ids) - 1
        if keep and reply_tokens < len(generated) - 1:
            working.crop(reply_tokens - (len(generated) - 1))  # transformers 5 crops by a negative count
        spans = list(prepared.spans)
        spans[-1] = replace(spans[-1], token_count=prepared.new_turn_prefill + reply_tokens)
        unpinned = None
        if spans[-1].pinned and not self._pins_leave_room(start, spans):
            unpinned = spans[-1].turn_index
            spans[-1] = replace(spans[-1], kind=LayerKind.TURN)
            log.warning("turn %s is not pinned: it would leave no room in the window", unpinned)
        turn = PastTurn(user_text, text, stored_ids)
        digest = transcript_digest(transcript.digest, turn, None)
        rendered = rendering_digest(prepared.rendering + text)
        cache = None
        if keep:
            appended = (*prefilled, *generated[:reply_tokens])
            cache = start.after_turn(working, appended, spans, transcript_digest=digest, rendering_digest=rendered)
        stopped = cut is not None or bool(generated and generated[-1] in engine.stop_token_ids)
        finish: FinishReason = "stop" if stopped else "length"
        stats = TurnStats(
            prefill_tokens=len(prepared.prefill) + prepared.base_computed,
            reused_tokens=prepared.reused_tokens,
            ttft_s=ttft_s,
            decode_tokens=len(generated),
            decode_s=decode_s,
            restored_from=source,
            restore_s=restore_s,
            base_reused_tokens=prepared.base_reused,
            demoted_tokens=prepared.demoted_tokens,
            cache_tokens=0 if cache is None else cache.total_tokens,
            queue_s=result.queue_s,
        )
        reply = Reply(
            text=text,
            token_ids=tuple(generated),
            stats=stats,
            finish_reason=finish,
            generated_text=None if cut is None else detokenizer.text,
        )
        # Whether the cache was kept or the next turn rebuilds, the stream goes on after the
        # reply's stored ids, as a rebuild from the transcript counts it.
        token_count = prepared.stream_before_reply + reply_tokens
        yield TurnOutcome(reply, cache, prepared.user_token_ids, stored_ids, token_count, unpinned)

    def _cut_reply(self, text: str, generated: Sequence[int]) -> tuple[tuple[int, ...], bool]:
        """The ids a reply cut by a stop string is stored with, and whether the turn's cache can
        be kept.

        The ids are those a posted history with the returned `text` stores
        (`ChatTemplate.text_reply_ids`: `text` tokenised, then a stop token), so that continuing
        the session answers as a fresh post of what the client saw. The cache is kept (cropped
        to end after `text`'s ids) only if those ids are the first generated ones and were fed:
        not when the cut fell inside a token or `text` tokenises another way; the next turn then
        rebuilds from the transcript.
        """
        stored = self.template.text_reply_ids(text)
        content = self.template.content_ids(stored)
        fed = len(generated) - 1  # the working cache holds every generated id but the last
        return stored, len(content) <= fed and tuple(generated[: len(content)]) == content

    def _adopt_base(self, pending: _PendingBase, working: WorkingCache, lease: Lease) -> BaseLayer:
        """Copy the base prefix out of the turn's working cache into the tenant's pool (not
        pooled with `reuse_kv` off)."""
        n = len(pending.token_ids)
        keys = tuple(layer.filled_keys[:, :, :n].clone() for layer in working.prealloc_layers)
        values = tuple(layer.filled_values[:, :, :n].clone() for layer in working.prealloc_layers)
        base = BaseLayer(pending.key, pending.token_ids, keys, values)
        return lease.adopt_base(base) if self.reuse_kv else base

    def _pins_leave_room(self, cache: SessionCache, spans: Sequence[LayerSpan]) -> bool:
        first_new = spans[0].original_start
        layers = [s for s in cache.layers if s.original_start < first_new] + list(spans)
        pinned = sum(s.token_count for s in layers if s.pinned)
        return cache.base_tokens + pinned + MIN_TURN_TOKENS <= self.window.budget_tokens


@dataclass(frozen=True)
class _PendingBase:
    """A base layer that is in neither the pool nor a blob: the turn prefills it first."""

    key: PrefixKey
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class _Prepared:
    """A turn ready to prefill.

    Attributes:
        cache: the session cache the turn starts from (after demotion), base attached.
        prefill: ids to run through the model before the first new token.
        spans: layer-table rows from the first layer the turn touches; the last is the new turn,
            whose `token_count` is set once generation finishes.
        new_turn_prefill: how many of the `prefill` ids (at its end) belong to the new turn.
        reused_tokens: tokens served from cache (session cache or pooled base).
        base_reused: part of `reused_tokens` that is the shared base layer.
        demoted_tokens: tokens windowed out before this turn.
        base_computed: base-layer tokens prefilled, outside `prefill`, during a restore because no
            copy of the base was stored.
        user_token_ids: ids recorded with the user message (its closing of the previous turn,
            framing and text, up to the generation prompt).
        stream_before_reply: conversation-stream length once the prefill is fed.
        rendering: the template's text of the conversation up to the generation prompt; with the
            reply's text it gives the new cache's `rendering_digest`.
        pending_base: set when `prefill` starts with the base layer's ids (`cache` then has no
            base); the base is copied into the pool after the turn.
    """

    cache: SessionCache
    prefill: tuple[int, ...]
    spans: tuple[LayerSpan, ...]
    new_turn_prefill: int
    reused_tokens: int
    base_reused: int
    demoted_tokens: int
    base_computed: int
    user_token_ids: tuple[int, ...]
    stream_before_reply: int
    rendering: str
    pending_base: _PendingBase | None = None


def _apply_pins(cache: SessionCache, pinned: set[int]) -> SessionCache:
    layers = [
        replace(span, kind=LayerKind.BASE) if span.turn_index in pinned and not span.pinned else span
        for span in cache.layers
    ]
    return cache.replace_layers(layers) if layers != list(cache.layers) else cache
