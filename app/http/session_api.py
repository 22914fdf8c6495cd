"""chatkv's own session routes under `/v1/sessions`, for clients that keep a session id:

    POST   /v1/sessions                      create (system prompt, title)                  201
    GET    /v1/sessions                      the tenant's sessions, most recently active first
    GET    /v1/sessions/{id}                 one session with its messages
    DELETE /v1/sessions/{id}
    POST   /v1/sessions/{id}/messages        a turn: the reply with usage and stats, or SSE events
    POST   /v1/sessions/{id}/prefetch        start restoring the cache to the device now    202
    POST   /v1/sessions/{id}/fork            a fork keeping its first `at_turn` turns       201

A session created with a `name` (or by an `X-Session-ID` the tenant had not used) is reached by
that name on every route.

Same key, limits and error shape as the OpenAI routes (`app.http.api_auth`, `app.http.api_errors`); another
tenant's session id is a 404 exactly like a missing one. Sampling defaults to greedy here
(`temperature` 0), chatkv's default, where the OpenAI route follows OpenAI's (1).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Generator, Iterator
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from app.http.api_auth import bearer_scheme, tenant_of
from app.http.api_turns import (
    IDEMPOTENCY_HEADER,
    REPLAYED_HEADER,
    SESSION_HEADER,
    Decided,
    IdempotencyGuard,
    Posted,
    StartedTurn,
    TurnAnswer,
    Usage,
    answer_turn,
    check_message,
    usage,
)
from app.http.forwarding import Forwarder
from app.http.openai_api import AssistantMessage
from app.http.prefetch import Prefetcher
from app.http.sse import DONE, EventStream, event
from sessions import (
    SESSION_NAME_RULE,
    CancelToken,
    Message,
    Replay,
    Reply,
    RestoreSource,
    Services,
    SessionInfo,
    SessionManager,
    Tenant,
    TurnOptions,
    TurnTarget,
)

log = logging.getLogger(__name__)

TenantDep = Annotated[Tenant, Depends(tenant_of)]


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    system_prompt: str | None = Field(default=None, description="The session's system prompt (fixed for its life).")
    title: str | None = Field(default=None, description="A label, up to 200 characters.")
    name: str | None = Field(
        default=None,
        description=f"An id of your choosing, unique in your tenant ({SESSION_NAME_RULE}); every route and "
        "`X-Session-ID` then take it in place of the session's id.",
    )


class ForkCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    at_turn: int = Field(
        description="How many of the session's turns the fork keeps (0: only its system prompt). Regenerating "
        "reply i is a fork at i followed by user message i again; editing user message i, a fork at i followed "
        "by the new text."
    )


class SessionOut(BaseModel):
    id: str
    object: Literal["session"] = "session"
    title: str | None
    system_prompt: str | None
    created_at: int = Field(description="Unix seconds.")
    last_active_at: int = Field(description="Unix seconds.")
    message_count: int
    token_count: int = Field(description="Tokens of the conversation so far (demoted turns included).")
    tier: str | None = Field(description="Where the cache is: `device`, `host`, `disk`, or null (rebuilt).")
    name: str | None = Field(default=None, description="The id the client chose for the session, if any.")
    origin: Literal["explicit", "implicit", "named", "fork"] = Field(
        default="explicit",
        description="How it was made: `implicit` sessions (for a posted history) and forks nobody continued "
        "expire when idle (CHATKV_IMPLICIT_RETENTION_S).",
    )
    parent_id: str | None = Field(default=None, description="The session it was forked from, for a fork.")
    fork_turns: int | None = Field(default=None, description="How many of the parent's turns the fork kept.")


class SessionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionOut]


class MessageOut(BaseModel):
    index: int
    role: Literal["system", "user", "assistant"]
    content: str = Field(description="The stored text: a reply cut by a stop string is stored as it was returned, cut.")
    tokens: int = Field(
        description="Token ids stored with it (a user message's include the template's framing; a reply's "
        "are the generated ids)."
    )
    created_at: int = Field(description="Unix seconds.")


class SessionWithMessages(SessionOut):
    messages: list[MessageOut]


class SessionDeleted(BaseModel):
    id: str
    object: Literal["session.deleted"] = "session.deleted"
    deleted: bool = True


class MessageCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    content: str = Field(description="The user message.")
    max_tokens: int = Field(default=256, description="Most tokens to generate.")
    temperature: float = Field(default=0.0, description="0 is greedy (the default).")
    top_p: float = Field(default=1.0, description="Nucleus sampling mass in (0, 1].")
    seed: int | None = Field(default=None, description="Makes sampling at temperature > 0 reproducible.")
    stop: str | list[str] | None = Field(
        default=None, description="Up to 4 strings; the reply ends before the first one it produces."
    )
    min_tokens: int = Field(
        default=0, description="No end-of-turn token or stop string ends the reply before it has this many tokens."
    )
    ignore_eos: bool = Field(
        default=False, description="The end-of-turn token is never sampled: the reply runs to `max_tokens`."
    )
    stream: bool = Field(
        default=False,
        description="Answer with server-sent events: `session.message.delta` events, then the "
        "`session.message`, then `data: [DONE]`.",
    )


class TurnStatsOut(BaseModel):
    """What the turn cost (`sessions.records.TurnStats`)."""

    prefill_tokens: int = Field(description="Tokens run through the model before the first new token.")
    reused_tokens: int = Field(description="Tokens served from the session's cache and the shared base.")
    ttft_s: float
    decode_tokens: int
    decode_s: float
    restored_from: RestoreSource
    restore_s: float
    base_reused_tokens: int
    demoted_tokens: int
    cache_tokens: int
    queue_s: float


class MessageReply(BaseModel):
    session_id: str
    object: Literal["session.message"] = "session.message"
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    usage: Usage
    stats: TurnStatsOut


class PrefetchStarted(BaseModel):
    id: str
    object: Literal["session.prefetch"] = "session.prefetch"
    status: Literal["started"] = "started"


def session_router(
    services: Services, route_class: type[APIRoute], prefetcher: Prefetcher, forwarder: Forwarder
) -> APIRouter:
    """The `/sessions` routes, to be mounted under `/v1`. A turn, fork or prefetch of a session
    another replica owns goes to that replica through `forwarder` (`app.http.forwarding`)."""
    # Over 60 lines: the routes are closures over `manager`, one short function each.
    manager = services.manager
    router = APIRouter(route_class=route_class, dependencies=[Depends(bearer_scheme)], tags=["Sessions"])

    @router.post("/sessions", status_code=status.HTTP_201_CREATED, response_model=SessionOut)
    def create_session(body: SessionCreate, tenant: TenantDep) -> SessionOut:
        """Create a session."""
        session_id = manager.open_session(tenant, system_prompt=body.system_prompt, title=body.title, name=body.name)
        return _session(manager.session_info(tenant, session_id))

    def owner_answer(request: Request, raw: bytes, tenant: Tenant, session_id: str) -> Awaitable[Response | None]:
        """The answer of the replica owning the session, if the request is forwarded there."""
        return forwarder.answer(request, raw, lambda hop: manager.route_turn(tenant, session_id, forwarded=hop))

    @router.post("/sessions/{session_id}/fork", status_code=status.HTTP_201_CREATED, response_model=SessionOut)
    async def fork_session(request: Request, session_id: str, body: ForkCreate, tenant: TenantDep) -> Any:
        """A new session holding the session's first `at_turn` turns, its cache warm from the
        session's KV (from whichever tier holds it); the session itself is untouched."""
        forwarded = await owner_answer(request, await request.body(), tenant, session_id)
        if forwarded is not None:  # made on the owner, from the KV where it is
            return forwarded

        def fork() -> SessionOut:
            return _session(manager.session_info(tenant, manager.fork(tenant, session_id, body.at_turn)))

        return await run_in_threadpool(fork)

    @router.get("/sessions", response_model=SessionList)
    def list_sessions(tenant: TenantDep) -> SessionList:
        """The tenant's sessions, most recently active first."""
        return SessionList(data=[_session(info) for info in manager.list_sessions(tenant)])

    @router.get("/sessions/{session_id}", response_model=SessionWithMessages)
    def get_session(session_id: str, tenant: TenantDep) -> SessionWithMessages:
        """A session and its messages."""
        info = manager.session_info(tenant, session_id)
        messages = [_message(m) for m in manager.history(tenant, session_id)]
        return SessionWithMessages(**_session(info).model_dump(), messages=messages)

    @router.delete("/sessions/{session_id}", response_model=SessionDeleted)
    def delete_session(session_id: str, tenant: TenantDep) -> SessionDeleted:
        """Delete a session: its cache in every tier, then its transcript. A turn in flight on it fails."""
        manager.delete_session(tenant, session_id)
        return SessionDeleted(id=session_id)

    @router.post(
        "/sessions/{session_id}/messages",
        response_model=MessageReply,
        response_class=JSONResponse,
        responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}},
    )
    async def send_message(
        request: Request,
        session_id: str,
        body: MessageCreate,
        tenant: TenantDep,
        idempotency_key: Annotated[
            str | None,
            Header(
                alias=IDEMPOTENCY_HEADER,
                description="Run the turn once: a retry with the same key and body gets the recorded answer.",
            ),
        ] = None,
    ) -> Response:
        """Send a user message; the reply with its usage and stats (or SSE events with `stream`). A
        client that disconnects before the reply is complete cancels the turn; nothing is stored."""
        return await forwarder.run_turn(
            request,
            lambda hop: _decide(manager, session_id, body, tenant, forwarded=hop),
            lambda raw, cancel, decided: _send(
                services, session_id, body, raw, tenant, idempotency_key, cancel, decided
            ),
        )

    @router.post(
        "/sessions/{session_id}/prefetch", status_code=status.HTTP_202_ACCEPTED, response_model=PrefetchStarted
    )
    async def prefetch(request: Request, session_id: str, tenant: TenantDep) -> Any:
        """Start restoring the session's cache to the device, ahead of its next message (on the
        replica that owns it: that is where the next message will run)."""
        forwarded = await owner_answer(request, await request.body(), tenant, session_id)
        if forwarded is not None:
            return forwarded

        def start() -> PrefetchStarted:
            info = manager.session_info(tenant, session_id)
            prefetcher.start(tenant, info.id)
            return PrefetchStarted(id=info.id)

        return await run_in_threadpool(start)

    return router


def _decide(
    manager: SessionManager, session_id: str, body: MessageCreate, tenant: Tenant, *, forwarded: bool
) -> Decided:
    """Check the request and plan its turn on the session (`SessionManager.plan_turn`)."""
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    options = TurnOptions(
        body.max_tokens,
        body.temperature,
        body.top_p,
        body.seed,
        stop,
        min_new_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
    )
    posted = Posted(None, [], check_message(body.content, "content"))
    return Decided(manager.plan_turn(tenant, TurnTarget(session=session_id), forwarded=forwarded), posted, options)


def _send(
    services: Services,
    session_id: str,
    body: MessageCreate,
    raw: bytes,
    tenant: Tenant,
    idempotency_key: str | None,
    cancel: CancelToken,
    decided: Decided,
) -> Response:
    """The blocking part of `POST /sessions/{id}/messages` (run in the threadpool)."""
    guard = IdempotencyGuard(services.idempotency, tenant, idempotency_key, f"/v1/sessions/{session_id}/messages", raw)

    def replayed(replay: Replay) -> Response:
        recorded = MessageReply.model_validate_json(replay.response)
        headers = {SESSION_HEADER: recorded.session_id, REPLAYED_HEADER: "true"}
        if body.stream:
            return EventStream(_replayed_events(recorded), headers=headers)
        return JSONResponse(recorded.model_dump(), headers=headers)

    def completed(turn: StartedTurn, reply: Reply) -> dict[str, Any]:
        answer = _reply(turn.session_id, reply)
        guard.complete(turn.session_id, answer)
        return answer.model_dump()

    def events(turn: StartedTurn) -> Iterator[str]:
        for piece in turn.pieces():
            yield event({"object": "session.message.delta", "session_id": turn.session_id, "content": piece})
        if turn.reply is None:
            raise RuntimeError("bug: a streamed turn ended without a reply")
        yield event(completed(turn, turn.reply))
        yield DONE

    def headers(turn: StartedTurn) -> dict[str, str]:
        return {SESSION_HEADER: turn.session_id}

    answer = TurnAnswer(replayed, headers, completed, events if body.stream else None)
    return answer_turn(services.manager, tenant, decided, cancel, guard, answer)


def _replayed_events(recorded: MessageReply) -> Generator[str, None, None]:
    """A recorded reply as a stream: its whole content in one delta, the message, `[DONE]`."""
    if recorded.message.content:
        content = recorded.message.content
        yield event({"object": "session.message.delta", "session_id": recorded.session_id, "content": content})
    yield event(recorded.model_dump())
    yield DONE


def _reply(session_id: str, reply: Reply) -> MessageReply:
    return MessageReply(
        session_id=session_id,
        message=AssistantMessage(content=reply.text),
        finish_reason=reply.finish_reason,
        usage=usage(reply),
        stats=TurnStatsOut(**dataclasses.asdict(reply.stats)),
    )


def _unix(when: datetime) -> int:
    return int(when.timestamp())


def _session(info: SessionInfo) -> SessionOut:
    return SessionOut(
        id=info.id,
        title=info.title,
        system_prompt=info.system_prompt,
        created_at=_unix(info.created_at),
        last_active_at=_unix(info.last_active_at),
        message_count=info.message_count,
        token_count=info.token_count,
        tier=info.tier,
        name=info.name,
        origin=info.origin,  # type: ignore[arg-type]  # one of the four the registry writes
        parent_id=info.parent_id,
        fork_turns=info.fork_turns,
    )


def _message(message: Message) -> MessageOut:
    return MessageOut(
        index=message.index,
        role=message.role,
        content=message.text,
        tokens=len(message.token_ids),
        created_at=_unix(message.created_at),
    )
