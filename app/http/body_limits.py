"""Request body limits of the server: a pure ASGI middleware that answers 413 instead of letting a
route read a body over the limit of its path.

A body whose `Content-Length` is over the limit is refused at the route's first read, before any
of it is received (uvicorn buffers at most 64 KiB of a body the app has not asked for); a body
without a length (chunked) is counted as it arrives and refused at the first byte over. The check
happens at that first read rather than on arrival so that a route which refuses a request first
still does: the admin API answers a request without its token 401 without reading its body
(`app.http.admin_api`).

The refusal is raised from `receive` as a Starlette `HTTPException`, which FastAPI's body parsing
passes on unchanged, so each app answers it in its own error shape (`{"error": ...}` under
`/admin/`, OpenAI's `{"error": {...}}` under `/v1/`, `{"detail": ...}` from Gradio); the middleware
answers it itself if nobody did.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True)
class BodyLimits:
    """The largest request body, in bytes, per path prefix (the longest matching prefix wins),
    `default_bytes` for paths that match none. 0 refuses any body."""

    default_bytes: int
    prefix_bytes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for where, limit in {"default": self.default_bytes, **self.prefix_bytes}.items():
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(f"body limit of {where} must be a non-negative integer of bytes, got {limit!r}")
        for prefix in self.prefix_bytes:
            if not prefix.startswith("/"):
                raise ValueError(f"a body limit's path prefix must start with '/', got {prefix!r}")

    def for_path(self, path: str) -> int:
        matches = [prefix for prefix in self.prefix_bytes if path.startswith(prefix)]
        return self.prefix_bytes[max(matches, key=len)] if matches else self.default_bytes


DEFAULT_BODY_LIMITS = BodyLimits(
    # The chat page's largest request is a message of up to 1,000,000 characters
    # (`sessions.manager.MAX_MESSAGE_CHARS`), at most 4 bytes each in a browser's UTF-8 JSON.
    default_bytes=8 * MIB,
    prefix_bytes={
        "/admin/": 64 * KIB,  # a tenant name or a master key
        # A stateless client posts the whole conversation: room for one message of the largest size
        # as JSON escapes (6 bytes a character) plus a history that fits a context window.
        "/v1/": 8 * MIB,
        # The page has no file input: Gradio's upload routes store whatever they are sent.
        "/gradio_api/upload": 0,
        "/gradio_api/process_recording": 0,
    },
)


class BodyTooLarge(HTTPException):
    """A request body over its path's limit (status 413)."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(413, f"request body too large: the limit here is {limit_bytes:,} bytes")


class BodyLimitMiddleware:
    """Refuses request bodies over `limits` with 413 (see the module docstring)."""

    def __init__(self, app: ASGIApp, limits: BodyLimits = DEFAULT_BODY_LIMITS) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit_bytes = self.limits.for_path(scope["path"])
        declared_bytes = _content_length(scope)
        received_bytes = 0
        response_started = False

        async def limited_receive() -> Message:
            nonlocal received_bytes
            if declared_bytes is not None and declared_bytes > limit_bytes:
                raise BodyTooLarge(limit_bytes)
            message = await receive()
            if message["type"] == "http.request":
                received_bytes += len(message.get("body", b""))
                if received_bytes > limit_bytes:
                    raise BodyTooLarge(limit_bytes)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except BodyTooLarge as exc:  # an app without a handler for HTTPException
            if response_started:
                raise
            await JSONResponse({"error": exc.detail}, status_code=exc.status_code)(scope, receive, send)
        except ClientDisconnect:  # gone while its body was read: nobody to answer, nothing started
            if response_started:
                raise
            log.debug("client went away while sending the body of %s %s", scope.get("method"), scope["path"])


async def require_utf8_body(request: Request) -> None:
    """Refuse (400) a body that is not UTF-8. JSON parsers guess UTF-16 and UTF-32 from the first
    bytes (RFC 4627), but JSON on the wire is UTF-8 (RFC 8259), which the API promises. The body
    is read here, within its path's limit; the route's own parsing reuses it.

    Raises:
        HTTPException: 400 for a body that does not decode as UTF-8, or holds a NUL byte (413 over
            the limit).
    """
    body = await request.body()
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HTTPException(400, f"the body is not valid UTF-8 (byte {exc.start}); send JSON as UTF-8") from None
    # JSON escapes every control character, so a raw NUL is never JSON; it is how UTF-16 and UTF-32
    # text without a byte-order mark looks when read as UTF-8, which the JSON parser would then guess.
    nul = body.find(b"\x00")
    if nul >= 0:
        raise HTTPException(400, f"the body is not valid UTF-8 JSON (a NUL at byte {nul}); send JSON as UTF-8")


def _content_length(scope: Scope) -> int | None:
    try:
        return int(Headers(scope=scope)["content-length"])
    except (KeyError, ValueError):
        return None
