"""A turn asked for over the `/v1/` API: its parameters checked before anything is stored, the
session it runs on (named, or found by the posted history), and its first reply piece awaited
before the HTTP answer starts, so that every refusal (busy session, context too long) is still an
HTTP status rather than an error inside a stream.

Sessions found by history (stateless clients, which post the whole conversation each time):

    posted     system S, user u1, assistant a1, ..., user u(n)
    lookup     the tenant's sessions whose history digest is that of (S, u1, a1, ..., u(n-1), a(n-1))
               (assistant texts as they were returned), most recently active first
    continue   the first one that is idle and still has exactly n-1 turns
    otherwise  a new session holding the posted history (its first turn re-prefills it)

An edited history has another digest, so it never continues a cache computed for another history.
A new session whose first turn does not complete (refused, failed, or its client went away) is
deleted again: a request that fails leaves nothing stored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from sessions.errors import ChatKVError, InvalidInput, SessionBusy, SessionNotFound
from sessions.manager import MAX_MESSAGE_CHARS, SessionManager
from sessions.records import Reply, Tenant
from sessions.sampling import SamplingParams
from sessions.stop_strings import StopStrings
from sessions.validation import check_text

TurnStream = Generator[str | Reply, None, None]


@dataclass(frozen=True)
class TurnParams:
    """Sampling and stop parameters of one turn, checked at construction.

    Raises:
        InvalidInput: for a value `SessionManager.stream_chat` would refuse.
    """

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]

    def __post_init__(self) -> None:
        SamplingParams(self.max_new_tokens, self.temperature, self.top_p, self.seed)
        StopStrings(self.stop)

    def stream(
        self, manager: SessionManager, tenant: Tenant, session_id: str, message: str, **extra: Any
    ) -> TurnStream:
        return manager.stream_chat(
            tenant,
            session_id,
            message,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=self.stop,
            **extra,
        )


def check_message(text: object, what: str = "message") -> str:
    """A user message as `stream_chat` takes it. Raises `InvalidInput`."""
    check_text(text, what, MAX_MESSAGE_CHARS)
    if not isinstance(text, str) or not text.strip():
        raise InvalidInput(f"{what} must be a non-empty string")
    return text


@dataclass
class StartedTurn:
    """A turn whose first item (a text piece, or the `Reply` of an empty reply) has arrived."""

    manager: SessionManager
    tenant: Tenant
    session_id: str
    first: str | Reply
    rest: TurnStream
    created: bool = False
    """The session was made for this turn (deleted again unless the turn completes)."""
    reply: Reply | None = field(default=None, init=False)

    def items(self) -> Iterator[str | Reply]:
        """The first item, then the rest; the last is the `Reply` (the turn is then stored)."""
        for item in _chain(self.first, self.rest):
            if isinstance(item, Reply):
                self.reply = item
            yield item

    def pieces(self) -> Iterator[str]:
        """The reply's text pieces; afterwards `reply` is set."""
        for item in self.items():
            if not isinstance(item, Reply):
                yield item

    def run(self) -> Reply:
        """Wait for the whole reply."""
        for _ in self.pieces():
            pass
        if self.reply is None:
            raise RuntimeError("bug: a turn ended without a reply")
        return self.reply

    def close(self) -> None:
        """End the turn: an unfinished one is cancelled (nothing stored), and a session made for it
        is deleted unless its turn was stored."""
        self.rest.close()
        if self.created and self.reply is None:
            with contextlib.suppress(ChatKVError):
                self.manager.delete_session(self.tenant, self.session_id)


def _chain(first: str | Reply, rest: TurnStream) -> Iterator[str | Reply]:
    yield first
    yield from rest


def start_turn(
    manager: SessionManager,
    tenant: Tenant,
    session_id: str,
    message: str,
    params: TurnParams,
    *,
    created: bool = False,
    expected_turns: int | None = None,
) -> StartedTurn:
    """Run the turn up to its first item.

    Raises:
        ChatKVError: the turn was refused (nothing stored; a `created` session is deleted).
    """
    stream = params.stream(manager, tenant, session_id, message, expected_turns=expected_turns)
    try:
        first = next(stream)
    except ChatKVError:
        if created:
            with contextlib.suppress(ChatKVError):
                manager.delete_session(tenant, session_id)
        raise
    return StartedTurn(manager, tenant, session_id, first, stream, created=created)


def continue_history(
    manager: SessionManager,
    tenant: Tenant,
    system_prompt: str | None,
    history: Sequence[tuple[str, str]],
    message: str,
    params: TurnParams,
) -> StartedTurn:
    """Continue the tenant's session whose history is `system_prompt` + `history` (see the module),
    or start one that holds it."""
    for session_id in manager.find_sessions_by_history(tenant, system_prompt, history):
        try:
            return start_turn(manager, tenant, session_id, message, params, expected_turns=len(history))
        except (SessionBusy, SessionNotFound):  # a turn in flight, moved on, or deleted meanwhile
            continue
    session_id = manager.open_session(tenant, system_prompt, history=history)
    return start_turn(manager, tenant, session_id, message, params, created=True)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from chatkv's cache instead of prefilled.")


class Usage(BaseModel):
    """OpenAI's token usage of a reply."""

    prompt_tokens: int = Field(description="Tokens of the conversation up to the reply: prefilled plus cached.")
    completion_tokens: int = Field(description="Tokens generated (a closing stop token included).")
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(reply: Reply) -> Usage:
    """The `usage` of a reply: prompt tokens are those prefilled plus those served from chatkv's
    cache (`cached_tokens`, `TurnStats.reused_tokens`)."""
    stats = reply.stats
    prompt = stats.prefill_tokens + stats.reused_tokens
    completion = len(reply.token_ids)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.reused_tokens),
    )
