"""One turn of one session, from its preparation to its outcome: `TurnRunner.run` prepares the turn
(`TurnPreparer`: restore or rebuild, fit the window), submits it to the engine loop, streams its
reply and completes it (`complete_turn`). Nothing is stored here: the manager stores the outcome.

A turn with stop strings ends early once its text contains one (`sessions.turn.stop_strings`): the
request is finished at the loop's next step and the reply returned is cut before the stop string
(what the turn then stores: `sessions.turn.completion`). With `min_new_tokens`, neither a stop
token (masked in sampling: `Request.sample`) nor a stop string ends a reply before that many tokens.

Under the `agnostic` window policy the runner also fixes the committed cache's scores, after the
reply was streamed and before the outcome is returned for storing (so no later turn sees the cache
without them): KVzip's reconstruction of the ids the turn added (`_commit_scores`), a prefill-only
request of the engine loop per chunk. A turn cancelled or failed before its reply was complete
never gets there; a reconstruction that fails loses only the scores (the cache evicts by recency
until a later turn scores it), never the turn.

The runner also keeps count of what is in flight: the turns being prepared, per tenant (they show
as running turns), and each session's engine request, so a deleted session or a closing manager
can cancel it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import replace

from cache.ids import SessionId, TenantId
from cache.lease import Lease
from cache.session_cache import BaseLayer, SessionCache
from cache.tier_manager import TierManager
from cache.tiers import CacheKey
from cache.token_eviction import committed_scores
from cache.working_cache import WorkingCache
from sessions.cancellation import CancelToken
from sessions.engine import Engine, Request, RequestResult
from sessions.errors import SessionNotFound
from sessions.sampling import SamplingParams
from sessions.turn.chat_template import TemplateDivergence
from sessions.turn.completion import Generation, TurnOutcome, TurnRules, complete_turn
from sessions.turn.detokenizer import IncrementalDetokenizer
from sessions.turn.prepared import PendingBase, PreparedTurn
from sessions.turn.preparer import TurnPreparer
from sessions.turn.stop_strings import NO_STOP, StopScanner, StopStrings
from sessions.turn.transcript import Transcript
from sessions.turn.window import RECONSTRUCTION_CHUNK_TOKENS, RECONSTRUCTION_INSTRUCTION

log = logging.getLogger(__name__)


class TurnRunner:
    """Runs turns; shared by all sessions of a `SessionManager`. `preparer`: built by the
    composition root with the `KvReuse` policy the runner follows too (what a turn's base is
    adopted into)."""

    def __init__(self, *, engine: Engine, tiers: TierManager, preparer: TurnPreparer) -> None:
        self.engine = engine
        self.tiers = tiers
        self.preparer = preparer
        self.rules = TurnRules(preparer.template, engine.stop_token_ids, preparer.window.budget_tokens)
        self._active: dict[CacheKey, Request] = {}
        self._active_lock = threading.Lock()
        self._preparing: Counter[TenantId] = Counter()
        self._closed_error: BaseException | None = None
        self._reconstruction_prompt = _reconstruction_prompt(preparer) if preparer.window.policy == "agnostic" else None

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
            prepared = self.preparer.prepare(tenant_id, session_id, transcript, user_text, params, lease, cancel)
        generation = yield from self._stream(prepared, params, stop, started, lease, cancel)
        start = self._start_cache(prepared, generation.working, lease)
        outcome = complete_turn(
            prepared, generation, start=start, transcript=transcript, user_text=user_text, rules=self.rules
        )
        if self.preparer.window.policy == "agnostic" and outcome.cache is not None and outcome.cache.full_layers:
            outcome = replace(outcome, cache=self._commit_scores(lease.key, start, outcome.cache))
        yield outcome

    def _commit_scores(self, key: CacheKey, start: SessionCache, after: SessionCache) -> SessionCache:
        """`after` with the `agnostic` policy's scores, fixed now, before the next question is known:
        KVzip's reconstruction (Kim et al., NeurIPS 2025) of the ids this turn added to `start`
        (closing of the last reply, the turn, its reply), prefilled after the reconstruction prompt
        on a copy of `after` that is dropped (`TurnWindow.reconstruction_scores`; the scores' columns
        are that copy's slots, hence `built_from=after`). Every held
        token is scored by those queries; a token held before keeps the larger of that and its
        earlier score (`committed_scores`). Only the added ids are repeated: after a restore
        (no scores), the older tokens are scored by how much repeating this turn needs them.

        A reconstruction that raises `RuntimeError` (out of memory, a failed forward pass: the
        engine loop hands its errors to the request) is logged as one warning and the cache is
        returned without scores: it evicts by recency (`stored_scores`) until a later turn scores
        it, and the turn is stored all the same."""
        added = after.own_token_ids[len(start.own_token_ids) :]
        if self._reconstruction_prompt is None:  # the template cannot frame a repeat: recency
            return after.with_scores(None)
        if not added:  # nothing new to reconstruct: earlier scores stand (recency where none)
            return after.with_scores(start.own_scores)
        positions = (
            after.next_position + len(self._reconstruction_prompt) + min(len(added), RECONSTRUCTION_CHUNK_TOKENS)
        )
        if positions > self.preparer.fitting.engine.max_context_tokens:
            # The repeat would run past the model's positions; the next turn rebuilds its window
            # from the transcript anyway (`TurnWindow.positions_overflow`), which needs no scores.
            log.info("session %s: no KVzip reconstruction past the model's %d positions", key.name, positions)
            return after.with_scores(None)
        try:
            fresh = self.preparer.fitting.reconstruction_scores(after, added, self._reconstruction_prompt)
        # The scores only steer later evictions; losing them must not lose the reply just streamed.
        except RuntimeError as exc:
            log.warning(
                "session %s: KVzip reconstruction failed (%s); "
                "its cache evicts by recency until a later turn scores it",
                key.name,
                exc,
            )
            return after.with_scores(None)
        return after.with_scores(committed_scores(start, after, tuple(fresh), built_from=after))

    def _stream(
        self,
        prepared: PreparedTurn,
        params: SamplingParams,
        stop: StopStrings,
        started: float,
        lease: Lease,
        cancel: CancelToken | None,
    ) -> Generator[str, None, Generation]:
        """Submit the turn, yield its text pieces as they are released (held back while they could
        start a stop string; none after one), and return what was generated. `started`: when the
        turn's call began (`perf_counter`), for its time to first token."""
        engine = self.engine
        request = self._request(prepared, params, lease)
        detokenizer = IncrementalDetokenizer(engine.tokenizer)
        scanner = StopScanner(stop, armed=params.min_new_tokens == 0)
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
                fresh = token not in engine.stop_token_ids and detokenizer.push(token)
                if len(generated) == params.min_new_tokens:  # stop strings count from here
                    scanner.arm(len(detokenizer.text))
                if not fresh or scanner.cut is not None:
                    continue
                piece = scanner.push(detokenizer.text)
                if scanner.cut is not None:
                    request.finish_early()
                    engine.loop.wake()
                if piece:
                    yield piece
        detokenizer.finish()
        tail = scanner.finish(detokenizer.text)
        if tail:
            yield tail
        decode_s = time.perf_counter() - decode_started
        return Generation(
            tuple(generated), detokenizer.text, scanner.cut, result.working, ttft_s, decode_s, result.queue_s
        )

    def _request(self, prepared: PreparedTurn, params: SamplingParams, lease: Lease) -> Request:
        working = prepared.start.working
        return Request(
            tenant_id=lease.key.tenant_id,
            prefill_ids=prepared.unprefilled,
            params=params,
            start=prepared.cache if working is None else None,
            working=working,
            stop_token_ids=self.engine.stop_token_ids,
            accountant=self.tiers,
            reserve_kv=True,
        )

    def _start_cache(self, prepared: PreparedTurn, working: WorkingCache, lease: Lease) -> SessionCache:
        """The cache the turn's working cache continues: the prepared one, or, when the turn
        prefilled a pending base, an empty cache over that base once it is in the pool."""
        pending = prepared.start.pending_base
        if pending is None:
            return prepared.cache
        return self.engine.empty_cache(self._adopt_base(pending, working, lease))

    def _adopt_base(self, pending: PendingBase, working: WorkingCache, lease: Lease) -> BaseLayer:
        """Copy the base prefix out of the turn's working cache into the tenant's pool (as the
        `KvReuse` policy has it)."""
        n = len(pending.token_ids)
        keys = tuple(layer.filled_keys[:, :, :n].clone() for layer in working.prealloc_layers)
        values = tuple(layer.filled_values[:, :, :n].clone() for layer in working.prealloc_layers)
        base = BaseLayer(pending.key, pending.token_ids, keys, values)
        return self.preparer.reuse.adopt_base(lease, base)


def _reconstruction_prompt(preparer: TurnPreparer) -> tuple[int, ...] | None:
    """KVzip's reconstruction prompt in the model's chat template, or `None` (with one warning)
    for a template that does not render a reply verbatim (one that rewrites earlier replies):
    the `agnostic` policy then evicts by recency."""
    try:
        return preparer.template.reconstruction_prompt_ids(RECONSTRUCTION_INSTRUCTION)
    except TemplateDivergence as exc:
        log.warning("window policy agnostic: no KVzip reconstruction prompt (%s); evicting by recency", exc)
        return None
