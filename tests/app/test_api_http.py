"""The `/v1/` API over real HTTP (the whole server app under uvicorn in a thread, tiny model), at
the level of bytes and statuses: SSE framing, every error path with OpenAI's error shape and
nothing stored, the key checked before a body is read, the body and per-tenant limits, a client
that goes away mid-stream, the native session routes and the OpenAPI schema."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
import uvicorn

from app.http.body_limits import DEFAULT_BODY_LIMITS
from app.http.server import build_app
from sessions.cancellation import CancelToken
from sessions.engine import Engine
from sessions.manager import SessionManager, open_services
from sessions.settings import Settings
from tests.conftest import make_settings

LIMIT = 2
"""The server's `max_concurrent_requests_per_tenant`."""
HUGE_BYTES = 200_000_000
"""Announced in `Content-Length` and never sent: a server that waited for it would time out."""


@dataclass
class Server:
    manager: SessionManager
    url: str
    keys: dict[str, str]
    model: str

    def post(self, path: str, body: Any = None, tenant: str = "acme", **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.keys[tenant]}", **kwargs.pop("headers", {})}
        if body is not None:
            kwargs["json"] = body
        return httpx.post(f"{self.url}{path}", headers=headers, **{"timeout": 60, **kwargs})

    def get(self, path: str, tenant: str = "acme") -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers={"Authorization": f"Bearer {self.keys[tenant]}"}, timeout=60)

    def stored(self) -> dict[str, list[tuple[str, int]]]:
        """Every tenant's sessions and their message counts."""
        return {name: sorted((s.id, s.message_count) for s in self.manager.list_sessions(name)) for name in self.keys}

    def wait_idle(self) -> None:
        deadline = time.monotonic() + 30
        while self.manager.internals.engine.loop.stats().running or self.manager.internals.engine.loop.stats().waiting:
            assert time.monotonic() < deadline, "the engine loop is still running a turn"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_engine: Engine) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("api-http") / "home"
    settings = make_settings(home, max_concurrent_requests_per_tenant=LIMIT)
    services = open_services(settings, engine=tiny_engine)
    with services.manager as manager:
        keys = {name: manager.issue_api_key(manager.create_tenant(name)) for name in ("acme", "beta")}
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        app = build_app(services, local=False, token="admin-token")
        uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not uv.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert uv.started, "uvicorn did not start"
        try:
            yield Server(manager, f"http://127.0.0.1:{sock.getsockname()[1]}/v1", keys, manager.model_name)
        finally:
            uv.should_exit = True
            thread.join(30)
            sock.close()
            app.state.prefetcher.close()


def _chat(server: Server, content: str = "Hello", **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def _error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == ("rate_limit_error" if status == 429 else "invalid_request_error")
    assert isinstance(error["message"], str) and error["message"]
    return str(error["message"])


def _frames(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking its framing (`data: ...` then a blank line)."""
    body = response.read().decode()
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), body
    return [e.removeprefix("data: ") for e in events]


# -- SSE framing ---------------------------------------------------------------------------------


def test_a_streamed_completion_is_framed_as_openai_chunks(server: Server) -> None:
    body = _chat(server, "Stream 你好 🎉", max_tokens=6, stream=True, stream_options={"include_usage": True})
    with httpx.stream(
        "POST", f"{server.url}/chat/completions", json=body, headers={"Authorization": f"Bearer {server.keys['acme']}"}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        session_id = response.headers["x-session-id"]
        frames = _frames(response)
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *content, finish, last = chunks[1:]
    assert all(c["usage"] is None and c["choices"][0]["finish_reason"] is None for c in content)
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    [_, reply] = server.manager.history("acme", session_id)
    assert reply.text == text


def test_a_completion_and_its_session_header(server: Server) -> None:
    response = server.post("/chat/completions", _chat(server, max_tokens=3))
    assert response.status_code == 200
    completion = response.json()
    assert completion["object"] == "chat.completion" and completion["model"] == server.model
    [choice] = completion["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    usage = completion["usage"]
    assert usage["completion_tokens"] == 3 and usage["total_tokens"] == usage["prompt_tokens"] + 3
    assert server.manager.history("acme", response.headers["x-session-id"])[1].text == choice["message"]["content"]


# -- authentication and limits --------------------------------------------------------------------

ROUTES = [
    ("GET", "/models"),
    ("GET", "/models/x"),
    ("POST", "/chat/completions"),
    ("GET", "/sessions"),
    ("POST", "/sessions"),
    ("GET", "/sessions/s_x"),
    ("DELETE", "/sessions/s_x"),
    ("POST", "/sessions/s_x/messages"),
    ("POST", "/sessions/s_x/prefetch"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong", "Bearer ckv_tn_0000000000000000_secret", "Basic abc", "abc"],
    ids=["missing", "wrong", "unknown-tenant", "basic", "no-scheme"],
)
def test_every_route_needs_a_tenant_key_and_says_the_same_either_way(
    server: Server, method: str, path: str, authorization: str | None
) -> None:
    before = server.stored()
    headers = {"Authorization": authorization} if authorization else {}
    response = httpx.request(method, f"{server.url}{path}", headers=headers, json=_chat(server), timeout=30)
    message = _error(response, 401, "invalid_api_key")
    assert message.startswith("missing or wrong API key")
    assert response.headers["www-authenticate"] == "Bearer"
    assert server.stored() == before


def _exchange(port_url: str, head: str) -> tuple[int, bytes]:
    """Send a request's head announcing a body that never comes; read the answer."""
    host, port = port_url.removeprefix("http://").split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536) or pytest.fail(f"connection closed after {data!r}")
        head_bytes, _, answer = data.partition(b"\r\n\r\n")
        lines = head_bytes.decode("latin-1").split("\r\n")
        fields = dict(line.lower().split(": ", 1) for line in lines[1:])
        while len(answer) < int(fields.get("content-length", 0)):
            answer += sock.recv(65536) or pytest.fail("connection closed mid-answer")
    return int(lines[0].split()[1]), answer


def _head(key: str | None) -> str:
    auth = [f"Authorization: Bearer {key}"] if key else []
    lines = ["POST /v1/chat/completions HTTP/1.1", "Host: test", "Content-Type: application/json"]
    return "\n".join([*lines, f"Content-Length: {HUGE_BYTES}", *auth, ""])


def test_the_key_is_checked_before_the_body_is_read_and_the_body_is_limited(server: Server) -> None:
    started = time.monotonic()
    status, answer = _exchange(server.url, _head("wrong"))
    assert status == 401 and json.loads(answer)["error"]["code"] == "invalid_api_key"
    status, answer = _exchange(server.url, _head(server.keys["acme"]))
    limit = DEFAULT_BODY_LIMITS.for_path("/v1/chat/completions")
    assert (status, json.loads(answer)) == (
        413,
        {
            "error": {
                "message": f"request body too large: the limit here is {limit:,} bytes",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_too_large",
            }
        },
    )
    assert time.monotonic() - started < 5  # neither waited for the 200 MB


@dataclass
class OpenStream:
    """A streaming request whose first chunk has arrived (its turn is running)."""

    client: httpx.Client
    response: httpx.Response
    lines: Iterator[str]
    """Kept: dropping a started line iterator closes the connection (the client would go away)."""

    def close(self) -> None:
        self.response.close()
        self.client.close()


def _open_stream(server: Server, body: dict[str, Any], tenant: str = "acme") -> OpenStream:
    client = httpx.Client(timeout=60, headers={"Authorization": f"Bearer {server.keys[tenant]}"})
    response = client.send(client.build_request("POST", f"{server.url}/chat/completions", json=body), stream=True)
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    assert next(lines).startswith("data: ")
    return OpenStream(client, response, lines)


def test_a_tenant_over_its_concurrent_requests_gets_429_and_others_do_not(server: Server) -> None:
    body = _chat(server, "Keep going", max_tokens=3000, temperature=0, stream=True)
    streams = [_open_stream(server, body) for _ in range(LIMIT)]
    try:
        before = server.stored()
        refused = server.post("/chat/completions", _chat(server))
        _error(refused, 429, "rate_limit_exceeded")
        assert refused.headers["retry-after"] == "1"
        assert server.get("/models", tenant="acme").status_code == 429
        assert server.get("/models", tenant="beta").status_code == 200
        assert server.stored() == before
    finally:
        for stream in streams:
            stream.close()
    server.wait_idle()
    deadline = time.monotonic() + 10
    while server.get("/models").status_code == 429:  # the slots are released as the streams close
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_client_that_goes_away_mid_stream_cancels_the_turn_and_nothing_is_stored(server: Server) -> None:
    session_id = server.manager.open_session("acme", "Be terse.")
    before = server.stored()
    long_turn = _chat(server, "Go on and on", max_tokens=3000, temperature=0, stream=True)
    for body in ({**long_turn, "session_id": session_id}, long_turn):  # explicit, then a new session
        stream = _open_stream(server, body)
        started = time.monotonic()
        stream.close()
        server.wait_idle()
        assert time.monotonic() - started < 10  # 3,000 tokens were not generated
        _wait_until(lambda: server.stored() == before)  # a session made for the turn goes with it


def test_an_unstreamed_turn_whose_client_goes_away_is_cancelled_and_nothing_is_stored(server: Server) -> None:
    session_id = server.manager.open_session("acme", "Be terse.")
    before = server.stored()
    long_turn = _chat(server, "Go on and on", max_tokens=3000, temperature=0)
    for body in ({**long_turn, "session_id": session_id}, long_turn):  # explicit, then a new session
        started = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            server.post("/chat/completions", body, timeout=1.5)
        server.wait_idle()
        assert time.monotonic() - started < 10  # 3,000 tokens were not generated
        _wait_until(lambda: server.stored() == before)  # a session made for the turn goes with it


def _wait_until(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true"
        time.sleep(0.02)


class _RecordedTokens(CancelToken):
    made: ClassVar[list[CancelToken]] = []

    def __init__(self) -> None:
        super().__init__()
        _RecordedTokens.made.append(self)


def test_a_turn_being_prepared_counts_as_running_and_stops_when_its_client_goes(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The work before the engine loop (restore, template, window) shows in
    `chatkv_requests_running` and ends when its client goes: nothing reaches the loop or the store."""
    runner = server.manager.internals.runner
    preparing, release = threading.Event(), threading.Event()
    prepare = runner.preparer._prepare_rebuild

    def slow_prepare(*args: Any, **kwargs: Any) -> Any:
        preparing.set()
        release.wait(30)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(runner.preparer, "_prepare_rebuild", slow_prepare)
    monkeypatch.setattr("app.http.forwarding.CancelToken", _RecordedTokens)
    _RecordedTokens.made.clear()
    before, steps = server.stored(), server.manager.internals.engine.loop.stats().steps

    def post_and_go_away() -> None:
        with pytest.raises(httpx.ReadTimeout):
            server.post("/chat/completions", _chat(server), timeout=1)

    client = threading.Thread(target=post_and_go_away)
    client.start()
    try:
        assert preparing.wait(30)
        metrics = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=10).text
        assert 'chatkv_requests_running{tenant="*"} 1.0' in metrics
        client.join(30)
        _wait_until(lambda: _RecordedTokens.made[0].cancelled)  # the server saw the client go
    finally:
        release.set()
    _wait_until(lambda: not runner.preparing_by_tenant())
    _wait_until(lambda: server.stored() == before)
    assert server.manager.internals.engine.loop.stats().steps == steps


def test_over_2048_messages_or_a_history_over_its_token_limit_is_refused_and_nothing_is_stored(
    server: Server,
) -> None:
    before = server.stored()
    pairs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(1024)]
    too_many = [m for pair in pairs for m in pair] + [{"role": "user", "content": "next"}]
    message = _error(
        server.post("/chat/completions", {**_chat(server), "messages": too_many}), 400, "array_above_max_length"
    )
    assert "maximum length 2048, but got an array with length 2049" in message
    # 8 times the tiny model's 4,096-token context: 600 turns of ~60 tokens each.
    words = " ".join(["word"] * 30)
    long_history = [
        m
        for i in range(600)
        for m in ({"role": "user", "content": f"{i} {words}"}, {"role": "assistant", "content": words})
    ]
    over = server.post(
        "/chat/completions", {**_chat(server), "messages": [*long_history, {"role": "user", "content": "next"}]}
    )
    assert "more than 32,768 tokens" in _error(over, 413, "context_length_exceeded")
    assert server.stored() == before


def test_the_longest_history_a_request_may_post_is_taken(server: Server) -> None:
    """2,047 history messages and the new one: one render and one pass over them (issue 18: the
    same request took minutes when each turn's cut point was found by rendering its prefix)."""
    history = [
        m
        for i in range(1023)
        for m in ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"})
    ]
    answer = server.post(
        "/chat/completions",
        {**_chat(server), "messages": [*history, {"role": "user", "content": "next"}], "max_tokens": 1},
    )
    assert answer.status_code == 200, answer.text
    assert server.manager.session_info("acme", answer.headers["x-session-id"]).message_count == 2048


def test_a_retry_with_an_idempotency_key_gets_the_recorded_answer_and_runs_one_turn(server: Server) -> None:
    session_id = server.manager.open_session("acme", "Be terse.")
    body = {**_chat(server, "Once only", temperature=0), "session_id": session_id}
    first = server.post("/chat/completions", body, headers={"Idempotency-Key": "turn-1"})
    again = server.post("/chat/completions", body, headers={"Idempotency-Key": "turn-1"})
    assert first.status_code == again.status_code == 200, again.text
    assert again.json() == first.json()
    assert again.headers["idempotent-replayed"] == "true" and "idempotent-replayed" not in first.headers
    assert again.headers["x-session-id"] == first.headers["x-session-id"] == session_id
    assert server.manager.session_info("acme", session_id).message_count == 2
    # Streamed: the retry is the recorded reply, streamed in one piece.
    streamed = {**body, "content": None, "stream": True, "messages": [{"role": "user", "content": "Stream it"}]}
    streamed.pop("content")
    texts = []
    for _ in range(2):
        frames = _frames(server.post("/chat/completions", streamed, headers={"Idempotency-Key": "turn-2"}))
        chunks = [json.loads(f) for f in frames[:-1]]
        texts.append("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks))
    assert texts[0] == texts[1] and server.manager.session_info("acme", session_id).message_count == 4
    # The native route, and another tenant's identical key, which is its own.
    native = {"content": "Native once", "max_tokens": 3}
    replies = [
        server.post(f"/sessions/{session_id}/messages", native, headers={"Idempotency-Key": "turn-3"}) for _ in range(2)
    ]
    assert replies[0].json() == replies[1].json() and replies[1].headers["idempotent-replayed"] == "true"
    assert server.manager.session_info("acme", session_id).message_count == 6
    other = server.post(
        "/chat/completions", _chat(server, "Once only"), tenant="beta", headers={"Idempotency-Key": "turn-1"}
    )
    assert other.status_code == 200 and "idempotent-replayed" not in other.headers


def test_an_idempotency_key_reused_for_another_request_or_still_running_is_refused(server: Server) -> None:
    session_id = server.manager.open_session("acme", "Be terse.")
    before = server.stored()
    body = {**_chat(server, "Hold on", max_tokens=3000, temperature=0, stream=True), "session_id": session_id}
    headers = {"Authorization": f"Bearer {server.keys['acme']}", "Idempotency-Key": "long"}
    with (
        httpx.Client(timeout=60, headers=headers) as client,
        client.stream("POST", f"{server.url}/chat/completions", json=body) as stream,
    ):
        lines = stream.iter_lines()  # kept: a dropped line iterator closes the response
        assert next(lines).startswith("data: ")
        running = server.post("/chat/completions", body, headers={"Idempotency-Key": "long"})
        assert "still running" in _error(running, 409, "idempotency_key_in_use")
        assert running.headers["retry-after"] == "1"
        other = server.post("/chat/completions", {**body, "max_tokens": 5}, headers={"Idempotency-Key": "long"})
        assert "different request" in _error(other, 400, "idempotency_key_reused")
    server.wait_idle()
    _wait_until(lambda: server.stored() == before)
    # The abandoned turn gave its key up: the same request runs again (and completes, shorter).
    short = {**body, "max_tokens": 2, "stream": False}
    for key in ("long-2", "long-2"):
        assert server.post("/chat/completions", short, headers={"Idempotency-Key": key}).status_code == 200
    assert server.manager.session_info("acme", session_id).message_count == 2
    for bad in ("has space", "x" * 256, "tab\tkey"):
        _error(server.post("/chat/completions", short, headers={"Idempotency-Key": bad}), 400, "invalid_request")


def test_a_busy_session_is_409_and_a_found_busy_session_is_not_continued(server: Server) -> None:
    first = server.post("/chat/completions", _chat(server, "Remember me", temperature=0))
    session_id = first.headers["x-session-id"]
    history = [
        {"role": "user", "content": "Remember me"},
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Next"},
    ]
    stream = _open_stream(server, _chat(server, "Hold on", max_tokens=3000, stream=True, session_id=session_id))
    try:
        busy = server.post("/chat/completions", _chat(server, "Me too"), headers={"X-Session-ID": session_id})
        _error(busy, 409, "session_busy")
        # A stateless client with that history gets a new session rather than waiting.
        other = server.post("/chat/completions", {"model": server.model, "messages": history, "max_tokens": 2})
        assert other.status_code == 200 and other.headers["x-session-id"] != session_id
    finally:
        stream.close()
    server.wait_idle()


# -- every bad request -----------------------------------------------------------------------------

LONG = "a" * 1_000_001


def _bad(content: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}]}


BAD_REQUESTS: list[tuple[str, Any, int, str, str]] = [
    # (id, body: dict merged into a valid request, or raw bytes), status, code, part of the message
    ("not-json", b"{not json", 400, "invalid_request", "not valid JSON"),
    ("not-utf8", b'{"model": "\xff"}', 400, "invalid_request", "not valid UTF-8"),
    # JSON parsers accept UTF-16 and UTF-32 by sniffing the first bytes; the API takes UTF-8 only.
    (
        "utf16-json",
        '{"model": "x", "messages": [{"role": "user", "content": "hi"}]}'.encode("utf-16"),
        400,
        "invalid_request",
        "not valid UTF-8",
    ),
    *(
        (
            f"{encoding}-json-without-a-byte-order-mark",
            '{"model": "x", "messages": [{"role": "user", "content": "hi"}]}'.encode(encoding),
            400,
            "invalid_request",
            "not valid UTF-8 JSON (a NUL",
        )
        for encoding in ("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")
    ),
    ("messages-not-a-list", {"messages": "hi"}, 400, "invalid_request", "messages"),
    ("no-messages", {"messages": []}, 400, "invalid_request", "messages"),
    ("content-a-number", {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_request", "content"),
    ("max-tokens-a-string", {"max_tokens": "5"}, 400, "invalid_request", "max_tokens"),
    ("max-tokens-a-float", {"max_tokens": 5.5}, 400, "invalid_request", "max_tokens"),
    ("temperature-a-string", {"temperature": "hot"}, 400, "invalid_request", "temperature"),
    ("stream-a-string", {"stream": "yes"}, 400, "invalid_request", "stream"),
    ("model-missing", {"model": None}, 400, "invalid_request", "model"),
    ("empty-message", _bad(""), 400, "invalid_request", "non-empty"),
    ("blank-message", _bad("   "), 400, "invalid_request", "non-empty"),
    ("oversized-message", _bad(LONG), 400, "invalid_request", "longer than 1,000,000 characters"),
    ("nul", _bad("a\x00b"), 400, "invalid_request", "NUL"),
    (
        "lone-surrogate",
        b'{"model": "$MODEL", "messages": [{"role": "user", "content": "a\\ud800"}]}',
        400,
        "invalid_request",
        "surrogate",
    ),
    (
        "history-nul",
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "\x00"},
                {"role": "user", "content": "b"},
            ]
        },
        400,
        "invalid_request",
        "NUL",
    ),
    (
        "assistant-first",
        {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]},
        400,
        "invalid_request",
        "alternating",
    ),
    (
        "two-users",
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
        400,
        "invalid_request",
        "alternating",
    ),
    (
        "ends-with-assistant",
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        400,
        "invalid_request",
        "alternating",
    ),
    (
        "late-system",
        {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
        400,
        "invalid_request",
        "alternating",
    ),
    ("unknown-role", {"messages": [{"role": "robot", "content": "a"}]}, 400, "invalid_request", "role"),
    ("no-content", {"messages": [{"role": "user"}]}, 400, "invalid_request", "content is required"),
    ("n-2", {"n": 2}, 400, "unsupported_parameter", "`n` other than 1"),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "unsupported_parameter", "tools"),
    ("tool-choice", {"tool_choice": "auto"}, 400, "unsupported_parameter", "tools"),
    ("functions", {"functions": [{"name": "f"}]}, 400, "unsupported_parameter", "functions"),
    (
        "tool-message",
        {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]},
        400,
        "unsupported_parameter",
        "tool",
    ),
    (
        "image",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
        400,
        "unsupported_parameter",
        "image_url",
    ),
    ("logprobs", {"logprobs": True}, 400, "unsupported_parameter", "logprobs"),
    ("json-mode", {"response_format": {"type": "json_object"}}, 400, "unsupported_parameter", "response_format"),
    ("penalty", {"presence_penalty": 0.5}, 400, "unsupported_parameter", "presence_penalty"),
    ("max-tokens-0", {"max_tokens": 0}, 400, "invalid_request", "Invalid 'max_tokens'"),
    (
        "max-completion-tokens-0",
        {"max_completion_tokens": 0},
        400,
        "invalid_request",
        "Invalid 'max_completion_tokens'",
    ),
    ("negative-temperature", {"temperature": -1.0}, 400, "invalid_request", "temperature"),
    ("temperature-over-2", {"temperature": 2.5}, 400, "invalid_request", "Invalid 'temperature'"),
    ("top-p-0", {"top_p": 0.0}, 400, "invalid_request", "top_p"),
    ("five-stops", {"stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_request", "Invalid 'stop'"),
    ("empty-stop", {"stop": [""]}, 400, "invalid_request", "empty"),
    ("unknown-model", {"model": "gpt-4o"}, 404, "model_not_found", "gpt-4o"),
    ("unknown-session", {"session_id": "s_missing"}, 404, "session_not_found", "s_missing"),
    (
        "context-too-long",
        {"max_tokens": 100_000},
        413,
        "context_length_exceeded",
        "in the prompt, up to 100000 in the reply), the limit is",
    ),
    ("unknown-field", {"foo": 1}, 400, "unrecognized_request_argument", "Unrecognized request argument supplied: foo"),
    (
        "unknown-fields",
        {"foo": 1, "best_of": 2},
        400,
        "unrecognized_request_argument",
        "Unrecognized request arguments supplied: foo, best_of",
    ),
    (
        "unknown-stream-option",
        {"stream_options": {"include_usage": True, "foo": 1}},
        400,
        "unrecognized_request_argument",
        "stream_options.foo",
    ),
    ("top-k", {"top_k": 5}, 400, "unsupported_parameter", "`top_k`"),
    ("repetition-penalty", {"repetition_penalty": 1.2}, 400, "unsupported_parameter", "`repetition_penalty`"),
    ("stop-token-ids", {"stop_token_ids": [5]}, 400, "unsupported_parameter", "`stop_token_ids`"),
    ("store-false", {"store": False}, 400, "unsupported_parameter", "`store: false`"),
    ("reasoning-effort", {"reasoning_effort": "low"}, 400, "unsupported_parameter", "`reasoning_effort`"),
    ("audio-modality", {"modalities": ["text", "audio"]}, 400, "unsupported_parameter", "modality"),
    ("min-tokens-over-max", {"min_tokens": 5}, 400, "invalid_request", "Invalid 'min_tokens'"),
    ("negative-min-tokens", {"min_tokens": -1}, 400, "invalid_request", "Invalid 'min_tokens'"),
    ("ignore-eos-not-bool", {"ignore_eos": "yes"}, 400, "invalid_request", "ignore_eos"),
]


@pytest.mark.parametrize(
    ("body", "status", "code", "message"), [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS]
)
def test_a_bad_request_gets_a_clear_4xx_and_changes_nothing(
    server: Server, body: Any, status: int, code: str, message: str
) -> None:
    before = server.stored()
    if isinstance(body, bytes):
        raw = body.replace(b"$MODEL", server.model.encode())
        response = server.post("/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    else:
        response = server.post(
            "/chat/completions", {k: v for k, v in {**_chat(server), **body}.items() if v is not None}
        )
    assert message in _error(response, status, code)
    assert server.stored() == before


def test_an_unknown_field_is_named_in_param_and_neutral_or_label_fields_change_nothing(server: Server) -> None:
    unknown = server.post("/chat/completions", _chat(server, foo=1))
    assert unknown.json()["error"] == {
        "message": "Unrecognized request argument supplied: foo",
        "type": "invalid_request_error",
        "param": "foo",
        "code": "unrecognized_request_argument",
    }
    labels = {
        "user": "u1",
        "safety_identifier": "s1",
        "metadata": {"k": "v"},
        "store": True,
        "prompt_cache_key": "k",
        "service_tier": "auto",
        "parallel_tool_calls": False,
        "modalities": ["text"],
        "n": 1,
        "tool_choice": "none",
        "logprobs": False,
        "presence_penalty": 0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "stop_token_ids": [],
        "min_tokens": 0,
        "ignore_eos": False,
        "stream_options": {"include_obfuscation": False},
    }
    plain = server.post("/chat/completions", _chat(server, "Same reply?", temperature=0))
    labelled = server.post("/chat/completions", _chat(server, "Same reply?", temperature=0, **labels))
    assert (plain.status_code, labelled.status_code) == (200, 200), labelled.text
    assert labelled.json()["choices"] == plain.json()["choices"]


def test_every_field_the_official_client_sends_is_known() -> None:
    from openai.types.chat.completion_create_params import CompletionCreateParamsStreaming

    from app.http.chat_request import ChatCompletionRequest

    sent = set(CompletionCreateParamsStreaming.__annotations__)
    assert sent - set(ChatCompletionRequest.model_fields) == set()


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [
        ("GET", "/v1/foo", 404, None),
        ("POST", "/v1/chat/completion", 404, None),
        ("GET", "/v1", 404, None),
        ("GET", "/v1/chat/completions", 405, "POST"),
        ("DELETE", "/v1/models", 405, "GET"),
        ("PUT", "/v1/sessions/s_x", 405, "DELETE, GET"),
    ],
)
def test_a_v1_route_that_does_not_exist_is_answered_in_openais_shape(
    server: Server, method: str, path: str, status: int, allow: str | None
) -> None:
    response = httpx.request(method, server.url.removesuffix("/v1") + path, timeout=30)
    assert response.status_code == status, response.text
    assert response.headers.get("allow") == allow
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", None)
    if status == 404:
        assert error["code"] == "unknown_url"
        assert error["message"].startswith(f"Unknown request URL: {method} {path}. Please check the URL for typos")
    else:
        message = f"Invalid method for URL ({method} {path}): it takes {allow}"
        assert (error["code"], error["message"]) == ("method_not_allowed", message)


@pytest.mark.parametrize(
    ("method", "path", "api_path"),
    [
        ("POST", "/chat/completions", "/v1/chat/completions"),
        ("GET", "/models", "/v1/models"),
        ("POST", "/responses", "/v1/responses"),
        ("GET", "/responses/resp_x/input_items", "/v1/responses/resp_x/input_items"),
        ("DELETE", "/sessions/s_x", "/v1/sessions/s_x"),
        ("GET", "/no/such/page", None),
        ("POST", "/completion", None),
    ],
)
def test_a_path_outside_v1_that_nothing_serves_is_answered_in_openais_shape_pointing_at_v1(
    server: Server, method: str, path: str, api_path: str | None
) -> None:
    root = server.url.removesuffix("/v1")
    response = httpx.request(method, root + path, headers={"Authorization": f"Bearer {server.keys['acme']}"})
    message = _error(response, 404, "unknown_url")
    if api_path is not None:
        assert message == f"Unknown request URL: {method} {path}. The API is under /v1: {method} {api_path}."
    else:
        assert message.startswith(f"Unknown request URL: {method} {path}. Please check the URL for typos")
    assert httpx.get(f"{root}/", timeout=30).headers["content-type"].startswith("text/html")  # the UI is there


def test_routes_outside_v1_keep_their_own_not_found(server: Server) -> None:
    root = server.url.removesuffix("/v1")
    admin = httpx.get(f"{root}/admin/nope", timeout=30)
    assert admin.status_code == 404 and "error" not in admin.json()
    assert httpx.get(f"{root}/v1x/foo", timeout=30).status_code == 404
    assert httpx.get(f"{root}/healthz", timeout=30).status_code == 200


def test_sessions_named_wrongly_are_refused_and_another_tenants_is_a_404_like_a_missing_one(server: Server) -> None:
    own = server.manager.open_session("acme", "Be terse.")
    other = server.manager.open_session("beta")
    before = server.stored()
    answers = {
        sid: server.post("/chat/completions", _chat(server), headers={"X-Session-ID": sid}) for sid in (other, "s_nope")
    }
    assert [_error(a, 404, "session_not_found").replace(sid, "<id>") for sid, a in answers.items()] == [
        "session not found: <id>"
    ] * 2
    with_history = {
        "messages": [*_bad("a")["messages"], {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    }
    for body, headers, text in [
        ({**_chat(server), **with_history}, {"X-Session-ID": own}, "send only the new user message"),
        (
            {**_chat(server), "messages": [{"role": "system", "content": "Other."}, {"role": "user", "content": "x"}]},
            {"X-Session-ID": own},
            "differs from the session's system prompt",
        ),
        ({**_chat(server), "session_id": own}, {"X-Session-ID": other}, "name different sessions"),
    ]:
        assert text in _error(server.post("/chat/completions", body, headers=headers), 400, "invalid_request")
    assert server.stored() == before


def test_a_session_named_by_its_client_is_made_under_that_name_per_tenant(server: Server) -> None:
    named = {"X-Session-ID": "conv-42"}
    first = server.post("/chat/completions", _chat(server, "Hi", temperature=0), headers=named)
    assert first.status_code == 200 and first.headers["x-session-id"] == "conv-42"
    again = server.post("/chat/completions", _chat(server, "More", temperature=0), headers=named)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    session = server.get("/sessions/conv-42").json()
    assert (session["name"], session["origin"], session["message_count"]) == ("conv-42", "named", 4)
    # Stateless clients that name their sessions post the whole history each time: taken when it
    # is the session's own, refused when it is not.
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "More"},
        {"role": "assistant", "content": again.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Last"},
    ]
    whole = server.post("/chat/completions", {**_chat(server), "messages": history}, headers=named)
    assert whole.status_code == 200 and whole.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    wrong = server.post("/chat/completions", {**_chat(server), "messages": history[2:]}, headers=named)
    assert "not this session's" in _error(wrong, 400, "invalid_request")
    # The same name in another tenant is another session; deleting one frees its name.
    beta = server.post("/chat/completions", _chat(server, "Hi"), tenant="beta", headers=named)
    assert beta.status_code == 200 and server.get("/sessions/conv-42", tenant="beta").json()["message_count"] == 2
    assert (
        httpx.delete(
            f"{server.url}/sessions/conv-42", headers={"Authorization": f"Bearer {server.keys['acme']}"}
        ).status_code
        == 200
    )
    anew = server.post("/chat/completions", _chat(server, "Hi again"), headers=named)
    assert anew.status_code == 200 and server.get("/sessions/conv-42").json()["message_count"] == 2
    for bad in ("has space", "x" * 129, "-dash-first", "a/b"):
        assert "invalid session id" in _error(
            server.post("/chat/completions", _chat(server), headers={"X-Session-ID": bad}), 400, "invalid_request"
        )
    _error(
        server.post("/chat/completions", _chat(server), headers={"X-Session-ID": "s_unknown"}), 404, "session_not_found"
    )


def test_a_stateless_regenerate_or_edit_forks_the_session_warm(server: Server) -> None:
    turns, session_id = [], None
    for text in ("One", "Two", "Three"):
        messages = [*turns, {"role": "user", "content": text}]
        answer = server.post("/chat/completions", {**_chat(server, temperature=0), "messages": messages})
        session_id = session_id or answer.headers["x-session-id"]
        assert answer.headers["x-session-id"] == session_id
        turns = [*messages, {"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]}]
    holders = {session_id}  # sessions holding the first turns: any of them may be forked
    for kept, text in ((4, "Three"), (2, "Two, edited")):  # regenerate the last reply; edit message 2
        answer = server.post(
            "/chat/completions",
            {**_chat(server, temperature=0), "messages": [*turns[:kept], {"role": "user", "content": text}]},
        )
        fork = answer.headers["x-session-id"]
        assert fork not in holders and answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        info = server.get(f"/sessions/{fork}").json()
        assert info["parent_id"] in holders and (info["fork_turns"], info["origin"]) == (kept // 2, "implicit")
        holders.add(fork)
    assert server.get(f"/sessions/{session_id}").json()["message_count"] == 6  # the parent is untouched


def test_a_fork_is_asked_for_by_session_and_turn(server: Server) -> None:
    session_id = server.manager.open_session("acme", "Be terse.")
    for text in ("One", "Two"):
        server.post(f"/sessions/{session_id}/messages", {"content": text, "max_tokens": 3})
    made = server.post(f"/sessions/{session_id}/fork", {"at_turn": 1})
    assert made.status_code == 201, made.text
    fork = made.json()
    assert (fork["parent_id"], fork["fork_turns"], fork["message_count"], fork["origin"]) == (session_id, 1, 2, "fork")
    reply = server.post(f"/sessions/{fork['id']}/messages", {"content": "Other", "max_tokens": 3}).json()
    assert reply["stats"]["restored_from"] == "device" and reply["stats"]["reused_tokens"] > 0
    for body in ({"at_turn": 3}, {"at_turn": -1}, {"at_turn": "1"}, {"at_turn": 2**62}, {"at_turn": 2**70}, {}):
        _error(server.post(f"/sessions/{session_id}/fork", body), 400, "invalid_request")
    _error(server.post(f"/sessions/{session_id}/fork", {"at_turn": 1}, tenant="beta"), 404, "session_not_found")
    # A request with no body at all says what is missing, and a turn past the end counts in words.
    assert _error(server.post(f"/sessions/{session_id}/fork"), 400, "invalid_request") == (
        "the request needs a JSON body"
    )
    assert _error(server.post(f"/sessions/{session_id}/fork", {"at_turn": 3}), 400, "invalid_request") == (
        f"no turn 3: session {session_id} has 2 turns"
    )


# -- native session routes ------------------------------------------------------------------------


def test_native_sessions_create_list_get_message_prefetch_delete(server: Server) -> None:
    created = server.post("/sessions", {"system_prompt": "Be terse.", "title": "native"})
    assert created.status_code == 201
    session = created.json()
    assert (session["object"], session["title"], session["message_count"], session["tier"]) == (
        "session",
        "native",
        0,
        None,
    )
    sid = session["id"]
    assert sid in {s["id"] for s in server.get("/sessions").json()["data"]}
    assert sid not in {s["id"] for s in server.get("/sessions", tenant="beta").json()["data"]}

    sent = server.post(f"/sessions/{sid}/messages", {"content": "Hello", "max_tokens": 4})
    assert sent.status_code == 200 and sent.headers["x-session-id"] == sid
    reply = sent.json()
    assert reply["object"] == "session.message" and reply["finish_reason"] == "length"
    assert reply["stats"]["restored_from"] == "new" and reply["usage"]["completion_tokens"] == 4
    with httpx.stream(
        "POST",
        f"{server.url}/sessions/{sid}/messages",
        json={"content": "Again", "max_tokens": 4, "stream": True},
        headers={"Authorization": f"Bearer {server.keys['acme']}"},
    ) as response:
        frames = _frames(response)
    assert frames[-1] == "[DONE]"
    *deltas, final = [json.loads(f) for f in frames[:-1]]
    assert {d["object"] for d in deltas} == {"session.message.delta"}
    assert final["message"]["content"] == "".join(d["content"] for d in deltas)
    assert final["stats"]["restored_from"] == "device"
    assert final["usage"]["prompt_tokens_details"]["cached_tokens"] == final["stats"]["reused_tokens"] > 0

    detail = server.get(f"/sessions/{sid}").json()
    assert [(m["role"], m["content"]) for m in detail["messages"]] == [
        ("user", "Hello"),
        ("assistant", reply["message"]["content"]),
        ("user", "Again"),
        ("assistant", final["message"]["content"]),
    ]
    assert detail["messages"][1]["tokens"] == 4 and detail["tier"] == "device"

    server.manager.internals.tiers.flush()
    assert server.manager.evict_session("acme", sid, "disk") == "disk"
    prefetch = server.post(f"/sessions/{sid}/prefetch")
    assert (prefetch.status_code, prefetch.json()) == (
        202,
        {"id": sid, "object": "session.prefetch", "status": "started"},
    )
    deadline = time.monotonic() + 20
    while server.get(f"/sessions/{sid}").json()["tier"] != "device":
        assert time.monotonic() < deadline, "the prefetch did not bring the cache to the device"
        time.sleep(0.05)

    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/prefetch")):
        response = httpx.request(
            method, f"{server.url}/sessions/{sid}{path}", headers={"Authorization": f"Bearer {server.keys['beta']}"}
        )
        _error(response, 404, "session_not_found")
    deleted = httpx.delete(f"{server.url}/sessions/{sid}", headers={"Authorization": f"Bearer {server.keys['acme']}"})
    assert deleted.json() == {"id": sid, "object": "session.deleted", "deleted": True}
    _error(server.get(f"/sessions/{sid}"), 404, "session_not_found")


@pytest.mark.parametrize(
    ("path", "body", "text"),
    [
        ("/sessions", {"system_prompt": 5}, "system_prompt"),
        ("/sessions", {"system_prompt": "a\x00"}, "NUL"),
        ("/sessions", {"title": "t" * 201}, "title longer"),
        ("/sessions/{sid}/messages", {"content": ""}, "non-empty"),
        ("/sessions/{sid}/messages", {"content": "x", "max_tokens": "3"}, "max_tokens"),
        ("/sessions/{sid}/messages", {"content": "x", "stop": ["", "y"]}, "empty"),
        ("/sessions/{sid}/messages", {"content": "x", "max_tokens": 3, "min_tokens": 4}, "min_new_tokens"),
        ("/sessions", {"unknown": 1}, "Unrecognized request argument supplied: unknown"),
        ("/sessions/{sid}/messages", {"content": "x", "top_k": 3}, "Unrecognized request argument supplied: top_k"),
    ],
)
def test_native_bad_requests_are_400_and_change_nothing(server: Server, path: str, body: Any, text: str) -> None:
    sid = server.manager.open_session("acme")
    before = server.stored()
    code = "unrecognized_request_argument" if "Unrecognized" in text else "invalid_request"
    assert text in _error(server.post(path.format(sid=sid), body), 400, code)
    assert server.stored() == before


def test_the_openapi_schema_documents_the_v1_routes(server: Server) -> None:
    schema = httpx.get(server.url.removesuffix("/v1") + "/openapi.json").json()
    assert {
        "/v1/chat/completions",
        "/v1/models",
        "/v1/models/{model}",
        "/v1/sessions",
        "/v1/sessions/{session_id}",
        "/v1/sessions/{session_id}/messages",
        "/v1/sessions/{session_id}/prefetch",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/input_items",
        "/v1/responses/{response_id}/cancel",
        "/v1/conversations",
        "/v1/conversations/{conversation_id}",
        "/v1/conversations/{conversation_id}/items",
        "/v1/conversations/{conversation_id}/items/{item_id}",
    } <= set(schema["paths"])
    completions = schema["paths"]["/v1/chat/completions"]["post"]
    assert completions["security"] == [{"HTTPBearer": []}]
    assert "text/event-stream" in completions["responses"]["200"]["content"]
    request = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert "precedence" in request["max_completion_tokens"]["description"]
    cached = schema["components"]["schemas"]["PromptTokensDetails"]["properties"]["cached_tokens"]
    assert "served from chatkv's cache" in cached["description"]


def test_the_api_settings_come_from_the_environment_and_are_checked(tmp_path: Path) -> None:
    env = {"CHATKV_HOME": str(tmp_path), "CHATKV_MAX_CONCURRENT_REQUESTS_PER_TENANT": "3", "CHATKV_REUSE_KV": "0"}
    settings = Settings.from_env(env)
    assert (settings.max_concurrent_requests_per_tenant, settings.reuse_kv) == (3, False)
    assert Settings.from_env({"CHATKV_HOME": str(tmp_path)}).max_concurrent_requests_per_tenant == 16
    with pytest.raises(ValueError, match="max_concurrent_requests_per_tenant must be an integer >= 1"):
        Settings.from_env({**env, "CHATKV_MAX_CONCURRENT_REQUESTS_PER_TENANT": "0"})
    with pytest.raises(ValueError, match="CHATKV_REUSE_KV: not a boolean"):
        Settings.from_env({**env, "CHATKV_REUSE_KV": "maybe"})
