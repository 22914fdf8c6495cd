"""Server-sent events over a sync generator, closed on every end of the response.

A streamed turn is a sync generator (`SessionManager.stream_chat` blocks on the engine loop), run
piece by piece in the threadpool. When the client disconnects, Starlette cancels the response at
its next read or send; the generator must then be *closed* at once, because closing it is what
cancels the turn at the engine loop's next step and stores nothing (`stream_chat`). Starlette
leaves a sync generator to the garbage collector, on the event loop's thread; `EventStream`
closes it itself, in a worker thread, once the response has ended however it ended (no step of
the generator is running then: a step in the threadpool is waited for, not abandoned), and then
runs its `call_on_close` callbacks (releasing the tenant's request slot). A client gone before the
last frame is logged at debug level (its address, the route).

A generator that never ran (the response ended before its first frame was asked for: a client
gone between the turn's start and the first send) does not run its `finally` when closed, so the
stream runs the route's `unstarted` clean-up instead (give up the idempotency claim, close the turn).

    frame = "data: <json>\\n\\n"      one event per frame; a stream ends with "data: [DONE]\\n\\n"
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable, Generator, Mapping
from typing import Any

import anyio
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def event(data: Mapping[str, Any]) -> str:
    """One SSE frame with `data` as compact JSON (non-ASCII text as it is: UTF-8)."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """A `text/event-stream` response over `frames`, a sync generator of SSE frames."""

    media_type = "text/event-stream"

    def __init__(
        self,
        frames: Generator[str, None, None],
        *,
        headers: Mapping[str, str] | None = None,
        unstarted: Callable[[], None] | None = None,
    ) -> None:
        # No caching, and no buffering by a proxy in front (nginx): each event goes out at once.
        super().__init__(frames, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._frames = frames
        self._unstarted = unstarted
        self._on_close: list[Callable[[], None]] = []
        self._sent_all = False

    def call_on_close(self, callback: Callable[[], None]) -> None:
        """Run `callback` (in a worker thread) after the response ended and the frames were closed."""
        self._on_close.append(callback)

    async def stream_response(self, send: Send) -> None:
        await super().stream_response(send)
        self._sent_all = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def receive_watched() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not self._sent_all:
                host, port = scope.get("client") or ("-", 0)
                log.debug("client %s:%s went away before the answer to %s %s ended", host, port, *_route(scope))
            return message

        try:
            await super().__call__(scope, receive_watched, send)
        finally:
            with anyio.CancelScope(shield=True):  # also when the response itself was cancelled
                await run_in_threadpool(self._close)

    def _close(self) -> None:
        try:
            if self._unstarted is not None and inspect.getgeneratorstate(self._frames) == inspect.GEN_CREATED:
                self._unstarted()  # closing it would not run its `finally`
            self._frames.close()
        finally:
            for callback in self._on_close:
                callback()


def _route(scope: Scope) -> tuple[str, str]:
    return str(scope.get("method", "-")), str(scope.get("path", "-"))
