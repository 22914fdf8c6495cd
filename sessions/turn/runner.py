"""One turn of one session, from its preparation to its outcome: `TurnRunner.run` prepares the turn
(`TurnPreparer`: restore or rebuild, fit the window), submits it to the engine loop, streams its
reply and completes it (`complete_turn`). Nothing is stored here: the manager stores the outcome.

A turn with stop strings ends early once its text contains one (`sessions.turn.stop_strings`): the
request is finished at the loop's next step and the reply returned is cut before the stop string
(what the turn then stores: `sessions.turn.completion`). With `min_new_tokens`, neither a stop
token (masked in sampling: `Request.sample`) nor a stop string ends a reply before that many tokens.

The runner also keeps count of what is in flight: the turns being prepared, per tenant (they show
as running turns), and each session's engine request, so a deleted session or a closing manager
can cancel it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Generator, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace

from cache.attention_scores import QueryLog
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
from sessions.turn.completion import Generation, TurnOutcome, TurnRules, complete_turn
from sessions.turn.detokenizer import IncrementalDetokenizer
from sessions.turn.prepared import PendingBase, PreparedTurn
from sessions.turn.preparer import TurnPreparer
from sessions.turn.stop_strings import NO_STOP, StopScanner, StopStrings
from sessions.turn.transcript import Transcript


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
        log = None
        if self.preparer.window.policy == "agnostic" and prepared.cache.full_layers:
            prepared = _with_working(prepared, params.max_new_tokens)
            log = QueryLog(prepared.start.working)  # type: ignore[arg-type]  # just built
        with log if log is not None else nullcontext():
            generation = yield from self._stream(prepared, params, stop, started, lease, cancel)
        start = self._start_cache(prepared, generation.working, lease)
        outcome = complete_turn(
            prepared, generation, start=start, transcript=transcript, user_text=user_text, rules=self.rules
        )
        if log is not None and outcome.cache is not None:
            # The `agnostic` policy's scores, fixed now, before the next question is known.
            scores = committed_scores(start, outcome.cache, log.turn_scores())
            outcome = replace(outcome, cache=outcome.cache.with_scores(scores))
        yield outcome

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


def _with_working(prepared: PreparedTurn, max_new_tokens: int) -> PreparedTurn:
    """`prepared` with its working buffer built here rather than at the loop's admission (the same
    buffer: `Request`), so a `QueryLog` can be attached to it before the loop runs it."""
    if prepared.start.working is not None:
        return prepared
    working = prepared.cache.to_working_cache(len(prepared.prefill) + max_new_tokens)
    return replace(prepared, start=replace(prepared.start, working=working))
