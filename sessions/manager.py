"""`SessionManager`: the embeddable API of chatkv.

    manager = SessionManager(Settings(home="/var/lib/chatkv"))
    tenant = manager.create_tenant("acme")
    sid = manager.open_session(tenant, system_prompt="You are terse.")
    reply = manager.chat(tenant, sid, "Hello")          # reply.text, reply.stats.prefill_tokens, ...

Every call takes the tenant (a `Tenant`, its id or its name). A session id of another tenant
raises the same `SessionNotFound` as a missing one. Each accepted turn is committed to the
database before `chat` returns; caches may be dropped at any time because the transcript rebuilds
them.

The manager is a thin front: the composition root (`sessions.assembly`) builds the objects that do
the work, one job each, and every method here checks its arguments and hands over:

    tenants     sessions.tenants.Tenants             tenants and their keys
    catalogue   sessions.catalogue.SessionCatalogue  sessions: open, delete, pin, inspect, restore, evict
    turns       sessions.turn_service.TurnService    turns: run, store, commit
    door        sessions.turn_door.TurnDoor          where a turn runs: continue, fork or new, here or not
    replicas    sessions.replicas.Replicas           this process's part among replicas
    registry    sessions.registry.Registry           records and lookups (torch-free)

The HTTP APIs' records (stored responses, conversations, idempotency keys) and the metrics are
services of their own beside the manager: `open_services` hands them to the faces as `Services`.
Tests look inside through `SessionManager.internals` only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Unpack

from cache.ids import SessionId
from cache.tiers import CacheKey
from sessions.assembly import ManagerParts, assemble, close_parts
from sessions.cancellation import CancelToken
from sessions.catalogue import MAX_TITLE_CHARS, SessionDetail
from sessions.conversations import ConversationRecords
from sessions.engine import Engine
from sessions.errors import (
    BackendUnavailable,
    HomeLocked,
    InvalidInput,
    InvalidSettings,
    ManagerClosed,
    SessionNotFound,
    TenantNotFound,
)
from sessions.home import HomeLock
from sessions.idempotency import IdempotentRequests
from sessions.metrics import Metrics
from sessions.records import Message, Reply, RestoreResult, SessionInfo, Tenant
from sessions.registry import TenantRef
from sessions.replicas.routing import Route
from sessions.responses import ResponseRecords
from sessions.retention import SWEEP_INTERVAL_S, RetentionSweeper, check_retention_s
from sessions.settings import Settings
from sessions.turn_door import PlannedTurn
from sessions.turn_options import TurnOptionKeywords, TurnOptions
from sessions.turn_target import TurnPlan, TurnTarget
from sessions.validation import MAX_MESSAGE_CHARS, check_text
from storage.keyring import BadMasterKey, KeyRingError
from storage.redis_store import RedisUnavailable
from storage.replica_store import ReplicaIdInUse

__all__ = ["MAX_MESSAGE_CHARS", "MAX_TITLE_CHARS", "Services", "SessionManager", "TenantRef", "open_services"]

CLOSE_LEASE_WAIT_S = 30.0
"""How long `close()` waits for cancelled turns to release their sessions."""


class SessionManager:
    """Tenants, sessions and turns over one model. Thread-safe; use as a context manager.

    Args:
        settings: configuration; default `Settings()` (every field from `CHATKV_<FIELD>` when set).
        engine: an already loaded `Engine` to share (tests and benchmarks load the model once):
            it outlives this manager and keeps serving others; default loads `settings.model`,
            and `close()` then stops the engine loop (its thread joined, the model released with
            the manager).

    Raises:
        ModelUnavailable: if the model cannot be loaded.
        HomeLocked: if another process holds `settings.home` (its server's HTTP API is the way in).
        InvalidSettings: for a malformed master key, or a replica id another live process uses.
        BackendUnavailable: if the key ring or a Redis Cluster does not work.
        ValueError: for settings that cannot work with this model (window above its context).
    """

    def __init__(self, settings: Settings | None = None, *, engine: Engine | None = None) -> None:
        self.settings = settings = settings or Settings()
        settings.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._home_lock = HomeLock(settings.home)
        try:
            # Start-up migrates and reconciles the stores: never on a home another process owns.
            self._home_lock.acquire()
        except HomeLocked as exc:
            raise HomeLocked.held_by(exc.holder, exc.url, exc.recovery) from None
        try:
            self._parts: ManagerParts = _assemble(settings, engine)
        except BaseException:  # a failed start (bad model, bad settings) must not keep the home
            self._home_lock.release()
            raise
        self._closed = False
        self._sweeper: RetentionSweeper | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel turns in flight (they raise `ManagerClosed` and store nothing) and wait for them
        to let go of their sessions, persist caches to disk (a restart resumes warm), stop the
        write-back, close the database, stop the engine loop if this manager loaded the engine
        (not one handed in), release the home. Later calls that start work raise
        `ManagerClosed`. A server waits for its turns to finish before it closes the manager."""
        if self._closed:
            return
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.close()
        self._parts.runner.cancel_all(ManagerClosed("the chatkv manager was closed during this turn"))
        try:
            close_parts(self._parts, CLOSE_LEASE_WAIT_S)
        finally:
            self._home_lock.release()

    def __enter__(self) -> SessionManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosed("the chatkv manager is closed")

    @property
    def model_name(self) -> str:
        return self._parts.engine.loaded.name

    @property
    def context_budget_tokens(self) -> int:
        """A session's context window in tokens (`Settings.context_budget_tokens`, or a share of the model's)."""
        return self._parts.context_budget_tokens

    @property
    def replica_id(self) -> str | None:
        """This process's replica id; `None` for a single process."""
        return self._parts.replicas.replica_id

    @property
    def internals(self) -> ManagerParts:
        """The composition root's parts (`sessions.assembly`), for tests and benchmarks that look
        inside; no face reaches them (`tests/test_package_shape.py`)."""
        return self._parts

    # -- tenants -------------------------------------------------------------------------------

    def create_tenant(self, name: str) -> Tenant:
        """Create a tenant with a fresh data-encryption key.

        Raises:
            InvalidInput: if the name is not 1-64 of `A-Z a-z 0-9 _ . -` (starting alphanumeric).
            TenantExists: if the name is taken.
        """
        self._check_open()
        return self._parts.tenants.create(name)

    def list_tenants(self) -> list[Tenant]:
        return self._parts.registry.tenants()

    def get_tenant(self, tenant: TenantRef) -> Tenant:
        """Resolve a `Tenant`, tenant id or tenant name. Raises `TenantNotFound`."""
        return self._parts.registry.tenant(tenant)

    def delete_tenant(self, tenant: TenantRef) -> None:
        """Crypto-shred, then delete: the data key is destroyed first, so blobs that survive
        anywhere are unreadable; then caches, files and rows go."""
        self._parts.tenants.delete(tenant)

    def issue_api_key(self, tenant: TenantRef) -> str:
        """A new API key for the tenant (shown once; only a salted hash is stored). Replaces the old one."""
        return self._parts.tenants.issue_api_key(tenant)

    def tenant_for_api_key(self, api_key: str) -> Tenant:
        """The tenant an API key belongs to. Raises `TenantNotFound` for any wrong or unknown key
        (the same error and message either way)."""
        return self._parts.tenants.for_api_key(api_key)

    def rotate_master_key(self, new_master_key: str | None = None) -> str:
        """Re-wrap every tenant's data key under a new master key; blobs are untouched. See
        `Tenants.rotate_master_key` for the argument and errors. Returns the new key's id."""
        return self._parts.tenants.rotate_master_key(new_master_key)

    # -- sessions ------------------------------------------------------------------------------

    def open_session(
        self,
        tenant: TenantRef,
        system_prompt: str | None = None,
        title: str | None = None,
        *,
        history: Sequence[tuple[str, str]] = (),
        name: str | None = None,
    ) -> SessionId:
        """Create a session.

        Args:
            history: earlier turns to start from, `(user text, reply text)` each: a conversation
                a client brings along (the OpenAI API's stateless requests). The replies were not
                generated here, so their ids are their tokenised text; the first turn re-prefills.
                At most `MAX_HISTORY_TURNS` turns and `HISTORY_CONTEXT_MULTIPLE` times the model's
                context in tokens (`sessions.catalogue`): only the turns that fit the context
                window are prefilled, and a longer history is work with nothing to show for it.
            name: an id the client chooses (`sessions.registry.SESSION_NAME_RULE`), unique in the
                tenant: every call takes it in place of the session's id.

        Raises:
            InvalidInput: for a non-string prompt or history text, an overlong title, a bad name.
            SessionExists: if the tenant has a session called `name`.
            HistoryTooLong: for a history over the limits above (counting stops at the limit).
            ContextTooLong: if the system prompt leaves less than `MIN_TURN_TOKENS` of the
                context window for the conversation.
        """
        self._check_open()
        tenant_id = self._parts.registry.tenant_id(tenant)
        origin = "named" if name is not None else "explicit"
        return self._parts.catalogue.open(tenant_id, system_prompt, title, history, origin=origin, name=name)

    def fork(self, tenant: TenantRef, session_id: str, at_turn: int) -> SessionId:
        """A new session holding the first `at_turn` turns of the tenant's session `session_id`
        (0: only its system prompt), its cache that session's KV up to there, from whichever tier
        holds it (`sessions.forks`). The parent is untouched; the fork records it (`parent_id`,
        `fork_turns` in `SessionInfo`). Regenerating reply `i` is `fork(..., i)` followed by its
        user message again; editing user message `i` is `fork(..., i)` followed by the new text.

        Raises:
            SessionNotFound: if the session is not the tenant's.
            InvalidInput: if `at_turn` is not between 0 and the session's turn count.
        """
        self._check_open()
        return self._parts.histories.forks.fork(self._parts.registry.tenant_id(tenant), session_id, at_turn).session_id

    def list_sessions(self, tenant: TenantRef | None = None) -> list[SessionInfo]:
        """The tenant's sessions, most recently active first (`None`: every tenant's, for operators)."""
        registry = self._parts.registry
        return registry.sessions(None if tenant is None else registry.tenant_id(tenant))

    def session_info(self, tenant: TenantRef, session_id: str) -> SessionInfo:
        registry = self._parts.registry
        return registry.info(registry.session_record(registry.tenant_id(tenant), session_id))

    def history(self, tenant: TenantRef, session_id: str) -> list[Message]:
        registry = self._parts.registry
        return registry.messages(registry.tenant_id(tenant), session_id)

    def delete_session(self, tenant: TenantRef, session_id: str, *, erase: bool = False) -> None:
        """Delete the session: caches in every tier first (so no eviction can write a blob row for
        it meanwhile), then its rows. A turn in flight on it fails with `SessionNotFound`.
        `erase`: also wipe the deleted rows' bytes from SQLite's write-ahead log at once (a WAL
        checkpoint; `store: false`), not only from the main file."""
        self._parts.catalogue.delete(self._parts.registry.tenant_id(tenant), session_id, erase=erase)

    def pin_turn(self, tenant: TenantRef, session_id: str, turn_index: int) -> None:
        """Promote turn `turn_index` (0-based) into the base layer: it is never demoted.

        Raises:
            InvalidInput: if there is no such turn, it was already demoted out of the window, or
                the pinned content would leave less than `MIN_TURN_TOKENS` of the window.
        """
        self._parts.catalogue.pin(self._parts.registry.tenant_id(tenant), session_id, turn_index)

    def inspect_session(self, tenant: TenantRef, session_id: str) -> SessionDetail:
        """Session, layer table and cache placement (a host or disk cache is opened to read it)."""
        return self._parts.catalogue.inspect(self._parts.registry.tenant_id(tenant), session_id)

    def restore_session(self, tenant: TenantRef, session_id: str) -> RestoreResult:
        """Bring an idle session's cache up to the device now, as its next turn would (pre-warm).
        Budgets are enforced afterwards and may move it down again; `tier` says where it ended.

        Raises:
            SessionBusy: if a turn is in flight on the session (`SessionOwnedElsewhere`: on
                another replica, which kept it past `Settings.ownership_wait_s`).
        """
        return self._parts.catalogue.restore(self._parts.registry.tenant_id(tenant), session_id)

    def evict_session(self, tenant: TenantRef, session_id: str, to: str) -> str | None:
        """Move an idle session's cache down to `host` or `disk`, or `drop` it. Returns the tier.

        Raises:
            InvalidInput: for another target, or a target above the current tier.
            SessionBusy: if a turn is in flight on the session.
        """
        return self._parts.catalogue.evict(self._parts.registry.tenant_id(tenant), session_id, to)

    # -- turns ---------------------------------------------------------------------------------

    def chat(
        self,
        tenant: TenantRef,
        session_id: str,
        message: str,
        options: TurnOptions | None = None,
        *,
        cancel: CancelToken | None = None,
        **keywords: Unpack[TurnOptionKeywords],
    ) -> Reply:
        """Send a user message and return the reply. See `stream_chat` for the arguments and errors."""
        reply = None
        for item in self.stream_chat(tenant, session_id, message, options, cancel=cancel, **keywords):
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
        options: TurnOptions | None = None,
        *,
        expected_turns: int | None = None,
        cancel: CancelToken | None = None,
        **keywords: Unpack[TurnOptionKeywords],
    ) -> Generator[str | Reply, None, None]:
        """Yield reply text pieces as they are generated, then the `Reply`. The pieces joined equal
        `Reply.text`. The turn is stored when the generator finishes; abandoning it stores nothing.

        Args:
            options: sampling and stop strings (`TurnOptions`; default greedy, 256 tokens at most).
            keywords: `TurnOptions` fields replacing those of `options` (`max_new_tokens=64`,
                `stop=["\n"]`, ...). stop: up to 4 strings that end the reply once its text
                contains one; `Reply.text` ends before it, and the transcript and the cache hold
                the reply as returned. min_new_tokens: no stop token or stop string ends the reply
                before it has this many tokens. ignore_eos: no stop token ends it (it runs to
                `max_new_tokens` unless a stop string ends it).
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
        options = TurnOptions.of(options, keywords)
        _check_message(message)
        tenant_id = self._parts.registry.tenant_id(tenant)
        return self._parts.turns.stream(
            tenant_id, session_id, message, options, expected_turns=expected_turns, cancel=cancel
        )

    def continue_history(
        self,
        tenant: TenantRef,
        system_prompt: str | None,
        history: Sequence[tuple[str, str]],
        message: str,
        options: TurnOptions | None = None,
        *,
        cancel: CancelToken | None = None,
        **keywords: Unpack[TurnOptionKeywords],
    ) -> PlannedTurn:
        """A turn for a conversation its client brings along whole (the stateless pattern of
        OpenAI clients): `history` holds the earlier turns as `(user text, reply text as returned:
        Reply.text)`. The session is chosen when the turn starts (`sessions.turn_door`):
        the tenant's session whose whole history this is (continue), a fork of one holding it
        and more (regenerate, edit, retry: warm from its KV), or a new session holding it. Iterate
        the result for the pieces, then the `Reply`; its `session_id` and `action` are set by the
        first item. A session made for the turn goes again unless the turn completes.

        Raises (at the first item): as `stream_chat`, and `HistoryTooLong`.
        """
        target = TurnTarget(system_prompt, history)
        return self.run_turn(tenant, target, message, options, cancel=cancel, **keywords)

    def plan_turn(self, tenant: TenantRef, target: TurnTarget, *, forwarded: bool = False) -> TurnPlan:
        """Where a turn to `target` runs: the session it continues, forks or makes, and the route
        among replicas (`sessions.turn_door`; one prefix lookup for a posted history). Run it
        with `run_turn`; a plan is for one request (a session may move on meanwhile: the plan's
        later steps take the turn then).

        Args:
            forwarded: the request came from another replica (its hop marker): never forward it.

        Raises:
            ResponseNotFound, ConversationNotFound: the target names none of the tenant's (a
                session that is not the tenant's is `run_turn`'s `SessionNotFound`).
            InvalidInput: a posted system prompt or history that is not the named session's.
        """
        self._check_open()
        return self._parts.histories.door.plan(self._parts.registry.tenant_id(tenant), target, forwarded=forwarded)

    def run_turn(
        self,
        tenant: TenantRef,
        plan: TurnPlan | TurnTarget,
        message: str,
        options: TurnOptions | None = None,
        *,
        cancel: CancelToken | None = None,
        **keywords: Unpack[TurnOptionKeywords],
    ) -> PlannedTurn:
        """The turn of `plan` (a `TurnTarget`: planned when the turn starts). Iterate the result
        for the pieces, then the `Reply`; its `session_id`, `action`, `parent_id` and
        `turn_index` are set by the first item. A session made for the turn goes again unless
        the turn completes. See `stream_chat` for the other arguments.

        Raises: `InvalidInput` for the message or options; at the first item, as `stream_chat`
        and `plan_turn`, and `HistoryTooLong` for a new session's history.
        """
        self._check_open()
        options = TurnOptions.of(options, keywords)
        _check_message(message)
        tenant_id = self._parts.registry.tenant_id(tenant)
        turns, door = self._parts.turns, self._parts.histories.door

        def start(session_id: SessionId, expected_turns: int | None) -> Generator[str | Reply, None, None]:
            if cancel is not None:
                cancel.check()
            return turns.stream(tenant_id, session_id, message, options, expected_turns=expected_turns, cancel=cancel)

        if isinstance(plan, TurnTarget):
            target = plan
            return door.run(tenant_id, lambda: door.plan(tenant_id, target, routed=False), start)
        return door.run(tenant_id, plan, start)

    # -- operations ----------------------------------------------------------------------------

    def expire_sessions(self) -> int:
        """Delete the implicit sessions and uncontinued forks whose idle TTL ran out
        (`sessions.retention`); `chatkv serve` does it every few minutes. Returns how many."""
        return len(self._parts.histories.retention.expire())

    def start_retention_sweeps(self, interval_s: float = SWEEP_INTERVAL_S) -> None:
        """Expire sessions now and every `interval_s` in a background thread until `close()`
        (`chatkv serve` does). A second call changes nothing."""
        if self._sweeper is None:
            self._sweeper = RetentionSweeper(self._parts.histories.retention, interval_s)

    def set_tenant_retention(self, tenant: TenantRef, retention_s: float | None) -> None:
        """The tenant's own idle TTL of implicit sessions and forks, in seconds (`None`: the
        server's `Settings.implicit_retention_s`).

        Raises:
            InvalidInput: for a TTL that is not in (0, 100 years].
        """
        retention_s = check_retention_s(retention_s)
        tenant_id = self._parts.registry.tenant_id(tenant)
        if not self._parts.histories.history.set_retention(tenant_id=tenant_id, retention_s=retention_s):
            raise TenantNotFound(str(tenant_id))

    # -- replicas ------------------------------------------------------------------------------

    def route_turn(self, tenant: TenantRef, session_id: str | None, *, forwarded: bool = False) -> Route:
        """Where a fork or prefetch of the tenant's session (an id or a name; `None` or an unknown
        one: a new session) runs among replicas (a turn's route is `plan_turn`'s): here, forwarded
        to the owner, or here once the owner hands it over (`sessions.replicas.routing`); always
        here for a single process.

        Args:
            forwarded: the request came from another replica (its hop marker): never forward it.
        """
        registry = self._parts.registry
        tenant_id = registry.tenant_id(tenant)
        key = None
        if session_id is not None:
            with contextlib.suppress(SessionNotFound):  # the turn itself makes it, or answers 404
                key = CacheKey.for_session(tenant_id, SessionId(registry.session_record(tenant_id, session_id).id))
        return self._parts.histories.door.route(key, forwarded)

    def forward_failed(self, route: Route, error: str) -> Route:
        """A forward that never reached `route.url` (`error`: why, one line): the turn runs here
        once the owner hands the session over (or its lease expires). Returns that route."""
        self._parts.metrics.routes.labels("forward_failed").inc()
        return self._parts.replicas.forward_failed(route, error)

    def drain(self) -> None:
        """Start draining this replica: hand its sessions over as their turns end, and send new
        ones to other replicas (`chatkv serve` does it on SIGTERM; `chatkv replicas drain` asks a
        replica through the database). Nothing to do for a single process."""
        self._parts.replicas.drain()

    @property
    def draining(self) -> bool:
        return self._parts.replicas.draining

    def set_replica_url(self, url: str) -> None:
        """The URL this process serves at (`chatkv serve` calls it), shown to clients of other
        replicas that are refused a session this replica owns. `Settings.replica_url` wins."""
        self._parts.replicas.set_url(url)

    def stats(self) -> dict[str, Any]:
        """What `chatkv stats` shows: `Metrics.stats` (tiers, budgets, cache hit rate, prefill
        tokens saved, evictions, per-tenant prompt tokens, forks) and the model's name,
        fingerprint and context budget in tokens."""
        parts = self._parts
        return parts.metrics.stats(parts.tiers.usage(), len(parts.tiers.pool)) | {
            "model": self.model_name,
            "model_fingerprint": parts.engine.fingerprint,
            "context_budget_tokens": parts.context_budget_tokens,
        }


@dataclass(frozen=True, slots=True)
class Services:
    """What the composition root hands the faces (the HTTP API, the chat page, the CLI): the
    manager, and the services beside it that the faces take as they are, never through the
    manager. They live as long as the manager: `manager.close()` ends them all."""

    manager: SessionManager
    responses: ResponseRecords
    """Stored responses of the Responses API: points in sessions."""
    conversations: ConversationRecords
    """Conversations of the Conversations API: sessions with durable ids and items."""
    idempotency: IdempotentRequests
    """`Idempotency-Key`s of the turn routes and their recorded answers."""
    metrics: Metrics
    """The Prometheus series `/metrics` renders."""


def open_services(settings: Settings | None = None, *, engine: Engine | None = None) -> Services:
    """A `SessionManager` on `settings` (see it for the arguments and errors) with the services
    its composition root built beside it."""
    manager = SessionManager(settings, engine=engine)
    parts = manager.internals
    records = parts.records
    return Services(manager, records.responses, records.conversations, records.idempotency, parts.metrics)


def _check_message(message: str) -> None:
    check_text(message, "message", MAX_MESSAGE_CHARS)
    if not message.strip():
        raise InvalidInput("message must be a non-empty string")


def _assemble(settings: Settings, engine: Engine | None) -> ManagerParts:
    """`assemble`, with the storage layer's start-up failures named in this package's errors."""
    try:
        return assemble(settings, engine)
    except BadMasterKey as exc:
        raise InvalidSettings(f"master key: {exc}") from None
    except KeyRingError as exc:
        raise BackendUnavailable(f"key ring: {exc}") from None
    except RedisUnavailable as exc:  # a Redis Cluster must answer at start-up (its slot map)
        raise BackendUnavailable(f"redis: {exc}") from None
    except ReplicaIdInUse as exc:
        raise InvalidSettings(str(exc)) from None
