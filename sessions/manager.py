"""`SessionManager`: the embeddable API of chatkv.

    manager = SessionManager(Settings(home="/var/lib/chatkv"))
    tenant = manager.create_tenant("acme")
    sid = manager.open_session(tenant, system_prompt="You are terse.")
    reply = manager.chat(tenant, sid, "Hello")          # reply.text, reply.stats.prefill_tokens, ...

Every call takes the tenant (a `Tenant`, its id or its name). A session id of another tenant
raises the same `SessionNotFound` as a missing one. Each accepted turn is committed to the
database before `chat` returns; caches may be dropped at any time because the transcript rebuilds
them.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Generator, Sequence
from typing import Any, cast

import torch

from cache.budgets import TierBudgets
from cache.ids import PrefixKey, SessionId, TenantId
from cache.lease import Lease
from cache.prefix_pool import PrefixPool
from cache.session_cache import BaseLayer
from cache.tier_manager import LeaseHeld, TierManager
from cache.tiers import CacheKey, Tier
from cache.window_policy import MIN_TURN_TOKENS, WindowPolicy
from sessions.cancellation import CancelToken
from sessions.chat_template import ChatTemplate, PastTurn
from sessions.engine import Engine
from sessions.errors import (
    ContextTooLong,
    HistoryTooLong,
    HomeLocked,
    InvalidInput,
    ManagerClosed,
    ModelUnavailable,
    SessionBusy,
    SessionMoved,
    SessionNotFound,
)
from sessions.idempotency import IdempotentRequests
from sessions.metrics import Metrics
from sessions.model_source import load_model
from sessions.offload import EncryptedCacheSealer, TierBlobStore
from sessions.ownership import SessionOwnership
from sessions.records import Message, Reply, Role, SessionInfo
from sessions.replication import open_shared_store, replica_id_for, start_ownership
from sessions.sampling import SamplingParams
from sessions.session_ops import SessionOps
from sessions.settings import Settings
from sessions.stop_strings import StopStrings
from sessions.tenant_ops import TenantRef
from sessions.transcript import Transcript
from sessions.turns import TurnOutcome, TurnRunner
from sessions.validation import check_text, valid_id
from storage.atomic_files import remove_temp_files
from storage.blob_stores import DiskBlobStore, HostBlobStore
from storage.database import open_database, upgrade
from storage.errors import SessionGone
from storage.history_digest import history_digest
from storage.home_lock import HomeLock, HomeLockedError
from storage.keyring import TenantKeys, load_master_key
from storage.metadata_store import MessageRecord, MetadataStore, SessionRecord
from storage.replica_store import OwnershipLost, OwnerToken, ReplicaStore

log = logging.getLogger(__name__)

_ID_PREFIX_SESSION = "s_"
MAX_MESSAGE_CHARS = 1_000_000
MAX_TITLE_CHARS = 200
MAX_CACHED_TRANSCRIPTS = 4096
MAX_HISTORY_TURNS = 1024
"""Turns a session may be opened with (`open_session(history=...)`): 2,048 messages, OpenAI's
limit of messages per request."""
HISTORY_CONTEXT_MULTIPLE = 8
"""A history opened with may hold this many times the model's context window in tokens."""
CLOSE_LEASE_WAIT_S = 30.0
"""How long `close()` waits for cancelled turns to release their sessions."""


class SessionManager(SessionOps):
    """Tenants, sessions and turns over one model. Thread-safe; use as a context manager.

    Args:
        settings: configuration; default `Settings()` (every field from `CHATKV_<FIELD>` when set).
        engine: an already loaded `Engine` to share (tests and benchmarks load the model once);
            default loads `settings.model`.

    Raises:
        ModelUnavailable: if the model cannot be loaded.
        HomeLocked: if another process holds `settings.home` (its server's HTTP API is the way in).
        ValueError: for settings that cannot work with this model (window above its context).
    """

    def __init__(self, settings: Settings | None = None, *, engine: Engine | None = None) -> None:
        self.settings = settings = settings or Settings()
        settings.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._home_lock = HomeLock(settings.home)
        try:
            # Start-up migrates and reconciles the stores: never on a home another process owns.
            self._home_lock.acquire()
        except HomeLockedError as exc:
            raise HomeLocked.held_by(exc.holder, exc.owner.url, exc.recovery) from None
        started = False
        try:
            self._start(settings, engine)
            started = True
        finally:
            if not started:  # a failed start (bad model, bad settings) must not keep the home
                self._home_lock.release()

    def _start(self, settings: Settings, engine: Engine | None) -> None:
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self._db = open_database(settings.resolved_database_url)
        upgrade(settings.resolved_database_url, self._db)
        self.metadata = MetadataStore(self._db)
        self.idempotency = IdempotentRequests(self._db)
        if engine is None:
            device = _resolve_device(settings.device)
            engine = Engine(load_model(settings.model, settings.resolved_model_cache_dir, device, settings.dtype))
        engine.loop.configure(settings.scheduler_config())
        self.engine = engine
        budget = settings.context_budget_tokens or int(engine.max_context_tokens * 0.8)
        if budget > engine.max_context_tokens:
            raise ValueError(
                f"context_budget_tokens={budget} exceeds the model's context ({engine.max_context_tokens} tokens)"
            )
        self.context_budget_tokens = budget
        in_use = {t.master_key_id for t in self.metadata.list_tenants() if t.master_key_id}
        self.keys = TenantKeys(self.metadata, load_master_key(settings.home, settings.master_key, in_use))
        if in_use and self.keys.master.id not in in_use:
            log.error(
                "the master key (id %s) did not wrap any tenant's data key (ids %s): stored caches cannot "
                "be opened and are rebuilt from transcripts; set CHATKV_MASTER_KEY to the right key",
                self.keys.master.id,
                ", ".join(sorted(in_use)),
            )
        self.replica_id = replica_id_for(settings.replica_config()) if settings.replica_mode else None
        self.metrics = Metrics(tenant_labels=settings.metrics_tenant_labels, replica=self.replica_id)
        self.disk_store: DiskBlobStore[CacheKey] = DiskBlobStore(
            settings.blob_dir,
            self.metadata,
            engine.fingerprint,
            lambda t, n: CacheKey(TenantId(t), n),
            location=self.replica_id or "",
        )
        self.shared_store = open_shared_store(settings.redis_config(), self.metadata, engine.fingerprint)
        sealer = EncryptedCacheSealer(
            self.keys,
            engine.fingerprint,
            engine.device,
            settings.offload_precision,
            settings.quant_residual_tokens,
        )
        self.tiers = TierManager(
            pool=PrefixPool(),
            sealer=sealer,
            host=TierBlobStore(HostBlobStore[CacheKey]()),
            disk=TierBlobStore(self.disk_store),
            budgets=TierBudgets(
                device_bytes=settings.device_budget_bytes or 0,
                host_bytes=settings.host_budget_bytes or 0,
                disk_bytes=settings.disk_budget_bytes or 0,
                tenant_device_quota_bytes=settings.tenant_device_quota_bytes or 0,
            ),
            base_builder=self._build_base,
            write_back=settings.persist == "write_back",
            events=self.metrics,
            shared=self.shared_store,
            may_publish=self._may_publish,
        )
        self.tiers.adopt_disk_blobs(self.disk_store.reconcile())
        if self.disk_store.damaged_at_start:
            self.metrics.integrity_failures.labels(Tier.DISK.value).inc(self.disk_store.damaged_at_start)
        remove_temp_files(settings.home)
        self.metrics.watch_tiers(self.tiers.usage)
        engine.loop.add_observer(self.metrics)
        self.sealer = sealer
        self.template = ChatTemplate(engine.tokenizer, engine.stop_token_ids)
        self.runner = TurnRunner(
            engine=engine,
            template=self.template,
            tiers=self.tiers,
            window=WindowPolicy(
                budget,
                policy=settings.window_policy,
                recent_tokens=settings.window_recent_tokens,
                observation_tokens=settings.window_observation_tokens,
            ),
            share_base=settings.share_base,
            reuse_kv=settings.reuse_kv,
        )
        self.metrics.watch_engine(engine.loop.stats, self.runner.preparing_by_tenant)
        # Transcripts of recently active sessions (a turn renders the whole conversation); bounded
        # so a service with many sessions does not keep every transcript in memory.
        self._transcripts: OrderedDict[tuple[TenantId, SessionId], Transcript] = OrderedDict()
        self._lock = threading.Lock()
        self._key_lock = threading.Lock()
        self._closed = False
        self.ownership: SessionOwnership | None = None
        if self.replica_id is not None:
            replicas = ReplicaStore(self._db)
            self.ownership = start_ownership(
                settings.replica_config(), replicas, self.replica_id, self.tiers, self._invalidate_local
            )

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel turns in flight (they raise `ManagerClosed` and store nothing) and wait for them
        to let go of their sessions, persist caches to disk (a restart resumes warm), stop the
        write-back, close the database, release the home. Later calls that start work raise
        `ManagerClosed`. A server waits for its turns to finish before it closes the manager."""
        if self._closed:
            return
        self._closed = True
        self.runner.cancel_all(ManagerClosed("the chatkv manager was closed during this turn"))
        if not self.tiers.wait_for_leases(CLOSE_LEASE_WAIT_S):
            log.warning(
                "turns still hold sessions %.0f s after close(); their caches are not persisted", CLOSE_LEASE_WAIT_S
            )
        self.engine.loop.remove_observer(self.metrics)
        try:
            if self.ownership is not None:
                self.ownership.close()  # publishes the sessions it holds, so others take them at once
            self.tiers.persist_all()
            self.tiers.close()
            self._db.dispose()
        finally:
            self._home_lock.release()

    def flush(self) -> None:
        """Wait until the background write-back has stored every finished turn's cache on disk."""
        self.tiers.flush()

    def __enter__(self) -> SessionManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sessions ------------------------------------------------------------------------------

    def open_session(
        self,
        tenant: TenantRef,
        system_prompt: str | None = None,
        title: str | None = None,
        *,
        history: Sequence[tuple[str, str]] = (),
    ) -> SessionId:
        """Create a session.

        Args:
            history: earlier turns to start from, `(user text, reply text)` each: a conversation
                a client brings along (the OpenAI API's stateless requests). The replies were not
                generated here, so their ids are their tokenised text; the first turn re-prefills.
                At most `MAX_HISTORY_TURNS` turns and `HISTORY_CONTEXT_MULTIPLE` times the model's
                context in tokens: only the turns that fit the context window are prefilled, and a
                longer history is work (tokenising, storing) with nothing to show for it.

        Raises:
            InvalidInput: for a non-string prompt or history text, or an overlong title.
            HistoryTooLong: for a history over the limits above (counting stops at the limit).
            ContextTooLong: if the system prompt leaves less than `MIN_TURN_TOKENS` of the
                context window for the conversation.
        """
        self._check_open()
        tenant_id = self._tenant_id(tenant)
        if system_prompt is not None:
            check_text(system_prompt, "system_prompt", MAX_MESSAGE_CHARS)
        if title is not None:
            check_text(title, "title", MAX_TITLE_CHARS)
        messages = self._history_messages(history)
        if system_prompt:
            # The system prompt is pinned in every turn's window; leave room for a short turn.
            needed = len(self.template.system_prefix_ids(system_prompt)) + MIN_TURN_TOKENS
            if needed > self.context_budget_tokens:
                raise ContextTooLong(needed, self.context_budget_tokens, what="system prompt")
        session_id = SessionId(_ID_PREFIX_SESSION + secrets.token_hex(12))
        pinned = (0,) if self.settings.pin_first_turn else ()
        self.metadata.create_session(
            tenant_id=tenant_id,
            session_id=session_id,
            title=title,
            system_prompt=system_prompt,
            model_fingerprint=self.engine.fingerprint,
            pinned_turns=pinned,
            messages=messages,
        )
        return session_id

    def _history_messages(self, history: Sequence[tuple[str, str]]) -> list[tuple[str, str, tuple[int, ...]]]:
        """`open_session`'s history as messages to store, counted against the limits as it is
        tokenised (so an overlong one costs no more than the limit's worth of tokenising)."""
        context = self.engine.max_context_tokens
        limit_tokens = HISTORY_CONTEXT_MULTIPLE * context
        if len(history) > MAX_HISTORY_TURNS:
            raise HistoryTooLong(
                f"the history has {len(history)} turns; at most {MAX_HISTORY_TURNS} can be brought along"
            )
        tokenizer = self.engine.tokenizer
        messages: list[tuple[str, str, tuple[int, ...]]] = []
        tokens = 0
        for user_text, reply_text in history:
            check_text(user_text, "a history message", MAX_MESSAGE_CHARS)
            check_text(reply_text, "a history reply", MAX_MESSAGE_CHARS)
            reply_ids = self.template.text_reply_ids(reply_text)
            tokens += len(reply_ids) + len(tokenizer.encode(user_text, add_special_tokens=False))
            if tokens > limit_tokens:
                raise HistoryTooLong(
                    f"the history holds more than {limit_tokens:,} tokens ({HISTORY_CONTEXT_MULTIPLE} times the "
                    f"model's {context:,}-token context); bring along only its recent turns"
                )
            messages += [("user", user_text, ()), ("assistant", reply_text, reply_ids)]
        return messages

    def find_sessions_by_history(
        self, tenant: TenantRef, system_prompt: str | None, turns: Sequence[tuple[str, str]]
    ) -> list[SessionId]:
        """The tenant's sessions whose history is exactly `system_prompt` and `turns` (user text,
        reply text as it was returned: `Reply.text`), most recently active first: one keyed query
        on the history digest (`storage.history_digest`). Without turns there is nothing to reuse
        and nothing is found. Sessions from before the digest existed are never found.

        A found session may move on before its next turn: continue it with
        `stream_chat(..., expected_turns=len(turns))`.
        """
        tenant_id = self._tenant_id(tenant)
        if not turns:
            return []
        digest = history_digest(system_prompt, turns)
        return [SessionId(s) for s in self.metadata.sessions_by_history(tenant_id=tenant_id, history_digest=digest)]

    def tiers_key(self, tenant: TenantRef, session_id: str) -> CacheKey:
        """The tier manager's key of a session (for operators and tests)."""
        return CacheKey(self._tenant_id(tenant), str(session_id))

    def list_sessions(self, tenant: TenantRef | None = None) -> list[SessionInfo]:
        """The tenant's sessions, most recently active first (`None`: every tenant's, for operators)."""
        tenant_id = None if tenant is None else self._tenant_id(tenant)
        return [self._info(record) for record in self.metadata.list_sessions(tenant_id=tenant_id)]

    def history(self, tenant: TenantRef, session_id: str) -> list[Message]:
        tenant_id = self._tenant_id(tenant)
        records = self.metadata.messages(tenant_id=tenant_id, session_id=session_id) if valid_id(session_id) else None
        if records is None:
            raise SessionNotFound(str(session_id))
        return [_message(record) for record in records]

    def delete_session(self, tenant: TenantRef, session_id: str) -> None:
        """Delete the session: caches in every tier first (so no eviction can write a blob row for
        it meanwhile), then its rows. A turn in flight on it fails with `SessionNotFound`."""
        tenant_id = self._tenant_id(tenant)
        record = self._session_record(tenant_id, session_id)
        self.runner.cancel_requests(tenant_id, SessionId(record.id))
        self.tiers.forget(CacheKey(tenant_id, record.id))
        with self._lock:
            self._transcripts.pop((tenant_id, SessionId(record.id)), None)
        if not self.metadata.delete_session(tenant_id=tenant_id, session_id=record.id):
            raise SessionNotFound(str(session_id))
        self.tiers.forget(CacheKey(tenant_id, record.id))  # a turn that finished in between

    # -- turns ---------------------------------------------------------------------------------

    def chat(
        self,
        tenant: TenantRef,
        session_id: str,
        message: str,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        cancel: CancelToken | None = None,
    ) -> Reply:
        """Send a user message and return the reply. See `stream_chat` for the errors."""
        reply = None
        for item in self.stream_chat(
            tenant,
            session_id,
            message,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            cancel=cancel,
        ):
            if isinstance(item, Reply):
                reply = item
        if reply is None:
            raise RuntimeError("bug: stream_chat ended without a reply")
        return reply

    def stream_chat(
        self,
        tenant: TenantRef,
        session_id: str,
        message: str,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        expected_turns: int | None = None,
        cancel: CancelToken | None = None,
    ) -> Generator[str | Reply, None, None]:
        """Yield reply text pieces as they are generated, then the `Reply`. The pieces joined equal
        `Reply.text`. The turn is stored when the generator finishes; abandoning it stores nothing.

        Args:
            stop: up to 4 strings that end the reply once its text contains one; `Reply.text`
                ends before it, and the transcript stores the reply as returned (its text's ids
                and a stop token, as a posted history of it would be stored).
            expected_turns: continue only if the session has exactly this many turns (it was found
                by its history, and another turn may have got there first).
            cancel: set by the caller to stop the turn (its client went away): the turn raises
                `TurnCancelled` at its next preparation step, or the engine loop drops its request
                at the next step; nothing is stored.

        Raises:
            TenantNotFound, SessionNotFound: unknown tenant, or a session not of this tenant.
            InvalidInput: empty or overlong message, bad sampling parameters or stop strings.
            SessionBusy: another turn of this session is in flight, or it moved on from
                `expected_turns`.
            ContextTooLong: the message plus `max_new_tokens` cannot fit the context window.
            TurnCancelled: `cancel` was set before the reply was complete.
        """
        self._check_open()
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
        stop_strings = StopStrings(stop)
        check_text(message, "message", MAX_MESSAGE_CHARS)
        if not message.strip():
            raise InvalidInput("message must be a non-empty string")
        tenant_id = self._tenant_id(tenant)
        record = self._session_record(tenant_id, session_id)
        sid = SessionId(record.id)
        key = CacheKey(tenant_id, sid)
        try:
            with self._owner(key) as owner, self.tiers.lease(key) as lease:
                if owner is not None:
                    # The hold may have waited for another replica's hand-over, which ran turns
                    # since the read above: the transcript must be built on the record as it is now.
                    record = self._session_record(tenant_id, session_id)
                transcript = self._transcript(tenant_id, sid, record)
                if expected_turns is not None and len(transcript.turns) != expected_turns:
                    raise SessionBusy(f"session {sid} moved on: it has {len(transcript.turns)} turns")
                outcome = yield from self._run_turn(
                    tenant_id, sid, transcript, message, params, stop_strings, lease, cancel
                )
                self._store_turn(tenant_id, sid, transcript, message, outcome, owner)
                if self.settings.reuse_kv and outcome.cache is not None:
                    lease.commit(outcome.cache)
                elif self.settings.reuse_kv:
                    lease.discard()  # no cache ends where the stored reply does; the next turn rebuilds
        except LeaseHeld:  # only the lease's entry raises it: another turn holds the session
            raise SessionBusy(f"session {sid} has a turn in flight; wait for its reply") from None
        yield outcome.reply

    def _run_turn(
        self,
        tenant_id: TenantId,
        session_id: SessionId,
        transcript: Transcript,
        message: str,
        params: SamplingParams,
        stop: StopStrings,
        lease: Lease,
        cancel: CancelToken | None,
    ) -> Generator[str, None, TurnOutcome]:
        """Yield the reply's text pieces; return the outcome (nothing stored yet)."""
        outcome = None
        for item in self.runner.run(
            tenant_id=tenant_id,
            session_id=session_id,
            transcript=transcript,
            user_text=message,
            params=params,
            lease=lease,
            stop=stop,
            cancel=cancel,
        ):
            if isinstance(item, TurnOutcome):
                outcome = item
            else:
                yield item
        if outcome is None:
            raise RuntimeError("bug: the turn ended without an outcome")
        return outcome

    def _store_turn(
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
            self.metadata.record_turn(
                tenant_id=tenant_id,
                session_id=session_id,
                messages=[
                    ("user", message, outcome.user_token_ids),
                    ("assistant", reply.stored_text, outcome.reply_token_ids),
                ],
                token_count=outcome.token_count,
                model_fingerprint=self.engine.fingerprint,
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
            self.metadata.set_pinned_turns(
                tenant_id=tenant_id, session_id=session_id, pinned_turns=sorted(transcript.pinned)
            )
        with self._lock:
            # The turn held the session's lease; its transcript is the current one even if the
            # bounded cache dropped it meanwhile.
            self._transcripts[(tenant_id, session_id)] = transcript
            self._transcripts.move_to_end((tenant_id, session_id))
        s = reply.stats
        self.metrics.record_turn(
            tenant_id, s.prefill_tokens, s.reused_tokens, s.decode_tokens, s.ttft_s, s.restored_from, s.queue_s
        )

    def _transcript(self, tenant_id: TenantId, session_id: SessionId, record: SessionRecord) -> Transcript:
        with self._lock:
            cached = self._transcripts.get((tenant_id, session_id))
            if cached is not None:
                self._transcripts.move_to_end((tenant_id, session_id))
                return cached
        messages = self.metadata.messages(tenant_id=tenant_id, session_id=session_id) or []
        turns = _past_turns(messages, self.engine.tokenizer, len(self.engine.tokenizer))
        transcript = Transcript(record.system_prompt, turns, set(record.pinned_turns), record.token_count)
        with self._lock:
            kept = self._transcripts.setdefault((tenant_id, session_id), transcript)
            while len(self._transcripts) > MAX_CACHED_TRANSCRIPTS:
                self._transcripts.popitem(last=False)
            return kept

    def _may_publish(self, key: CacheKey) -> bool:
        """A write-back may publish to Redis only while this replica owns the session."""
        ownership = getattr(self, "ownership", None)  # not set yet while the manager starts
        return ownership is None or ownership.owns(key)

    def _invalidate_local(self, key: CacheKey) -> None:
        """Drop this replica's copies of a session another replica has moved on (its transcript
        and its caches); a turn in flight here keeps its own (its commit fence decides)."""
        with self._lock:
            self._transcripts.pop((key.tenant_id, SessionId(key.name)), None)
        try:
            self.tiers.forget_local(key)
        except LeaseHeld:
            log.debug("session %s: a local turn holds it; its stale copies are left to the fence", key.name)

    def set_replica_url(self, url: str) -> None:
        """The URL this process serves at (`chatkv serve` calls it), shown to clients of other
        replicas that are refused a session this replica owns. `Settings.replica_url` wins."""
        if self.ownership is not None and not self.settings.replica_url:
            self.ownership.set_url(url)

    def _build_base(self, tenant_id: TenantId, key: PrefixKey, token_ids: tuple[int, ...]) -> BaseLayer:
        keys, values = self.engine.compute_prefix(token_ids)
        return BaseLayer(key, token_ids, keys, values)


def _resolve_device(device: str) -> str:
    """The torch device for a `Settings.device` value. Raises `ModelUnavailable` for an
    accelerator this machine does not have."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelUnavailable(f"device {device!r} asked for, but CUDA is not available on this machine")
    if device == "mps" and not torch.backends.mps.is_available():
        raise ModelUnavailable("device 'mps' asked for, but MPS is not available on this machine")
    return device


def _message(record: MessageRecord) -> Message:
    role = cast(Role, record.role)
    return Message(
        index=record.index, role=role, text=record.text, token_ids=record.token_ids, created_at=record.created_at
    )


def _past_turns(messages: list[MessageRecord], tokenizer: Any, vocab_size: int) -> list[PastTurn]:
    """Completed turns of a transcript. A reply whose stored ids are missing or out of the
    vocabulary (an edited row) is re-tokenised from its text, with a warning, so the session stays
    usable; its cache then no longer matches and is rebuilt."""
    turns = []
    pending_user: MessageRecord | None = None
    for record in messages:
        if record.role == "user":
            pending_user = record
        elif record.role == "assistant" and pending_user is not None:
            ids = record.token_ids
            if not ids or not all(0 <= i < vocab_size for i in ids):
                log.warning("message %d has unusable token ids; re-tokenising its text", record.index)
                ids = tuple(tokenizer.encode(record.text, add_special_tokens=False))
            turns.append(PastTurn(pending_user.text, record.text, ids))
            pending_user = None
    return turns
