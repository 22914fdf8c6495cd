"""Request body limits and the admin token, both checked before a body is read: the middleware on
its own (how much of a body it lets an app read), then the whole server over real HTTP (uvicorn on a
free port, a raw socket that sends a request's head and none of the body it announces)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterable, Iterator

import pytest
import uvicorn
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.types import Message, Receive, Scope, Send

from app.http.body_limits import DEFAULT_BODY_LIMITS, BodyLimitMiddleware, BodyLimits
from app.http.server import build_app
from sessions.manager import Services, SessionManager

TOKEN = "test-admin-token"
HUGE_BYTES = 200_000_000
"""Announced in `Content-Length` and never sent: a server that waited for it would time out."""
ANSWER_TIMEOUT_S = 10.0


# -- the middleware ------------------------------------------------------------------------------


async def _echo_length(scope: Scope, receive: Receive, send: Send) -> None:
    """An app that reads the whole body and answers its length."""
    body = await Request(scope, receive).body()
    await PlainTextResponse(str(len(body)))(scope, receive, send)


def _call(limits: BodyLimits, path: str, chunks: list[bytes], *, declared: bool) -> tuple[int, bytes, int]:
    """One request through the middleware over `_echo_length`; returns the status, the response
    body and how many body bytes the app pulled from the server."""
    headers = [(b"content-length", str(sum(map(len, chunks))).encode())] if declared else []
    scope: Scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""}
    pending = list(chunks)
    pulled = 0
    sent: list[Message] = []

    async def receive() -> Message:
        nonlocal pulled
        chunk = pending.pop(0)
        pulled += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(BodyLimitMiddleware(_echo_length, limits)(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), pulled


def test_a_declared_length_over_the_limit_is_refused_before_any_byte_is_read() -> None:
    limits = BodyLimits(default_bytes=100)
    status, body, pulled = _call(limits, "/x", [b"a" * 101], declared=True)
    assert (status, json.loads(body), pulled) == (
        413,
        {"error": "request body too large: the limit here is 100 bytes"},
        0,
    )
    assert _call(limits, "/x", [b"a" * 100], declared=True) == (200, b"100", 100)


def test_a_body_without_a_length_is_counted_and_cut_at_the_first_chunk_over_the_limit() -> None:
    limits = BodyLimits(default_bytes=25)
    status, _, pulled = _call(limits, "/x", [b"a" * 10] * 5, declared=False)
    assert (status, pulled) == (413, 30)
    assert _call(limits, "/x", [b"a" * 10, b"a" * 15], declared=False) == (200, b"25", 25)


def test_a_client_gone_while_its_body_is_read_is_logged_at_debug_and_answered_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scope: Scope = {"type": "http", "method": "POST", "path": "/v1/x", "headers": [], "query_string": b""}
    messages: list[Message] = [{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}]
    sent: list[Message] = []

    async def receive() -> Message:
        return messages.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    with caplog.at_level("DEBUG", logger="app.http.body_limits"):
        asyncio.run(BodyLimitMiddleware(_echo_length, BodyLimits(default_bytes=100))(scope, receive, send))
    assert sent == []
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("DEBUG", "client went away while sending the body of POST /v1/x")
    ]


def test_the_longest_matching_prefix_sets_the_limit() -> None:
    limits = BodyLimits(default_bytes=100, prefix_bytes={"/a/": 10, "/a/b": 0})
    assert [limits.for_path(p) for p in ("/", "/a", "/a/", "/a/x", "/a/b", "/a/bc/d")] == [100, 100, 10, 10, 0, 0]
    assert DEFAULT_BODY_LIMITS.for_path("/gradio_api/upload") == 0
    assert DEFAULT_BODY_LIMITS.for_path("/admin/tenants") < DEFAULT_BODY_LIMITS.for_path("/gradio_api/queue/join")


@pytest.mark.parametrize(
    ("default", "prefixes", "message"),
    [
        (-1, {}, "body limit of default must be a non-negative integer"),
        (10, {"/a/": 1.5}, "body limit of /a/ must be a non-negative integer"),
        (10, {"/a/": True}, "body limit of /a/ must be a non-negative integer"),
        (10, {"a/": 1}, "must start with '/'"),
    ],
)
def test_bad_limits_are_refused(default: int, prefixes: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BodyLimits(default_bytes=default, prefix_bytes=prefixes)


# -- the server over HTTP ------------------------------------------------------------------------


@pytest.fixture
def port(tiny_services: Services) -> Iterator[int]:
    """The whole server app (multi-tenant mode) served by uvicorn in a thread; yields its port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = build_app(tiny_services, local=False, token=TOKEN)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    try:
        yield int(sock.getsockname()[1])
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _exchange(port: int, head: str, body: bytes = b"", chunks: Iterable[bytes] = ()) -> tuple[int, bytes]:
    """Send a request's head (and `body`, and `chunks` in chunked encoding), read the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_TIMEOUT_S) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        for chunk in chunks:
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536) or pytest.fail(f"connection closed after {data!r}")
        response_head, _, answer = data.partition(b"\r\n\r\n")
        lines = response_head.decode("latin-1").split("\r\n")
        fields = dict(line.lower().split(": ", 1) for line in lines[1:])
        while len(answer) < int(fields.get("content-length", 0)):
            answer += sock.recv(65536) or pytest.fail("connection closed mid-answer")
    return int(lines[0].split()[1]), answer


def _post_head(path: str, length: int | None, *extra: str, content_type: str = "application/json") -> str:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return "\n".join([f"POST {path} HTTP/1.1", "Host: test", f"Content-Type: {content_type}", framing, *extra, ""])


@pytest.mark.parametrize("authorization", [(), ("Authorization: Bearer wrong",)], ids=["no-token", "wrong-token"])
def test_an_admin_request_without_the_token_is_refused_without_reading_its_body(
    port: int, tiny_manager: SessionManager, authorization: tuple[str, ...]
) -> None:
    started = time.monotonic()
    status, answer = _exchange(port, _post_head("/admin/tenants", HUGE_BYTES, *authorization))
    assert (status, json.loads(answer)) == (401, {"error": "missing or wrong admin token"})
    assert time.monotonic() - started < ANSWER_TIMEOUT_S / 2
    assert tiny_manager.list_tenants() == []


def test_an_admin_body_over_the_limit_is_413_without_reading_it(port: int) -> None:
    limit = DEFAULT_BODY_LIMITS.for_path("/admin/tenants")
    status, answer = _exchange(port, _post_head("/admin/tenants", HUGE_BYTES, f"Authorization: Bearer {TOKEN}"))
    assert (status, json.loads(answer)) == (
        413,
        {"error": f"request body too large: the limit here is {limit:,} bytes"},
    )
    body = json.dumps({"name": "acme"}).encode()
    created = _exchange(port, _post_head("/admin/tenants", len(body), f"Authorization: Bearer {TOKEN}"), body)
    assert created[0] == 201


def test_a_chat_event_over_the_limit_is_413_whether_its_length_is_declared_or_not(port: int) -> None:
    status, answer = _exchange(port, _post_head("/gradio_api/queue/join", HUGE_BYTES))
    assert status == 413 and b"request body too large" in answer
    limit = DEFAULT_BODY_LIMITS.for_path("/gradio_api/queue/join")
    chunks = (b" " * 2**20 for _ in range(limit // 2**20 + 1))
    status, answer = _exchange(port, _post_head("/gradio_api/queue/join", None), chunks=chunks)
    assert status == 413 and b"request body too large" in answer
    small = json.dumps({"data": [], "fn_index": 0, "session_hash": "abc"}).encode()
    status, answer = _exchange(port, _post_head("/gradio_api/queue/join", len(small)), small)
    assert status == 200 and "event_id" in json.loads(answer)  # queued as usual


def test_uploads_are_refused(port: int) -> None:
    body = (
        b'--b\r\nContent-Disposition: form-data; name="files"; filename="a.txt"\r\n'
        b"Content-Type: text/plain\r\n\r\nhello\r\n--b--\r\n"
    )
    head = _post_head("/gradio_api/upload", len(body), content_type="multipart/form-data; boundary=b")
    status, answer = _exchange(port, head, body)
    assert (status, answer) == (413, b'{"detail":"request body too large: the limit here is 0 bytes"}')
