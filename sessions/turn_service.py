"""Turns of a manager's sessions: take the session (its ownership lease among replicas, its tier
lease), run the turn (`sessions.turn.runner.TurnRunner`: restore or rebuild, window, engine loop,
stream), store it (one database transaction), commit its cache.

    stream_chat(tenant, session, message)
      registry.session_record          another tenant's session is not found (invariant 2)
      replicas.hold + tiers.lease      one turn per session at a time, on its owner
      transcripts.get                  the conversation the turn renders
      runner.run  ->  text pieces, then the outcome (nothing stored yet)
      metadata.record_turn             user and assistant messages, token count, digest (fenced
                                       by the ownership lease among replicas)
      lease.commit(cache)              the cache the turn left, on the device
"""

from __future__ import annotations

import logging
from collections.abc import Generator

from cache.ids import SessionId, TenantId
from cache.lease import Lease
from cache.tier_manager import LeaseHeld, TierManager
from cache.tiers import CacheKey
from sessions.cancellation import CancelToken
from sessions.errors import SessionBusy, SessionMoved, SessionNotFound
from sessions.metrics import Metrics
from sessions.records import Reply, TurnStats
from sessions.registry import Registry
from sessions.replicas.role import Replicas
from sessions.transcripts import Transcripts
from sessions.turn.chat_template import PastTurn
from sessions.turn.completion import TurnOutcome
from sessions.turn.preparer import KvReuse
from sessions.turn.runner import TurnRunner
from sessions.turn.transcript import Transcript
from sessions.turn_options import TurnOptions
from storage.errors import SessionGone
from storage.metadata_store import MetadataStore
from storage.replica_store import OwnershipLost, OwnerToken

turn_log = logging.getLogger("sessions.turns")
"""One line per stored turn at `info` (`log_turn`); `chatkv serve --log-format json` makes its
figures fields of their own."""


class TurnService:
    """Runs and stores the turns of a manager's sessions. Thread-safe: turns of different sessions
    run at once (batched by the engine loop); a session has one turn at a time.

    Args:
        registry, metadata: session records; turns are stored in `metadata`.
        tiers: the session caches (leased for a turn).
        transcripts: the conversations turns render.
        runner: runs one turn.
        replicas: the ownership lease held around a turn among replicas.
        metrics: counts every stored turn.
        fingerprint: the model's, recorded with each turn.
        reuse: what each turn keeps of its cache (`NO_REUSE`: a benchmark baseline that rebuilds
            every turn).
    """

    def __init__(
        self,
        *,
        registry: Registry,
        metadata: MetadataStore,
        tiers: TierManager,
        transcripts: Transcripts,
        runner: TurnRunner,
        replicas: Replicas,
        metrics: Metrics,
        fingerprint: str,
        reuse: KvReuse,
    ) -> None:
        self._registry = registry
        self._metadata = metadata
        self._tiers = tiers
        self._transcripts = transcripts
        self._runner = runner
        self._replicas = replicas
        self._metrics = metrics
        self._fingerprint = fingerprint
        self._reuse = reuse

    def stream(
        self,
        tenant_id: TenantId,
        session_id: str,
        message: str,
        options: TurnOptions,
        *,
        expected_turns: int | None = None,
        cancel: CancelToken | None = None,
    ) -> Generator[str | Reply, None, None]:
        """`SessionManager.stream_chat` once its arguments are checked: the reply's pieces, then
        the `Reply`; the turn is stored when the generator finishes, abandoning it stores nothing."""
        record = self._registry.session_record(tenant_id, session_id)
        sid = SessionId(record.id)
        key = CacheKey.for_session(tenant_id, sid)
        try:
            with self._replicas.hold(key) as owner, self._tiers.lease(key) as lease:
                if owner is not None:
                    # The hold may have waited for another replica's hand-over, which ran turns
                    # since the read above: the transcript must be built on the record as it is now.
                    record = self._registry.session_record(tenant_id, session_id)
                transcript = self._transcripts.get(tenant_id, sid, record)
                if expected_turns is not None and len(transcript.turns) != expected_turns:
                    raise SessionBusy(f"session {sid} moved on: it has {len(transcript.turns)} turns")
                outcome = yield from self._run(tenant_id, sid, transcript, message, options, lease, cancel)
                self._store(tenant_id, sid, transcript, message, outcome, owner)
                self._reuse.keep(lease, outcome.cache)
        except LeaseHeld:  # only the lease's entry raises it: another turn holds the session
            raise SessionBusy(f"session {sid} has a turn in flight; wait for its reply") from None
        yield outcome.reply

    def _run(
        self,
        tenant_id: TenantId,
        session_id: SessionId,
        transcript: Transcript,
        message: str,
        options: TurnOptions,
        lease: Lease,
        cancel: CancelToken | None,
    ) -> Generator[str, None, TurnOutcome]:
        """Yield the reply's text pieces; return the outcome (nothing stored yet)."""
        outcome = None
        for item in self._runner.run(
            tenant_id=tenant_id,
            session_id=session_id,
            transcript=transcript,
            user_text=message,
            params=options.sampling,
            lease=lease,
            stop=options.stop_strings,
            cancel=cancel,
        ):
            if isinstance(item, TurnOutcome):
                outcome = item
            else:
                yield item
        if outcome is None:
            raise RuntimeError("bug: the turn ended without an outcome")
        return outcome

    def _store(
        self,
        tenant_id: TenantId,
        session_id: SessionId,
        transcript: Transcript,
        message: str,
        outcome: TurnOutcome,
        owner: OwnerToken | None,
    ) -> None:
        reply = outcome.reply
        try:
            self._metadata.record_turn(
                tenant_id=tenant_id,
                session_id=session_id,
                messages=[
                    ("user", message, outcome.user_token_ids),
                    ("assistant", reply.stored_text, outcome.reply_token_ids),
                ],
                token_count=outcome.token_count,
                model_fingerprint=self._fingerprint,
                ttft_s=reply.stats.ttft_s,
                returned_texts=(message, reply.text),
                owner=owner,
            )
        except SessionGone:
            raise SessionNotFound(session_id) from None
        except OwnershipLost:
            raise SessionMoved(
                f"session {session_id} was taken over by another replica while this turn ran; "
                "it was not stored, retry it"
            ) from None
        transcript.append(PastTurn(message, reply.stored_text, outcome.reply_token_ids), outcome.token_count)
        if outcome.unpinned_turn is not None:
            transcript.pinned.discard(outcome.unpinned_turn)
            self._metadata.set_pinned_turns(
                tenant_id=tenant_id, session_id=session_id, pinned_turns=sorted(transcript.pinned)
            )
        # The turn held the session's lease; its transcript is the current one even if the bounded
        # cache dropped it meanwhile.
        self._transcripts.put(tenant_id, session_id, transcript)
        s = reply.stats
        self._metrics.record_turn(
            tenant_id,
            s.prefill_tokens,
            s.reused_tokens,
            s.decode_tokens,
            s.ttft_s,
            s.restored_from,
            s.queue_s,
            s.restore_choice,
        )
        # What this turn's prefill cost, for the next restore-or-recompute choice.
        self._runner.preparer.costs.prefilled(s.prefill_tokens, s.ttft_s - s.restore_s - s.queue_s)
        log_turn(tenant_id, session_id, s)


def log_turn(tenant_id: TenantId, session_id: SessionId, stats: TurnStats) -> None:
    """Log a stored turn's figures on `sessions.turns` at `info`, as text and as `extra` fields:
    `tenant`, `session`, `prefilled_tokens`, `cached_tokens` (served from cache), `restored_from`
    (`device`, `host`, `disk`, `redis`, `rebuilt`, `new`, ...), `ttft_ms`, `decode_tokens` and
    `decode_tokens_per_s` (tokens after the first over the time after it; `None` for one token)."""
    if not turn_log.isEnabledFor(logging.INFO):
        return
    after_first = stats.decode_tokens - 1
    per_s = round(after_first / stats.decode_s, 1) if after_first > 0 and stats.decode_s > 0 else None
    fields = {
        "tenant": tenant_id,
        "session": session_id,
        "prefilled_tokens": stats.prefill_tokens,
        "cached_tokens": stats.reused_tokens,
        "restored_from": stats.restored_from,
        "ttft_ms": round(stats.ttft_s * 1000, 1),
        "decode_tokens": stats.decode_tokens,
        "decode_tokens_per_s": per_s,
    }
    turn_log.info(" ".join(f"{name}={value}" for name, value in fields.items()), extra=fields)
