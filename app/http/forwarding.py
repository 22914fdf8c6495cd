"""Forwarding a turn to the replica that owns its session, its answer streamed back (docs/replicas.md,
"Routing"). Where a turn runs is decided before it starts, by `SessionManager.plan_turn` (a fork
or prefetch: `route_turn`; `sessions.replicas.routing`); this module carries out a `forward` route:

    client --POST--> this replica --the same body; Authorization, Idempotency-Key, X-Session-ID,
                                    Content-Type, Accept; X-ChatKV-Forwarded-By: <this id>--> owner
    client <--status, headers, the body as it comes (SSE chunk by chunk)-- this replica <-- owner

- The tenant's key is checked here first (the route class) and again by the owner. The hop
  marker authenticates nothing: it only says the request was forwarded once already, so it is
  run where it lands (handing the session over if need be), never forwarded again.
- Nothing is claimed here: an `Idempotency-Key` is claimed, and its answer recorded, by the
  replica that runs the turn.
- A client that goes away cancels the owner's turn: before the owner's answer starts, the request
  to the owner is dropped; afterwards, the owner's response is closed. Either way the owner sees
  its client leave and cancels the turn (nothing stored), as for any client.
- A forward that fails before the owner received the whole request (refused, unreachable, the
  connection lost while sending) is handed over: `forward` returns `None` and the route runs the
  turn here, once the owner releases the session or its lease expires. A forward that fails
  after that (the owner died mid-turn) is not run again, since the owner may have stored the
  turn: 502 `forward_failed`, or an error event in an answer already streaming.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import httpx
from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from app.http.api_errors import error_body, error_response
from app.http.api_turns import Decided, run_watching_disconnect
from app.http.sse import event
from sessions import CancelToken, Route, SessionManager

log = logging.getLogger(__name__)

T = TypeVar("T")

FORWARDED_BY_HEADER = "X-ChatKV-Forwarded-By"
"""The hop marker: the id of the replica that forwarded the request."""
CONNECT_TIMEOUT_S = 2.0
"""A replica that does not accept a connection within this is handed over from."""
FORWARD_FAILED = "forward_failed"

_REQUEST_HEADERS = ("authorization", "content-type", "accept", "idempotency-key", "x-session-id")
_RESPONSE_HEADERS = (
    "content-type",
    "cache-control",
    "x-accel-buffering",
    "x-session-id",
    "idempotent-replayed",
    "retry-after",
    "www-authenticate",
    "x-chatkv-owner-url",
)
_NOT_DELIVERED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.WriteError, httpx.WriteTimeout)
"""Failures before the owner had the whole request: it cannot have run (or stored) the turn."""


class ClientGone(Exception):
    """The client disconnected before the owner's answer started."""


def is_forwarded(request: Request) -> bool:
    """Whether another replica forwarded this request (it carries the hop marker)."""
    return FORWARDED_BY_HEADER in request.headers


class Forwarder:
    """Routes the turns of one server's `manager`, and sends those routed elsewhere over one
    pooled HTTP client (made on first use, on the server's event loop; `aclose` at shutdown)."""

    def __init__(self, manager: SessionManager) -> None:
        self._manager = manager
        self._replica_id = manager.replica_id or "-"
        self._client: httpx.AsyncClient | None = None

    async def answer(self, request: Request, body: bytes, decide: Callable[[bool], Route]) -> Response | None:
        """Route the request: `decide(forwarded)` (blocking: run in the threadpool) is
        `SessionManager.route_turn` for it. Returns the answer of the replica
        it was forwarded to, or `None` to run it here (a local route, a hand-over, or a forward
        that never reached its replica: then a hand-over too).

        Raises:
            ChatKVError, ApiError: what `decide` raises for a request it cannot route (answered
                like the turn's own errors).
        """
        route = await run_in_threadpool(decide, is_forwarded(request))
        if route.kind != "forward":
            return None
        return await self.forward(request, body, route)

    async def run_turn(
        self,
        request: Request,
        decide: Callable[[bool], Decided],
        run: Callable[[bytes, CancelToken, Decided], Response],
    ) -> Response:
        """A turn-creating route's answer: `decide(forwarded)` reads and plans the request once
        (blocking: in the threadpool); the owner's answer when its route forwards it, else
        `run(body, cancel, decided)` here in the threadpool, `cancel` set if the client goes away
        first (`run_watching_disconnect`: the turn stops and stores nothing).

        Raises:
            ChatKVError, ApiError: what `decide` or `run` raises (answered as the route's errors).
        """
        raw = await request.body()
        decided = await run_in_threadpool(decide, is_forwarded(request))
        if decided.route.kind == "forward":
            forwarded = await self.forward(request, raw, decided.route)
            if forwarded is not None:  # the session's owner answered
                return forwarded
        cancel = CancelToken()
        return await run_watching_disconnect(request, cancel, lambda: run(raw, cancel, decided))

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            # No read timeout: a turn may prefill a long history first; its client's own timeout,
            # or its going away, ends the wait (and cancels the owner's turn).
            timeout = httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=None, write=30.0, pool=CONNECT_TIMEOUT_S)
            self._client = httpx.AsyncClient(timeout=timeout, follow_redirects=False)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def forward(self, request: Request, body: bytes, route: Route) -> Response | None:
        """The answer of `route.url` to this request (its `body` already read), streamed as it
        comes; `None` if the request never reached it whole (the caller hands the session over)."""
        if route.url is None:
            raise ValueError(f"not a forward route: {route!r}")
        target = route.url.rstrip("/") + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {name: value for name in _REQUEST_HEADERS if (value := request.headers.get(name)) is not None}
        headers[FORWARDED_BY_HEADER] = self._replica_id
        http = self._http()
        outgoing = http.build_request(request.method, target, content=body, headers=headers)
        try:
            upstream = await until_disconnected(request, http.send(outgoing, stream=True))
        except _NOT_DELIVERED as exc:
            self._manager.forward_failed(route, str(exc) or type(exc).__name__)
            return None
        except httpx.TransportError as exc:  # sent: the owner may have run the turn, so not again here
            log.warning("forward to %s failed after the request was sent: %s", route.url, exc)
            return error_response(
                502, f"the replica owning this session ({route.replica_id}) failed mid-request: {exc}", FORWARD_FAILED
            )
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        return ForwardedResponse(upstream, route)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first: then `work` is cancelled and `ClientGone`
    raised. The request's body must have been read already (what arrives then is the disconnect)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with anyio.CancelScope(shield=True):
        await asyncio.gather(task, return_exceptions=True)
    raise ClientGone


class ForwardedResponse(StreamingResponse):
    """The owner's answer, passed on chunk by chunk. However it ends (complete, the client gone,
    the owner gone), the owner's response is closed, then the `call_on_close` callbacks run
    (releasing the tenant's request slot)."""

    def __init__(self, upstream: httpx.Response, route: Route) -> None:
        headers = {name: value for name in _RESPONSE_HEADERS if (value := upstream.headers.get(name)) is not None}
        super().__init__(self._chunks(upstream, route), status_code=upstream.status_code, headers=headers)
        self._upstream = upstream
        self._on_close: list[Callable[[], None]] = []

    def call_on_close(self, callback: Callable[[], None]) -> None:
        """Run `callback` once the response ended and the owner's response was closed."""
        self._on_close.append(callback)

    @staticmethod
    async def _chunks(upstream: httpx.Response, route: Route) -> AsyncIterator[bytes]:
        streaming = upstream.headers.get("content-type", "").startswith("text/event-stream")
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            log.warning("the forwarded answer of %s broke off: %s", route.url, exc)
            if not streaming:
                raise  # a body cut short: the connection is dropped, the client sees it failed
            message = f"the replica owning this session ({route.replica_id}) failed mid-reply: {exc}"
            yield event(error_body(502, message, FORWARD_FAILED)).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # also when the response itself was cancelled
                await self._upstream.aclose()
                for callback in self._on_close:
                    callback()
