"""A turn asked for over the `/v1/` API: its request read and planned once (`Decided`: the
`TurnPlan` of the `TurnTarget` the face built, with its route among replicas), then run here or
forwarded (`app.http.forwarding`), its first reply piece awaited before the HTTP answer starts, so
that every refusal (busy session, context too long) is still an HTTP status rather than an error
inside a stream. Which session a turn runs on is `sessions.turn_door`'s to decide.

A turn's route is an `async def` that runs the blocking turn in the threadpool and meanwhile
listens for its client's disconnect (`run_watching_disconnect`): a client that goes away while the
turn is prepared or, unstreamed, while it decodes cancels it (`CancelToken`), as closing a stream
does. An `Idempotency-Key` header makes the route record its answer (`IdempotencyGuard`), so the
client's retry of a completed turn gets that answer instead of a second turn.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from app.http.api_errors import DATABASE_ERRORS, ApiError, response_for
from app.http.sse import EventStream
from sessions import (
    MAX_MESSAGE_CHARS,
    CancelToken,
    ChatKVError,
    Claimed,
    IdempotentRequests,
    InProgress,
    InvalidInput,
    KeyReused,
    PlannedTurn,
    Replay,
    Reply,
    Route,
    SessionManager,
    Tenant,
    TurnOptions,
    TurnPlan,
    check_text,
)

TurnStream = Generator[str | Reply, None, None]
T = TypeVar("T")
SESSION_HEADER = "X-Session-ID"
"""Names the session of a turn: in a request (continue it), and in every turn's answer."""
IDEMPOTENCY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
IN_PROGRESS_RETRY_AFTER_S = 1


async def run_watching_disconnect(request: Request, cancel: CancelToken, work: Callable[[], T]) -> T:
    """Run the blocking `work` in the threadpool; if the client disconnects meanwhile, cancel
    `cancel` (the turn stops at its next step and stores nothing). The request's body must have
    been read already (FastAPI has, for a route with a body model): what arrives afterwards is
    the disconnect."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await run_in_threadpool(work)
    finally:
        watcher.cancel()


class IdempotencyGuard:
    """One request's use of an `Idempotency-Key` (with none, every method is a no-op).

    Args:
        route: the route as the fingerprint names it (with the session id of a path).
        body: the body as received.
        target: the headers that say where the turn goes (`X-Session-ID`), part of the fingerprint.

    Raises (from the constructor):
        InvalidInput: for a malformed key.
        ApiError: 409 `idempotency_key_in_use` while the first request with the key still runs;
            400 `idempotency_key_reused` if the key came with another request before.
    """

    def __init__(
        self,
        idempotency: IdempotentRequests,
        tenant: Tenant,
        key: str | None,
        route: str,
        body: bytes,
        target: Mapping[str, str | None] | None = None,
    ) -> None:
        self._idempotency = idempotency
        self.replay: Replay | None = None
        self._claim: Claimed | None = None
        if key is None:
            return
        outcome = idempotency.claim(tenant.id, key, route, body, target)
        if isinstance(outcome, InProgress):
            raise ApiError(
                409,
                f"a request with this {IDEMPOTENCY_HEADER} is still running; retry shortly",
                "idempotency_key_in_use",
                headers={"Retry-After": str(IN_PROGRESS_RETRY_AFTER_S)},
            )
        if isinstance(outcome, KeyReused):
            raise ApiError(
                400,
                f"this {IDEMPOTENCY_HEADER} was sent with a different request (another body, route or "
                f"{SESSION_HEADER}); use a new key for a new request",
                "idempotency_key_reused",
                param=IDEMPOTENCY_HEADER,
            )
        if isinstance(outcome, Replay):
            self.replay = outcome
        if isinstance(outcome, Claimed):
            self._claim = outcome

    @property
    def claim(self) -> Claimed | None:
        """The key this request holds, for the store that records its answer in the same
        transaction (`ResponseRecords.record(answers=...)`; then `answered()`)."""
        return self._claim

    def answered(self) -> None:
        """The answer was recorded with what stored it (`claim`): nothing is left to release."""
        self._claim = None

    def complete(self, session_id: str, response: BaseModel | dict[str, Any]) -> None:
        """Record the answer of the request (its turn completed): a model, or a JSON object."""
        if self._claim is not None:
            claim, self._claim = self._claim, None
            text = response.model_dump_json() if isinstance(response, BaseModel) else json.dumps(response)
            self._idempotency.complete(claim, text, session_id)

    def release(self) -> None:
        """The request did not complete: a retry with the key runs afresh (idempotent)."""
        if self._claim is not None:
            claim, self._claim = self._claim, None
            self._idempotency.release(claim)


MAX_OPENAI_TEMPERATURE = 2.0
"""OpenAI's upper bound of `temperature` (its lower bound, 0, is chatkv's own)."""
MAX_OPENAI_STOP_STRINGS = 4


def check_openai_ranges(
    *,
    temperature: float | None,
    max_tokens: int | None,
    max_tokens_name: str,
    min_tokens: int | None = None,
    stop_strings: int = 0,
) -> None:
    """OpenAI's limits on a turn's parameters, refused with the field's OpenAI name in `param`
    before `TurnOptions` checks them under chatkv's own names (`max_new_tokens`, ...).

    Raises:
        ApiError: 400 `invalid_request` naming the field: `temperature` outside [0, 2], a
            `max_tokens` (or `max_output_tokens`) under 1, a negative `min_tokens` or one above
            `max_tokens`, over 4 `stop` strings.
    """

    def refuse(param: str, message: str) -> ApiError:
        return ApiError(400, f"Invalid '{param}': {message}", "invalid_request", param=param)

    if isinstance(temperature, int | float) and not 0.0 <= temperature <= MAX_OPENAI_TEMPERATURE:
        raise refuse("temperature", f"expected a value from 0 to {MAX_OPENAI_TEMPERATURE:g}, got {temperature!r}")
    if isinstance(max_tokens, int) and max_tokens < 1:
        raise refuse(max_tokens_name, f"expected a value >= 1, got {max_tokens}")
    if isinstance(min_tokens, int) and min_tokens < 0:
        raise refuse("min_tokens", f"expected a value >= 0, got {min_tokens}")
    if isinstance(min_tokens, int) and isinstance(max_tokens, int) and min_tokens > max_tokens:
        raise refuse("min_tokens", f"must not exceed {max_tokens_name} ({max_tokens}), got {min_tokens}")
    if stop_strings > MAX_OPENAI_STOP_STRINGS:
        raise refuse("stop", f"takes at most {MAX_OPENAI_STOP_STRINGS} strings, got {stop_strings}")


def check_message(text: object, what: str = "message") -> str:
    """A user message as `stream_chat` takes it. Raises `InvalidInput`."""
    check_text(text, what, MAX_MESSAGE_CHARS)
    if not isinstance(text, str) or not text.strip():
        raise InvalidInput(f"{what} must be a non-empty string")
    return text


@dataclass(frozen=True)
class Posted:
    """Posted messages as chatkv takes them: a system prompt, earlier turns (user text, reply text
    as it was returned) and the new user message."""

    system_prompt: str | None
    history: list[tuple[str, str]]
    message: str


@dataclass(frozen=True)
class Decided:
    """A turn request read and planned before anything runs (`Forwarder.run_turn`'s `decide`):
    the plan (with its route), the posted messages, the options."""

    plan: TurnPlan
    posted: Posted
    options: TurnOptions

    @property
    def route(self) -> Route:
        return self.plan.route


@dataclass
class StartedTurn:
    """A turn whose first item (a text piece, or the `Reply` of an empty reply) has arrived."""

    session_id: str
    first: str | Reply
    rest: PlannedTurn
    reply: Reply | None = field(default=None, init=False)

    @property
    def turn_index(self) -> int:
        if self.rest.turn_index is None:
            raise RuntimeError("bug: a turn's index is known only for a planned history")
        return self.rest.turn_index

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
        """End the turn: an unfinished one is cancelled (nothing stored, and a session made for
        it deleted)."""
        self.rest.close()


def _chain(first: str | Reply, rest: Iterator[str | Reply]) -> Iterator[str | Reply]:
    yield first
    yield from rest


def start_turn(manager: SessionManager, tenant: Tenant, decided: Decided, cancel: CancelToken) -> StartedTurn:
    """Run the planned turn up to its first item (`SessionManager.run_turn`).

    Raises:
        ChatKVError: the turn was refused (nothing stored), or `TurnCancelled` by `cancel`.
    """
    turn = manager.run_turn(tenant, decided.plan, decided.posted.message, decided.options, cancel=cancel)
    first = turn.start()
    if turn.session_id is None:
        raise RuntimeError("bug: a started turn has no session")
    return StartedTurn(turn.session_id, first, turn)


@dataclass(frozen=True)
class TurnAnswer:
    """How one turn-creating route answers; `answer_turn` does the rest, alike for every route.

    Attributes:
        replayed: the answer recorded under the request's `Idempotency-Key` (a retry's).
        headers: the headers of a started turn's answer.
        completed: the JSON answer of a completed turn, recorded under the key as it is made.
        frames: a started turn's event stream, which records its answer before the closing
            frames; `None`: the answer comes whole.
        ended: runs once the turn has ended, however it ended.
    """

    replayed: Callable[[Replay], Response]
    headers: Callable[[StartedTurn], dict[str, str]]
    completed: Callable[[StartedTurn, Reply], Any]
    frames: Callable[[StartedTurn], Iterator[str]] | None = None
    ended: Callable[[], None] = lambda: None


def answer_turn(
    manager: SessionManager,
    tenant: Tenant,
    decided: Decided,
    cancel: CancelToken,
    guard: IdempotencyGuard,
    answer: TurnAnswer,
) -> Response:
    """A turn-creating route's turn, one way for all: a retry's recorded answer (`guard.replay`),
    else the turn run to its first item (refusals are HTTP statuses), then streamed or run to its
    end. However the turn ends short of its recorded answer (refused, failed, cancelled, its
    client gone, a stream never started), the key's claim is released (a retry runs afresh) and
    the turn closed (nothing stored)."""
    if guard.replay is not None:
        return answer.replayed(guard.replay)
    try:
        turn = start_turn(manager, tenant, decided, cancel)
    except BaseException:  # whatever ends the turn (a cancel included) frees its key, then goes on up
        _end(guard, None, answer.ended)
        raise
    if answer.frames is not None:
        frames = _guarded(answer.frames(turn), guard, turn, answer.ended)
        return EventStream(frames, headers=answer.headers(turn), unstarted=lambda: _end(guard, turn, answer.ended))
    try:
        body = answer.completed(turn, turn.run())
    finally:
        _end(guard, turn, answer.ended)
    return JSONResponse(body, headers=answer.headers(turn))


def _guarded(
    frames: Iterator[str], guard: IdempotencyGuard, turn: StartedTurn, ended: Callable[[], None]
) -> Generator[str, None, None]:
    """`frames`, an error after the answer started as its last frame; closing it (the client went
    away) closes the turn: it is cancelled and nothing is stored."""
    try:
        yield from frames
    except (ChatKVError, *DATABASE_ERRORS) as exc:  # the session deleted meanwhile, the database gone
        yield f"data: {bytes(response_for(exc).body).decode()}\n\n"
    finally:
        _end(guard, turn, ended)


def _end(guard: IdempotencyGuard, turn: StartedTurn | None, ended: Callable[[], None]) -> None:
    try:
        ended()
        guard.release()
    finally:
        if turn is not None:
            turn.close()


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
