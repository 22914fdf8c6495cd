"""A turn on a posted history: the one place that decides which session a stateless client's
conversation continues (the chat-completions route, the Responses API, the chat page and embedding
backends all ask here).

    posted    system S, u1 a1, ..., u(n-1) a(n-1), and the new message u(n)
    lookup    the tenant's sessions holding the longest prefix of (S, u1 a1, ...) (one query)
    continue  an implicit session (one made for a stateless client) whose whole history is all
              n-1 turns, idle: the turn runs on it
    fork      a session holding all n-1 turns and more (regenerate, edit, retry), busy, or made by
              a client that names its sessions (explicit, named, a fork it asked for: never
              continued by another request, which would add a turn to that client's
              conversation): a fork of it after turn n-1 (`sessions.forks`), warm from its KV,
              runs the turn
    new       nothing holds them all: a new session holding the posted history (its first turn
              prefills it; the base layer still comes from the tenant's pool)

A session made for the turn (a fork, a new one) is deleted again unless its turn completes: a
refused, failed or abandoned request leaves nothing stored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Literal

from cache.ids import SessionId, TenantId
from cache.tier_manager import TierManager
from cache.tiers import CacheKey
from sessions.errors import ChatKVError, SessionBusy, SessionNotFound
from sessions.forks import TIER_RANK, Forks
from sessions.records import Reply
from storage.history_digest import digest_chain
from storage.history_store import HistoryStore, PrefixMatch

Action = Literal["continue", "fork", "new"]
TurnStream = Generator[str | Reply, None, None]
StartTurn = Callable[[SessionId, int | None], TurnStream]
"""Runs a turn on a session (`expected_turns`: continue only if it still has that many)."""


class HistoryTurn(Iterator[str | Reply]):
    """The turn of a posted history: iterate for its text pieces, then its `Reply`.

    Nothing happens until the first item is asked for (`start()` or `next()`): then the session is
    chosen (`session_id`, `action`, `parent_id` are set) and the turn runs up to its first item,
    so every refusal is raised there. `close()` abandons it (nothing stored).
    """

    def __init__(self, run: Callable[[HistoryTurn], TurnStream]) -> None:
        self.session_id: SessionId | None = None
        self.action: Action | None = None
        self.parent_id: SessionId | None = None
        self.fork_source: str | None = None
        """Where a fork's cache came from (`device`, `host`, `disk`, `redis`, `rebuilt`)."""
        self._stream = run(self)

    def __next__(self) -> str | Reply:
        return next(self._stream)

    def start(self) -> str | Reply:
        """Choose the session and run the turn up to its first item (a piece, or the `Reply`)."""
        return next(self._stream)

    def close(self) -> None:
        self._stream.close()


class HistoryLookup:
    """Chooses the session for posted histories (see the module docstring).

    Args:
        history: the turn-digest index.
        tiers: where candidate parents' caches are (the cheapest is forked from).
        forks: makes forks; `None` turns forking off (a prefix that is not a whole history then
            starts a new session, as before forks existed).
        open_session: creates a new implicit session holding a posted history.
        delete_session: removes a session made for a turn that did not complete.
    """

    def __init__(
        self,
        *,
        history: HistoryStore,
        tiers: TierManager,
        forks: Forks | None,
        open_session: Callable[[TenantId, str | None, Sequence[tuple[str, str]]], SessionId],
        delete_session: Callable[[TenantId, SessionId], None],
    ) -> None:
        self._history = history
        self._tiers = tiers
        self._forks = forks
        self._open = open_session
        self._delete = delete_session

    def turn(
        self,
        tenant_id: TenantId,
        system_prompt: str | None,
        history: Sequence[tuple[str, str]],
        start_turn: StartTurn,
    ) -> HistoryTurn:
        """The turn on the session for `system_prompt` + `history` (user text, reply text as the
        client received it), run by `start_turn`."""

        def run(turn: HistoryTurn) -> TurnStream:
            matches = self._matches(tenant_id, system_prompt, history)
            for match in matches:
                if not _continues(match, history):
                    continue
                stream = start_turn(SessionId(match.session_id), len(history))
                try:
                    first = next(stream)
                except (SessionBusy, SessionNotFound):  # a turn in flight, moved on, or deleted meanwhile
                    continue
                turn.session_id, turn.action = SessionId(match.session_id), "continue"
                yield first
                yield from stream
                return
            yield from self._on_new_session(turn, tenant_id, system_prompt, history, matches, start_turn)

        return HistoryTurn(run)

    def session_for(
        self, tenant_id: TenantId, system_prompt: str | None, history: Sequence[tuple[str, str]]
    ) -> SessionId | None:
        """The session a turn on this posted history would continue, or the parent it would fork,
        chosen ahead as `turn` chooses (without running anything); `None`: a new session. Among
        replicas, the turn is forwarded to that session's owner, whose own lookup then finds it
        (or, if it is busy there by then, forks it)."""
        matches = self._matches(tenant_id, system_prompt, history)
        for match in matches:
            if _continues(match, history):
                return SessionId(match.session_id)
        parent = self._parent(tenant_id, history, matches)
        return SessionId(parent.session_id) if parent is not None else None

    def _parent(
        self, tenant_id: TenantId, history: Sequence[tuple[str, str]], matches: list[PrefixMatch]
    ) -> PrefixMatch | None:
        """The cheapest session holding every posted turn, to fork; `None` without forks."""
        whole = [m for m in matches if m.turns == len(history)]
        if not whole or self._forks is None:
            return None
        return min(whole, key=lambda match: self._cost(tenant_id, match))

    def _matches(
        self, tenant_id: TenantId, system_prompt: str | None, history: Sequence[tuple[str, str]]
    ) -> list[PrefixMatch]:
        return self._history.longest_prefix(tenant_id=tenant_id, digests=digest_chain(system_prompt, history))

    def _on_new_session(
        self,
        turn: HistoryTurn,
        tenant_id: TenantId,
        system_prompt: str | None,
        history: Sequence[tuple[str, str]],
        matches: list[PrefixMatch],
        start_turn: StartTurn,
    ) -> TurnStream:
        """Fork the best parent holding every posted turn, else open a new session; run the turn
        there, deleting the session again unless the turn completes."""
        parent = self._parent(tenant_id, history, matches)
        if parent is not None and self._forks is not None:
            # Made for a stateless request: it expires like an implicit session when idle.
            made = self._forks.fork(tenant_id, parent.session_id, len(history), origin="implicit")
            turn.session_id, turn.action = made.session_id, "fork"
            turn.parent_id, turn.fork_source = SessionId(parent.session_id), made.source
        else:
            turn.session_id, turn.action = self._open(tenant_id, system_prompt, history), "new"
        completed = False
        try:
            for item in start_turn(turn.session_id, None):
                completed = isinstance(item, Reply)
                yield item
        finally:
            if not completed:
                with contextlib.suppress(ChatKVError):
                    self._delete(tenant_id, turn.session_id)

    def _cost(self, tenant_id: TenantId, match: PrefixMatch) -> tuple[int, float]:
        """Cheaper parents first: a cache on the device, then host, disk, elsewhere; then the most
        recently active."""
        tier = self._tiers.placement(CacheKey.for_session(tenant_id, SessionId(match.session_id)))
        rank = TIER_RANK.get(tier, len(TIER_RANK)) if tier is not None else len(TIER_RANK)
        return rank, -match.last_active_at.timestamp()


def _continues(match: PrefixMatch, history: Sequence[tuple[str, str]]) -> bool:
    """Whether a posted history's turn may run on the matched session itself: an implicit session
    whose whole history it is."""
    return match.origin == "implicit" and match.whole and match.turns == len(history)
