"""OpenAI's Responses API on chatkv's sessions: `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{id}`, `GET /v1/responses/{id}/input_items`, `POST /v1/responses/{id}/cancel`.

A response is a point in a session (`sessions.responses`): its id resolves to a session and the
turn it ended.

    no previous_response_id   a new session (instructions as its system prompt, earlier turns from
                              the input items) runs the turn
    previous = the latest     the turn continues that session from its cache (sending only the new
      response of a session   input: the whole point of the pattern)
    previous = an older one   a fork of the session after that response's turn runs it: a branch,
                              warm from the parent's KV; the parent and its responses are untouched
    instructions differ       a new session holding the earlier turns under the new system prompt
      from the session's      (prefilled; omitted instructions keep the session's)

`store: false` runs the turn on a session made for it (a new one, or a fork) and deletes that
session, its cache in every tier included, before the last event, and checkpoints SQLite's
write-ahead log so its bytes leave the database files: nothing is kept once the reply is sent (no
response record; an `Idempotency-Key` is not recorded either; no `X-Session-ID`). A stored
response's answer names its session in `X-Session-ID`, and is its `Idempotency-Key`'s answer from
the transaction that stores it, before a streamed response's closing events. Deleting a response
is defined in `sessions.responses`: later responses keep their context.

A streamed response in flight can be cancelled (`POST /v1/responses/{id}/cancel`, on the replica
that runs it): its turn stops at the next step and stores nothing; the stream ends with an `error`
event `response_cancelled`. Everything else is shared with `/v1/chat/completions`: the tenant's key,
request slots, `Idempotency-Key`, cancellation when the client goes away, forwarding a turn to the
replica owning its session, errors in OpenAI's shape (`app.http.api_errors`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from app.http.api_auth import bearer_scheme, tenant_of
from app.http.api_errors import DATABASE_ERRORS, ApiError, response_for, unsupported
from app.http.api_turns import (
    IDEMPOTENCY_HEADER,
    REPLAYED_HEADER,
    SESSION_HEADER,
    Decided,
    IdempotencyGuard,
    StartedTurn,
    TurnAnswer,
    answer_turn,
)
from app.http.forwarding import Forwarder
from app.http.openai_api import check_model
from app.http.responses_items import (
    ResponseRequest,
    as_input_items,
    check_metadata,
    dumps,
    input_as_items,
    input_items,
    item_id,
    items_page,
    output_message,
    parse_input,
    refuse_unsupported,
    response_head,
    response_object,
    stored_items,
    turn_options,
)
from app.http.responses_stream import EventFrames, error_event, replayed_events, response_events
from app.http.sse import EventStream
from sessions import (
    CancelToken,
    ChatKVError,
    InvalidInput,
    Replay,
    Reply,
    Services,
    Tenant,
    TurnCancelled,
    TurnTarget,
)


@dataclass(frozen=True)
class _Answer:
    """What a response's answer needs beside its turn."""

    head: dict[str, Any]
    message_id: str
    items: list[dict[str, Any]]
    store: bool
    conversation_id: str | None
    previous_response_id: str | None


class InFlight:
    """Streamed responses in flight (their cancel tokens and heads), by tenant and response id.
    Thread-safe."""

    def __init__(self) -> None:
        self._runs: dict[tuple[str, str], tuple[CancelToken, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def add(self, tenant: Tenant, head: dict[str, Any], cancel: CancelToken) -> None:
        with self._lock:
            self._runs[(tenant.id, head["id"])] = (cancel, head)

    def discard(self, tenant: Tenant, response_id: str) -> None:
        with self._lock:
            self._runs.pop((tenant.id, response_id), None)

    def cancel(self, tenant: Tenant, response_id: str) -> dict[str, Any] | None:
        """Cancel the tenant's response in flight; its head, or `None` if none is in flight."""
        with self._lock:
            run = self._runs.get((tenant.id, response_id))
        if run is None:
            return None
        run[0].cancel()
        return run[1]


def responses_router(services: Services, route_class: type[APIRoute], forwarder: Forwarder) -> APIRouter:
    """The `/responses` routes, to be mounted under `/v1` (see the module docstring)."""
    router = APIRouter(route_class=route_class, dependencies=[Depends(bearer_scheme)], tags=["Responses"])
    in_flight = InFlight()

    @router.post(
        "/responses",
        responses={
            200: {
                "description": "A `response`, or with `stream: true` the Responses event stream.",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            },
            400: {"description": "Invalid or unsupported request (`invalid_request_error`)."},
            404: {"description": "Unknown model or `previous_response_id`."},
            409: {"description": "The session has a turn in flight, or the `Idempotency-Key`'s first request runs."},
            413: {"description": "Body over the limit, or the conversation does not fit the context."},
            429: {"description": "Too many requests in flight for this tenant; see `Retry-After`."},
        },
    )
    async def create_response(
        request: Request,
        body: ResponseRequest,
        tenant: Annotated[Tenant, Depends(tenant_of)],
        idempotency_key: Annotated[
            str | None, Header(alias=IDEMPOTENCY_HEADER, description="Run the request once (as for chat completions).")
        ] = None,
    ) -> Response:
        """Create a response, continuing or branching a chain with `previous_response_id`. A client
        that disconnects before the answer is complete cancels the turn; nothing is stored."""
        return await forwarder.run_turn(
            request,
            lambda hop: _decide(services, body, tenant, forwarded=hop),
            lambda raw, cancel, decided: _create(
                services, body, raw, tenant, idempotency_key, cancel, in_flight, decided
            ),
        )

    @router.get("/responses/{response_id}", responses={404: {"description": "No such stored response."}})
    def retrieve_response(response_id: str, tenant: Annotated[Tenant, Depends(tenant_of)]) -> JSONResponse:
        """A stored response as it was answered."""
        return JSONResponse(json.loads(services.responses.stored(tenant.id, response_id).response))

    @router.delete("/responses/{response_id}", responses={404: {"description": "No such stored response."}})
    def delete_response(response_id: str, tenant: Annotated[Tenant, Depends(tenant_of)]) -> JSONResponse:
        """Delete a stored response; later responses keep their context (`sessions.responses`)."""
        services.responses.delete(tenant.id, response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @router.get("/responses/{response_id}/input_items", responses={404: {"description": "No such stored response."}})
    def list_input_items(
        response_id: str,
        tenant: Annotated[Tenant, Depends(tenant_of)],
        after: Annotated[str | None, Query(description="List the items after this item id.")] = None,
        limit: Annotated[int, Query(description="Items per page, 1-100.")] = 20,
        order: Annotated[str, Query(description="`desc` (newest first, the default) or `asc`.")] = "desc",
    ) -> JSONResponse:
        """The input items the response was created with (not those of earlier responses)."""
        stored = services.responses.stored(tenant.id, response_id)
        return JSONResponse(items_page(json.loads(stored.input_items), after, limit, order))

    @router.post("/responses/{response_id}/cancel", responses={404: {"description": "No such response."}})
    def cancel_response(response_id: str, tenant: Annotated[Tenant, Depends(tenant_of)]) -> JSONResponse:
        """Cancel a streamed response in flight on this replica: its turn stores nothing."""
        head = in_flight.cancel(tenant, response_id)
        if head is not None:
            return JSONResponse(response_object(head, status="cancelled"))
        services.responses.point(tenant.id, response_id)  # 404 unless it is stored
        raise ApiError(
            400, "only a response streaming in flight can be cancelled; this one has completed", "invalid_request"
        )

    return router


def _decide(services: Services, body: ResponseRequest, tenant: Tenant, *, forwarded: bool) -> Decided:
    """Check and read the request (refused here, before a forward or anything stored) and plan its
    turn (`sessions.turn_door`): after the previous response, in the conversation, or a new
    session holding the input's earlier turns."""
    check_model(services.manager, body.model)
    refuse_unsupported(body)
    check_metadata(body.metadata)
    options = turn_options(body)
    store = body.store is not False
    conversation_id = body.conversation_id()
    if conversation_id is not None and body.previous_response_id is not None:
        raise ApiError(
            400, "conversation and previous_response_id cannot both be given", "invalid_request", param="conversation"
        )
    if conversation_id is not None and not store:
        raise unsupported("`store: false` with a conversation is", "store")
    if conversation_id is not None:
        record = services.conversations.get(tenant.id, conversation_id)
        services.conversations.check_room(record, [*stored_items(input_as_items(body)), output_message(item_id(), "")])
        posted = parse_input(body, as_input_items(services.conversations.items(tenant.id, conversation_id)))
    else:
        posted = parse_input(body)
    if body.previous_response_id is not None and (
        posted.history or posted.system_prompt not in (None, body.instructions)
    ):
        raise InvalidInput(
            "with previous_response_id, input holds only the new user message (a string or one user item)"
        )
    system_prompt = body.instructions if body.previous_response_id is not None else posted.system_prompt
    target = TurnTarget(
        system_prompt,
        posted.history,
        previous_response=body.previous_response_id,
        conversation=conversation_id,
        store=store,
    )
    return Decided(services.manager.plan_turn(tenant, target, forwarded=forwarded), posted, options)


def _create(
    services: Services,
    body: ResponseRequest,
    raw: bytes,
    tenant: Tenant,
    idempotency_key: str | None,
    cancel: CancelToken,
    in_flight: InFlight,
    decided: Decided,
) -> Response:
    """The blocking part of `POST /responses` (run in the threadpool): claim the idempotency key,
    start the turn; stream it, or run it to its end and store it."""
    store = decided.plan.target.store
    # `store: false` keeps nothing, not even the answer under an idempotency key.
    guard = IdempotencyGuard(services.idempotency, tenant, idempotency_key if store else None, "/v1/responses", raw)
    head = response_head(services.responses.new_id(), services.manager.model_name, body, body.metadata or {})
    conversation_id = body.conversation_id()
    items = stored_items(input_as_items(body)) if conversation_id is not None else input_items(decided.posted)
    run = _Answer(head, item_id(), items, store, conversation_id, body.previous_response_id)

    def replayed(replay: Replay) -> Response:
        recorded = json.loads(replay.response)
        headers = {REPLAYED_HEADER: "true", SESSION_HEADER: replay.session_id or ""}
        if body.stream:
            return EventStream(replayed_events(recorded), headers=headers)
        return JSONResponse(recorded, headers=headers)

    def headers(turn: StartedTurn) -> dict[str, str]:
        return {SESSION_HEADER: turn.session_id} if store else {}  # `store: false` keeps no session

    def completed(turn: StartedTurn, reply: Reply) -> dict[str, Any]:
        return _finish(services, tenant, run, turn, reply, guard)

    def events(turn: StartedTurn) -> Iterator[str]:
        return _events(run, turn, lambda: completed(turn, _reply_of(turn)))

    if body.stream and guard.replay is None:  # cancellable until the turn ends (`ended`)
        in_flight.add(tenant, head, cancel)
    answer = TurnAnswer(
        replayed, headers, completed, events if body.stream else None, lambda: in_flight.discard(tenant, head["id"])
    )
    return answer_turn(services.manager, tenant, decided, cancel, guard, answer)


def _finish(
    services: Services, tenant: Tenant, run: _Answer, turn: StartedTurn, reply: Reply, guard: IdempotencyGuard
) -> dict[str, Any]:
    """The final response object of a completed turn, stored with its `Idempotency-Key`'s answer
    in one transaction (or, with `store: false`, its session deleted and erased)."""
    final = response_object(
        run.head, status="completed", output=[output_message(run.message_id, reply.text)], reply=reply
    )
    if run.store:
        services.responses.record(
            tenant.id,
            run.head["id"],
            session_id=turn.session_id,
            turn_index=turn.turn_index,
            previous_response_id=run.previous_response_id,
            response=dumps(final),
            input_items=dumps(run.items),
            answers=guard.claim,
            conversation_id=run.conversation_id,
        )
        guard.answered()
    else:
        services.manager.delete_session(tenant, turn.session_id, erase=True)
    if run.conversation_id is not None:
        added = [*run.items, final["output"][0]]
        services.conversations.append(tenant.id, run.conversation_id, added, session_id=turn.session_id, capped=False)
    return final


def _reply_of(turn: StartedTurn) -> Reply:
    # The response and its key's answer are stored before the closing events: a client gone
    # while they are sent retries into a replay, never a second turn.
    if turn.reply is None:
        raise RuntimeError("bug: a streamed turn ended without a reply")
    return turn.reply


def _events(run: _Answer, turn: StartedTurn, finish: Callable[[], dict[str, Any]]) -> Generator[str, None, None]:
    """The event stream of a response; an error after it started (cancelled, say) is its last event."""
    frames = EventFrames()
    started = response_object(run.head, status="in_progress")
    try:
        yield from response_events(frames, started, run.message_id, turn.pieces(), finish)
    except (ChatKVError, *DATABASE_ERRORS) as exc:
        if isinstance(exc, TurnCancelled):
            yield error_event(frames, "response_cancelled", "the response was cancelled")
        else:
            error = json.loads(bytes(response_for(exc).body))["error"]
            yield error_event(frames, error["code"], error["message"])
