"""The door of a turn: where it runs is decided here, once, from a `TurnTarget` (every face
builds one), into a `TurnPlan` (one prefix lookup at most), which `run` carries out.

    target                      steps of the plan (each tried in order; the last made if need be)
    a posted history            lookup: the tenant's sessions holding the longest prefix of
      (system S, u1 a1, ...,      (S, u1 a1, ...) (one query)
      u(n-1) a(n-1))            continue  each implicit session (made for a stateless client)
                                          whose whole history it is, idle, with n-1 turns
                                fork      the cheapest session holding all n-1 turns and more
                                          (regenerate, edit, retry; or busy; or made by a client
                                          that names its sessions, never continued by another
                                          request): a fork after turn n-1, warm from its KV
                                new       nothing holds them all: a new implicit session
    a session (id or name)      continue  it (with a posted history: only if it is exactly the
                                          session's, and it still has those turns); a name not
                                          used yet, if the face allows: a new named session
      with fork_turns k         fork      it after its first k turns (regenerate, edit)
    a new session               new       an explicit session holding the posted history
    a previous response         continue  its session, if the response is its latest (stored)
                                fork      its session after the response's turn (a branch)
                                new       instructions that differ from the session's: a new
                                          session holding its turns through the response
    a conversation              continue  its session while it holds exactly its items (a turn
                                          in flight there: 409 session_busy, never a branch)
                                new       a new session holding them

A session made for the turn (a fork, a new one) is deleted again unless its turn completes: a
refused, failed or abandoned request leaves nothing stored. The plan's route says where among
replicas the turn runs: that of the session its first step continues or forks
(`sessions.replicas.routing`); a new session runs here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Protocol

from cache.ids import SessionId, TenantId
from cache.tier_manager import TierManager
from cache.tiers import CacheKey
from sessions.conversations import ConversationRecords
from sessions.errors import ChatKVError, InvalidInput, SessionBusy, SessionExists, SessionNotFound
from sessions.forks import TIER_RANK, Forks
from sessions.metrics import Metrics
from sessions.records import Message, Reply
from sessions.registry import SESSION_ID_PREFIX, Registry
from sessions.replicas.role import Replicas
from sessions.replicas.routing import Route
from sessions.responses import ResponseRecords
from sessions.turn_target import Action, Continue, Fork, New, Step, TurnPlan, TurnTarget
from storage.history_digest import digest_chain
from storage.history_store import HistoryStore, PrefixMatch

TurnStream = Generator[str | Reply, None, None]
StartTurn = Callable[[SessionId, int | None], TurnStream]
"""Runs a turn on a session (`expected_turns`: continue only if it still has that many)."""


class OpenSession(Protocol):
    def __call__(
        self,
        tenant_id: TenantId,
        system_prompt: str | None,
        title: str | None,
        history: Sequence[tuple[str, str]] = (),
        *,
        origin: str = "explicit",
        name: str | None = None,
    ) -> SessionId: ...


class PlannedTurn(Iterator[str | Reply]):
    """A planned turn: iterate for its text pieces, then its `Reply`.

    Nothing happens until the first item is asked for (`start()` or `next()`): then the plan's
    steps run (`session_id`, `action`, `parent_id`, `turn_index` are set; `on_made` is called)
    up to the turn's first item, so every refusal is raised there. `close()` abandons it (nothing
    stored).
    """

    def __init__(self, run: Callable[[PlannedTurn], TurnStream]) -> None:
        self.session_id: SessionId | None = None
        self.action: Action | None = None
        self.parent_id: SessionId | None = None
        self.fork_source: str | None = None
        """Where a fork's cache came from (`device`, `host`, `disk`, `redis`, `rebuilt`)."""
        self.turn_index: int | None = None
        """The index of the turn (the turns its session held before it), when the plan knew it."""
        self.on_made: Callable[[SessionId], None] | None = None
        """Set before the first item: called, in the thread running the turn, with the session
        made for it (a fork or a new one) once it exists, before its prefill (the chat page shows
        it while the turn prefills)."""
        self._stream = run(self)

    def __next__(self) -> str | Reply:
        return next(self._stream)

    def start(self) -> str | Reply:
        """Run the plan up to the turn's first item (a piece, or the `Reply`)."""
        return next(self._stream)

    def close(self) -> None:
        self._stream.close()


class TurnDoor:
    """Plans turns and runs plans (see the module docstring).

    Args:
        history: the turn-digest index (prefix lookups).
        registry: session records and transcripts.
        tiers: where candidate parents' caches are (the cheapest is forked from).
        forks: makes forks.
        fork_histories: `False` turns forking of posted histories off (a prefix that is not a
            whole history then starts a new session, as before forks existed).
        open_session: creates a session (`SessionCatalogue.open`).
        delete_session: removes a session made for a turn that did not complete.
        responses, conversations: the stored responses and conversations targets name.
        replicas, metrics: routes, and their count by kind.
    """

    def __init__(
        self,
        *,
        history: HistoryStore,
        registry: Registry,
        tiers: TierManager,
        forks: Forks,
        fork_histories: bool,
        open_session: OpenSession,
        delete_session: Callable[..., None],
        responses: ResponseRecords,
        conversations: ConversationRecords,
        replicas: Replicas,
        metrics: Metrics,
    ) -> None:
        self._history = history
        self._registry = registry
        self._tiers = tiers
        self._forks = forks
        self._fork_histories = fork_histories
        self._open = open_session
        self._delete = delete_session
        self._responses = responses
        self._conversations = conversations
        self._replicas = replicas
        self._metrics = metrics

    def plan(
        self, tenant_id: TenantId, target: TurnTarget, *, forwarded: bool = False, routed: bool = True
    ) -> TurnPlan:
        """The plan of a turn to `target`, and its route (`forwarded`: the request came from
        another replica, so it runs here; `routed=False`: here, unasked, for a turn already here).

        Raises:
            ResponseNotFound, ConversationNotFound: for an unknown previous response or conversation.
            InvalidInput: a system prompt or history that is not the named session's.
        """
        steps = self._steps(tenant_id, target)
        first = steps[0]
        anchor = first.parent_id if isinstance(first, Fork) else None
        if isinstance(first, Continue) and first.found:
            anchor = first.session_id
        key = CacheKey.for_session(tenant_id, SessionId(anchor)) if anchor is not None else None
        route = self.route(key, forwarded) if routed else Route("local", anchor)
        return TurnPlan(target, steps, route, erase=not target.store)

    def route(self, key: CacheKey | None, forwarded: bool) -> Route:
        """The route of a turn on the session `key` (`None`: a new one), counted by kind."""
        route = self._replicas.route(key, forwarded=forwarded)
        self._metrics.routes.labels(route.kind).inc()
        return route

    def run(self, tenant_id: TenantId, plan: TurnPlan | Callable[[], TurnPlan], start: StartTurn) -> PlannedTurn:
        """The turn of `plan` (or of the plan `plan()` makes at the first item), run by `start`."""

        def stream(turn: PlannedTurn) -> TurnStream:
            planned = plan if isinstance(plan, TurnPlan) else plan()
            yield from self._run_steps(turn, tenant_id, planned.target, planned.steps, planned.erase, start)

        return PlannedTurn(stream)

    # -- planning ------------------------------------------------------------------------------

    def _steps(self, tenant_id: TenantId, target: TurnTarget) -> tuple[Step, ...]:
        if target.session is not None:
            return self._named(tenant_id, target, target.session)
        if target.previous_response is not None:
            return self._after_response(tenant_id, target, target.previous_response)
        if target.conversation is not None:
            return self._in_conversation(tenant_id, target, target.conversation)
        if target.new_session:
            return (New(target.system_prompt, tuple(target.history), "explicit"),)
        return self._posted(tenant_id, target)

    def _posted(self, tenant_id: TenantId, target: TurnTarget) -> tuple[Step, ...]:
        history = target.history
        digests = digest_chain(target.system_prompt, history)
        matches = self._history.longest_prefix(tenant_id=tenant_id, digests=digests)
        steps: list[Step] = [Continue(m.session_id, len(history)) for m in matches if _continues(m, history)]
        whole = [m for m in matches if m.turns == len(history)]
        if whole and self._fork_histories:
            parent = min(whole, key=lambda match: self._cost(tenant_id, match))
            # Made for a stateless request: it expires like an implicit session when idle.
            return (*steps, Fork(parent.session_id, len(history), "implicit"))
        return (*steps, New(target.system_prompt, tuple(history), "implicit"))

    def _named(self, tenant_id: TenantId, target: TurnTarget, name: str) -> tuple[Step, ...]:
        try:
            record = self._registry.session_record(tenant_id, name)
        except SessionNotFound:
            if not target.create or name.startswith(SESSION_ID_PREFIX):
                return (Continue(name, None, found=False),)
            return (New(target.system_prompt, tuple(target.history), "named", name=name),)
        if target.fork_turns is not None:
            return (Fork(record.id, target.fork_turns, "fork"),)
        if target.system_prompt is not None and target.system_prompt != record.system_prompt:
            raise InvalidInput("the system message differs from the session's system prompt")
        history = target.history
        if history and record.id not in self._registry.find_by_history(tenant_id, target.system_prompt, history):
            raise InvalidInput(
                "the posted history is not this session's: send only the new user message, or its whole history "
                "as it was returned"
            )
        return (Continue(record.id, len(history) if history else None),)

    def _after_response(self, tenant_id: TenantId, target: TurnTarget, response_id: str) -> tuple[Step, ...]:
        point = self._responses.point(tenant_id, response_id)
        turns = point.turn_index + 1
        instructions = target.system_prompt
        if (
            instructions is not None
            and instructions != self._registry.session_record(tenant_id, point.session_id).system_prompt
        ):
            messages = self._registry.messages(tenant_id, point.session_id)[: 2 * turns]
            earlier = _turn_pairs(messages)
            return (New(instructions, earlier, "explicit"),)
        fork = Fork(point.session_id, turns, "fork")
        if point.latest and target.store:
            return (Continue(point.session_id, turns), fork)  # busy or moved on meanwhile: branch
        return (fork,)

    def _in_conversation(self, tenant_id: TenantId, target: TurnTarget, conversation_id: str) -> tuple[Step, ...]:
        record = self._conversations.get(tenant_id, conversation_id)
        if record.session_id is not None and self._holds(tenant_id, record.session_id, target):
            # No fallback: a turn in flight there is a 409 (SessionBusy), like a session's own route.
            # A new session would run a turn the conversation then lists after the one in flight,
            # whose reply it never saw.
            return (Continue(record.session_id, len(target.history)),)
        return (New(target.system_prompt, tuple(target.history), "explicit"),)

    def _holds(self, tenant_id: TenantId, session_id: str, target: TurnTarget) -> bool:
        """Whether the session holds exactly the target's system prompt and earlier turns."""
        try:
            record = self._registry.session_record(tenant_id, session_id)
            messages = self._registry.messages(tenant_id, session_id)
        except SessionNotFound:
            return False
        return record.system_prompt == target.system_prompt and _turn_pairs(messages) == tuple(target.history)

    def _cost(self, tenant_id: TenantId, match: PrefixMatch) -> tuple[int, float]:
        """Cheaper parents first: a cache on the device, then host, disk, elsewhere; then the most
        recently active."""
        tier = self._tiers.placement(CacheKey.for_session(tenant_id, SessionId(match.session_id)))
        rank = TIER_RANK.get(tier, len(TIER_RANK)) if tier is not None else len(TIER_RANK)
        return rank, -match.last_active_at.timestamp()

    # -- running -------------------------------------------------------------------------------

    def _run_steps(
        self,
        turn: PlannedTurn,
        tenant_id: TenantId,
        target: TurnTarget,
        steps: tuple[Step, ...],
        erase: bool,
        start: StartTurn,
    ) -> TurnStream:
        """Continue the first session that takes the turn; else make the last step's session."""
        for number, step in enumerate(steps):
            if not isinstance(step, Continue):
                yield from self._on_made(turn, tenant_id, target, step, erase, start)
                return
            stream = start(SessionId(step.session_id), step.expected_turns)
            try:
                first = next(stream)
            except (SessionBusy, SessionNotFound):  # a turn in flight, moved on, or deleted meanwhile
                if number == len(steps) - 1:
                    raise
                continue
            turn.session_id, turn.action, turn.turn_index = SessionId(step.session_id), "continue", step.expected_turns
            yield first
            yield from stream
            return

    def _on_made(
        self,
        turn: PlannedTurn,
        tenant_id: TenantId,
        target: TurnTarget,
        step: Fork | New,
        erase: bool,
        start: StartTurn,
    ) -> TurnStream:
        """Fork or open the step's session and run the turn there, deleting the session again
        unless the turn completes (or another client's turn took the session before this one
        could: it is theirs then)."""
        if isinstance(step, Fork):
            made = self._forks.fork(tenant_id, step.parent_id, step.turns, origin=step.origin)
            turn.session_id, turn.action, turn.turn_index = made.session_id, "fork", step.turns
            turn.parent_id, turn.fork_source = SessionId(step.parent_id), made.source
        else:
            try:
                session_id = self._open(
                    tenant_id, step.system_prompt, None, step.history, origin=step.origin, name=step.name
                )
            except SessionExists:  # another request named it first: go on with that one
                again = self._steps(tenant_id, target)
                yield from self._run_steps(turn, tenant_id, target, again, erase, start)
                return
            turn.session_id, turn.action, turn.turn_index = session_id, "new", len(step.history)
        completed = taken = False
        try:
            if turn.on_made is not None:
                turn.on_made(turn.session_id)
            stream = start(turn.session_id, None)
            try:
                first = next(stream, None)
            except SessionBusy:
                # The made session is listed (and shown through `on_made`) before this turn holds
                # it: a client whose turn took it first is using it, so it is not deleted under them.
                taken = True
                raise
            if first is None:
                return
            completed = isinstance(first, Reply)
            yield first
            for item in stream:
                completed = isinstance(item, Reply)
                yield item
        finally:
            if not completed and not taken:
                with contextlib.suppress(ChatKVError):
                    self._delete(tenant_id, turn.session_id, erase=erase)


def _continues(match: PrefixMatch, history: Sequence[tuple[str, str]]) -> bool:
    """Whether a posted history's turn may run on the matched session itself: an implicit session
    whose whole history it is."""
    return match.origin == "implicit" and match.whole and match.turns == len(history)


def _turn_pairs(messages: Sequence[Message]) -> tuple[tuple[str, str], ...]:
    """A session's stored messages as (user text, reply text) turns; a trailing unanswered one is left out."""
    return tuple((messages[i].text, messages[i + 1].text) for i in range(0, len(messages) - 1, 2))
