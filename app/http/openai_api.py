"""The OpenAI-compatible face: `POST /v1/chat/completions` and `GET /v1/models`.

Stock OpenAI clients work unchanged (`base_url=<server>/v1`, `api_key=<tenant API key>`). A
request continues a server-side session, found one of two ways (`sessions.turn_door`):

- **explicit**: `X-Session-ID: <id>` (or a `session_id` field): `messages` holds only the new user
  message, after an optional system message that must be the session's;
- **implicit**: the stateless pattern, the whole conversation each time: the tenant's session whose
  history is the posted one minus its last user message is continued from its cache; none (or an
  edited history) starts a new session that holds the posted history.

Either way the answer carries the session's id in an `X-Session-ID` header. Replies are
`chat.completion` objects, or with `stream: true` server-sent `chat.completion.chunk` events: the
role first, then content deltas, then the finish reason, then (with `stream_options.include_usage`)
the usage, then `data: [DONE]`. `usage.prompt_tokens_details.cached_tokens` counts the prompt tokens
chatkv served from its cache instead of prefilling them.

Every field of OpenAI's request is known (`app.http.chat_request`, docs/openai.md): honoured,
accepted without effect on the reply (`user`, `metadata`, ...), or refused with 400
`unsupported_parameter` unless neutral (`n` other than 1, tools and functions and tool messages,
content parts other than text, logprobs, a `response_format` other than text, penalties,
`logit_bias`, ...). A field chatkv does not know is refused with 400
`unrecognized_request_argument` naming it, never ignored. vLLM's extensions `min_tokens` and
`ignore_eos` are honoured (`TurnOptions`), chatkv's `session_id` names the session. Defaults
follow OpenAI: `temperature` 1, `top_p` 1; `max_tokens` defaults to 256.

Limits: at most 2,048 `messages` (OpenAI's; 400 `array_above_max_length`), and a posted history of
at most 8 times the model's context in tokens (413 `context_length_exceeded`, counted before any
of it is stored or rendered; `SessionManager.open_session`). A client that disconnects before its
answer is complete cancels the turn, streamed or not; with an `Idempotency-Key` header a retry of
a completed request gets its recorded answer (`app.http.api_turns`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Generator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field

from app.http.api_auth import bearer_scheme, tenant_of
from app.http.api_errors import ApiError, unsupported
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
from app.http.chat_request import (
    ChatCompletionRequest,
    ChatMessage,
    refuse_unsupported,
    turn_options,
)
from app.http.forwarding import Forwarder
from app.http.sse import DONE, EventStream, event
from sessions import (
    MAX_MESSAGE_CHARS,
    CancelToken,
    InvalidInput,
    Replay,
    Reply,
    Services,
    SessionManager,
    Tenant,
    TurnTarget,
    check_text,
)

MAX_MESSAGES = 2048
"""Messages one request may post (OpenAI's limit): the history and the new message."""


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"] = Field(
        description="`length` when the reply reached `max_tokens`, else `stop` (end of turn or a stop string)."
    )
    logprobs: None = None


class ChatCompletion(BaseModel):
    """A reply; the session it belongs to is in the `X-Session-ID` header."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class ModelCard(BaseModel):
    id: str = Field(description="The model's name; use it as `model`.")
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "chatkv"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def openai_router(services: Services, route_class: type[APIRoute], forwarder: Forwarder) -> APIRouter:
    """`/models` and `/chat/completions`, to be mounted under `/v1`; turns of sessions other
    replicas own go to them through `forwarder`."""
    # Over 60 lines: the routes are closures over `manager`, one short function each.
    manager = services.manager
    router = APIRouter(route_class=route_class, dependencies=[Depends(bearer_scheme)], tags=["OpenAI-compatible"])
    started = int(time.time())

    def card() -> ModelCard:
        return ModelCard(id=manager.model_name, created=started)

    @router.get("/models", response_model=ModelList)
    def list_models() -> ModelList:
        """The served model (one)."""
        return ModelList(data=[card()])

    @router.get(
        "/models/{model}", response_model=ModelCard, responses={404: {"description": "Not this server's model."}}
    )
    def get_model(model: str) -> ModelCard:
        """The served model, if `model` is its id."""
        check_model(manager, model)
        return card()

    @router.post(
        "/chat/completions",
        response_model=ChatCompletion,
        response_class=JSONResponse,
        responses={
            200: {
                "description": "A `chat.completion`, or with `stream: true` server-sent `chat.completion.chunk` "
                "events ending with `data: [DONE]`. The `X-Session-ID` header names the session.",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            },
            400: {"description": "Invalid or unsupported request (`invalid_request_error`)."},
            401: {"description": "Missing or wrong API key."},
            404: {"description": "Unknown model or session."},
            409: {"description": "The session has a turn in flight, or the `Idempotency-Key`'s first request runs."},
            413: {"description": "Body over the limit, or the conversation does not fit the context."},
            429: {"description": "Too many requests in flight for this tenant; see `Retry-After`."},
        },
    )
    async def chat_completions(
        request: Request,
        body: ChatCompletionRequest,
        tenant: Annotated[Tenant, Depends(tenant_of)],
        x_session_id: Annotated[
            str | None, Header(alias=SESSION_HEADER, description="Continue this session (explicit mode).")
        ] = None,
        idempotency_key: Annotated[
            str | None,
            Header(
                alias=IDEMPOTENCY_HEADER,
                description="Run the turn once: a retry with the same key and body gets the recorded answer "
                f"(`{REPLAYED_HEADER}: true`) for 24 h.",
            ),
        ] = None,
    ) -> Response:
        """Create a chat completion, continuing a server-side session (explicit or found by history).
        A client that disconnects before the answer is complete cancels the turn; nothing is stored."""
        return await forwarder.run_turn(
            request,
            lambda hop: _decide(manager, body, tenant, x_session_id, forwarded=hop),
            lambda raw, cancel, decided: _complete(
                services, body, raw, tenant, x_session_id, idempotency_key, cancel, decided
            ),
        )

    return router


def _decide(
    manager: SessionManager, body: ChatCompletionRequest, tenant: Tenant, x_session_id: str | None, *, forwarded: bool
) -> Decided:
    """Check and read the request (refused here, before a forward) and plan its turn: on its named
    session, or on the session its posted history continues or forks (`sessions.turn_door`)."""
    check_model(manager, body.model)
    refuse_unsupported(body)
    options = turn_options(body)
    posted = parse_messages(body.messages)
    session = _session_id(x_session_id, body.session_id)
    target = TurnTarget(posted.system_prompt, posted.history, session=session, create=True)
    return Decided(manager.plan_turn(tenant, target, forwarded=forwarded), posted, options)


def _complete(
    services: Services,
    body: ChatCompletionRequest,
    raw: bytes,
    tenant: Tenant,
    x_session_id: str | None,
    idempotency_key: str | None,
    cancel: CancelToken,
    decided: Decided,
) -> Response:
    """The blocking part of `POST /chat/completions` (run in the threadpool): claim the
    idempotency key, run the turn to its first piece (streamed) or to its end."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    guard = IdempotencyGuard(
        services.idempotency, tenant, idempotency_key, "/v1/chat/completions", raw, {SESSION_HEADER: x_session_id}
    )
    reply_id = f"chatcmpl-{secrets.token_hex(12)}"
    # A client that named the session gets its own name back.
    session = decided.plan.target.session
    head = {"id": reply_id, "created": int(time.time()), "model": services.manager.model_name}

    def replayed(replay: Replay) -> Response:
        completion = ChatCompletion.model_validate_json(replay.response)
        headers = {SESSION_HEADER: replay.session_id or "", REPLAYED_HEADER: "true"}
        if body.stream:
            return EventStream(_replayed_chunks(completion, include_usage), headers=headers)
        return JSONResponse(completion.model_dump(), headers=headers)

    def completed(turn: StartedTurn, reply: Reply) -> dict[str, Any]:
        completion = _completion(reply_id, services.manager.model_name, reply)
        guard.complete(turn.session_id, completion)
        return completion.model_dump()

    return answer_turn(
        services.manager,
        tenant,
        decided,
        cancel,
        guard,
        TurnAnswer(
            replayed,
            lambda turn: {SESSION_HEADER: session if session is not None else turn.session_id},
            completed,
            (lambda turn: _chunks(turn, head, include_usage, guard)) if body.stream else None,
        ),
    )


def check_model(manager: SessionManager, model: str) -> None:
    """Raises `ApiError` 404 `model_not_found` for a model this server does not serve."""
    if model != manager.model_name:
        raise ApiError(
            404,
            f"the model `{model}` does not exist; this server serves `{manager.model_name}`",
            "model_not_found",
            param="model",
        )


def parse_messages(messages: list[ChatMessage], field: str = "messages") -> Posted:
    """Split posted messages into system prompt, earlier turns and the new message. `field`: the
    request's field the errors name (`input` for the Responses face, which posts its items here).

    Raises:
        ApiError: for more than `MAX_MESSAGES` messages, tool messages or non-text content.
        InvalidInput: for any other shape or text chatkv cannot take.
    """
    if len(messages) > MAX_MESSAGES:
        raise ApiError(
            400,
            f"Invalid '{field}': array too long. Expected an array with maximum length {MAX_MESSAGES}, "
            f"but got an array with length {len(messages)} instead.",
            "array_above_max_length",
            param=field,
        )
    texts: list[tuple[str, str]] = []
    for index, message in enumerate(messages):
        where = _where(field, index)
        role = "system" if message.role == "developer" else message.role
        if role in ("tool", "function") or message.tool_calls:
            raise unsupported("tool messages are", f"{where}.role")
        if role not in ("system", "user", "assistant"):
            raise InvalidInput(f"{where}.role must be system, developer, user or assistant, got {message.role!r}")
        text = _text(message, where)
        check_text(text, f"{where}.content", MAX_MESSAGE_CHARS)
        texts.append((role, text))
    system_prompt = texts[0][1] if texts[0][0] == "system" else None
    rest = texts[1:] if system_prompt is not None else texts
    roles = [role for role, _ in rest]
    if len(roles) % 2 == 0 or roles != ["user", "assistant"] * (len(roles) // 2) + ["user"]:
        raise InvalidInput(
            f"{field} must be an optional system message, then alternating user and assistant messages, "
            f"ending with a user message; got roles {[role for role, _ in texts]}"
        )
    history = [(rest[i][1], rest[i + 1][1]) for i in range(0, len(rest) - 1, 2)]
    new_message = check_message(rest[-1][1], f"{_where(field, len(texts) - 1)}.content")
    return Posted(system_prompt, history, new_message)


def _where(field: str, index: int) -> str:
    # Only `messages` is posted as given; Responses' `input` comes after instructions and a
    # conversation's items, so an index here would not be the client's.
    return f"{field}[{index}]" if field == "messages" else f"{field}'s message"


def _text(message: ChatMessage, where: str) -> str:
    content = message.content
    if content is None:
        raise InvalidInput(f"{where}.content is required")
    if isinstance(content, str):
        return content
    parts = []
    for number, part in enumerate(content):
        if part.type != "text":
            raise unsupported(f"content parts of type {part.type!r} are (text only)", f"{where}.content[{number}]")
        if part.text is None:
            raise InvalidInput(f"{where}.content[{number}].text is required")
        parts.append(part.text)
    return "".join(parts)


def _session_id(header: str | None, field: str | None) -> str | None:
    if header is not None and field is not None and header != field:
        raise InvalidInput(f"the {SESSION_HEADER} header and the session_id field name different sessions")
    return header if header is not None else field


def _completion(reply_id: str, model: str, reply: Reply) -> ChatCompletion:
    return ChatCompletion(
        id=reply_id,
        created=int(time.time()),
        model=model,
        choices=[Choice(message=AssistantMessage(content=reply.text), finish_reason=reply.finish_reason)],
        usage=usage(reply),
    )


def _chunk_frames(head: dict[str, Any], include_usage: bool) -> Callable[..., str]:
    head = {**head, "object": "chat.completion.chunk"}
    extra: dict[str, Any] = {"usage": None} if include_usage else {}

    def chunk(delta: dict[str, str], finish_reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return event({**head, "choices": [choice], **extra})

    return chunk


def _chunks(
    turn: StartedTurn, head: dict[str, Any], include_usage: bool, guard: IdempotencyGuard
) -> Generator[str, None, None]:
    """The SSE frames of a streamed completion. A completed turn's answer is recorded under its
    `Idempotency-Key` (as the `chat.completion` a retry is answered with)."""
    chunk = _chunk_frames(head, include_usage)
    yield chunk({"role": "assistant", "content": ""})
    for piece in turn.pieces():
        yield chunk({"content": piece})
    if turn.reply is None:
        raise RuntimeError("bug: a streamed turn ended without a reply")
    guard.complete(turn.session_id, _completion(head["id"], head["model"], turn.reply))
    yield chunk({}, turn.reply.finish_reason)
    if include_usage:
        yield event({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage(turn.reply).model_dump()})
    yield DONE


def _replayed_chunks(completion: ChatCompletion, include_usage: bool) -> Generator[str, None, None]:
    """A recorded completion as a stream: the role, the whole content in one delta, the finish
    reason, the usage if asked, `[DONE]`."""
    head = {"id": completion.id, "created": completion.created, "model": completion.model}
    chunk = _chunk_frames(head, include_usage)
    choice = completion.choices[0]
    yield chunk({"role": "assistant", "content": ""})
    if choice.message.content:
        yield chunk({"content": choice.message.content})
    yield chunk({}, choice.finish_reason)
    if include_usage:
        yield event({**head, "object": "chat.completion.chunk", "choices": [], "usage": completion.usage.model_dump()})
    yield DONE
