"""`Idempotency-Key` over a real `chatkv serve` process on PostgreSQL (tiny model): a streamed
response's client gone at any point after the response is stored retries into a replay of that
one response, never a second turn (the race driven deterministically: the test holds the
`responses` table so the server stops right where it stores the response, drops the connection
there, and lets it go once the server has seen the client leave); the same key and body aimed at
another session is another request; and a deleted response, session or conversation leaves
nothing replayable under its key."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text

from sessions.engine import Engine as ModelEngine
from sessions.manager import SessionManager
from storage.database import open_database
from tests.app.server_process import chatkv_serve
from tests.conftest import make_settings
from tests.storage.conftest import fresh_schema, postgres_admin  # noqa: F401  (fixture)

Event = tuple[str, dict[str, Any]]
CLOSING_EVENTS = 4
"""Events after the last text delta: output_text.done, content_part.done, output_item.done, and
response.completed (or response.incomplete)."""


@dataclass
class Served:
    url: str
    log: Path
    database_url: str
    keys: dict[str, str]
    model: str

    def headers(self, tenant: str = "acme", **more: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}", "Content-Type": "application/json", **more}

    def post(self, path: str, body: bytes | dict[str, Any], tenant: str = "acme", **headers: str) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(f"{self.url}/v1{path}", content=content, headers=self.headers(tenant, **headers), timeout=120)

    def call(self, method: str, path: str, tenant: str = "acme") -> httpx.Response:
        return httpx.request(method, f"{self.url}/v1{path}", headers=self.headers(tenant), timeout=60)

    def sessions(self) -> set[str]:
        return {s["id"] for s in self.call("GET", "/sessions").json()["data"]}


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    tiny_engine: ModelEngine,
    postgres_admin: Engine,  # noqa: F811
) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("idempotency-keys")
    for database_url in fresh_schema(postgres_admin):
        with SessionManager(make_settings(root / "admin", database_url=database_url), engine=tiny_engine) as manager:
            keys = {name: manager.issue_api_key(manager.create_tenant(name)) for name in ("acme", "beta")}
            model = manager.model_name
        # debug: the server logs a streamed answer's client going away (the race test waits for it).
        settings = {"database_url": database_url, "log_level": "debug"}
        with chatkv_serve(root / "home", str(tiny_model_dir), root / "server.log", **settings) as server:
            yield Served(server.url, server.log, database_url, keys, model)


def _events(lines: Iterator[str]) -> Iterator[Event]:
    kind = ""
    for line in lines:
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield kind, json.loads(line.removeprefix("data: "))


def _closing(events: list[Event]) -> int:
    """How many of the closing events have arrived."""
    kinds = [kind for kind, _ in events]
    if "response.output_text.delta" not in kinds:
        return 0
    last_delta = len(kinds) - 1 - kinds[::-1].index("response.output_text.delta")
    return len(kinds) - 1 - last_delta


def _stream_until(served: Served, body: bytes, key: str, enough: Callable[[list[Event]], bool]) -> list[Event]:
    """Stream the response and drop the connection once `enough(events so far)`."""
    with (
        httpx.Client(timeout=120) as client,
        client.stream(
            "POST", f"{served.url}/v1/responses", content=body, headers=served.headers(**{"Idempotency-Key": key})
        ) as response,
    ):
        assert response.status_code == 200, response.read()
        events: list[Event] = []
        for event in _events(response.iter_lines()):
            events.append(event)
            if enough(events):
                break
    return events


def _until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _retry(served: Served, body: bytes, key: str) -> tuple[httpx.Response, list[Event]]:
    """The retry a client sends: again while the first attempt still holds the key (409)."""
    deadline = time.monotonic() + 60
    while (answer := served.post("/responses", body, **{"Idempotency-Key": key})).status_code == 409:
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.1)
    assert answer.status_code == 200, answer.text
    return answer, list(_events(iter(answer.text.splitlines())))


def _gone_where_the_response_is_stored(served: Served, body: bytes, key: str) -> list[Event]:
    """Stream while the test holds the `responses` table: the server stores the reply's turn, then
    waits to store the response; drop the connection then, wait until the server saw the client
    go, then let the store go on."""
    database = open_database(served.database_url)
    try:
        with database.connect() as holder, database.connect() as watcher:
            holder.execute(text("LOCK TABLE responses IN SHARE MODE"))  # reads go on, inserts wait
            me = holder.execute(text("SELECT pg_backend_pid()")).scalar_one()

            def server_waits() -> bool:
                with watcher.begin():  # a new snapshot of pg_stat_activity each time
                    query = "SELECT count(*) FROM pg_stat_activity WHERE :me = ANY(pg_blocking_pids(pid))"
                    return bool(watcher.execute(text(query), {"me": me}).scalar_one())

            with (
                httpx.Client(timeout=120) as client,
                client.stream(
                    "POST",
                    f"{served.url}/v1/responses",
                    content=body,
                    headers=served.headers(**{"Idempotency-Key": key}),
                ) as response,
            ):
                assert response.status_code == 200
                host, port = response.extensions["network_stream"].get_extra_info("client_addr")
                stream = _events(response.iter_lines())  # kept: a dropped line iterator closes the response
                events = [next(stream)]  # response.created: the turn runs
                _until(server_waits, "the server waits to store the response")
            gone = f"client {host}:{port} went away before the answer to POST /v1/responses ended"
            _until(lambda: gone in served.log.read_text(), "the server saw the client go")
            holder.rollback()
    finally:
        database.dispose()
    return events


@pytest.mark.parametrize("closing_events_read", [None, 1, 2, 3, 4])
def test_a_client_gone_once_its_response_is_stored_retries_into_a_replay_of_it(
    served: Served, closing_events_read: int | None
) -> None:
    """`None`: gone while the server stores the response (every delta sent, no closing event);
    k: gone after reading k of the closing events."""
    key = f"gone-{closing_events_read}"
    body = json.dumps(
        {
            "model": served.model,
            "input": f"Tell me about {key}",
            "max_output_tokens": 8,
            "temperature": 1.0,
            "seed": 11,
            "stream": True,
        }
    ).encode()
    before = served.sessions()
    if closing_events_read is None:
        events = _gone_where_the_response_is_stored(served, body, key)
    else:
        events = _stream_until(served, body, key, lambda seen, k=closing_events_read: _closing(seen) >= k)
        assert _closing(events) == closing_events_read
    response_id = events[0][1]["response"]["id"]
    retried, replayed = _retry(served, body, key)
    assert retried.headers["idempotent-replayed"] == "true"
    assert replayed[0][1]["response"]["id"] == response_id  # the first attempt's response, not a new one
    final = replayed[-1][1]["response"]
    assert served.call("GET", f"/responses/{response_id}").json() == final
    assert len(served.sessions() - before) == 1  # one turn, on one session


def test_the_same_key_and_body_aimed_at_another_session_is_another_request(served: Served) -> None:
    body = {"model": served.model, "messages": [{"role": "user", "content": "Same words"}], "max_tokens": 4}
    first = served.post("/chat/completions", body, **{"X-Session-ID": "idem-a", "Idempotency-Key": "aimed"})
    assert first.status_code == 200, first.text
    elsewhere = served.post("/chat/completions", body, **{"X-Session-ID": "idem-b", "Idempotency-Key": "aimed"})
    assert elsewhere.status_code == 400, elsewhere.text
    error = elsewhere.json()["error"]
    assert (error["code"], error["param"]) == ("idempotency_key_reused", "Idempotency-Key")
    assert "X-Session-ID" in error["message"]
    assert served.call("GET", "/sessions/idem-b").status_code == 404  # the session asked for got no turn
    again = served.post("/chat/completions", body, **{"X-Session-ID": "idem-a", "Idempotency-Key": "aimed"})
    assert again.headers["idempotent-replayed"] == "true" and again.json() == first.json()
    assert len(served.call("GET", "/sessions/idem-a").json()["messages"]) == 2


def test_a_deleted_response_session_or_conversation_leaves_nothing_replayable_under_its_key(served: Served) -> None:
    ask = {"model": served.model, "input": "Forget me later", "max_output_tokens": 4}
    first = served.post("/responses", ask, **{"Idempotency-Key": "del-response"})
    assert served.call("DELETE", f"/responses/{first.json()['id']}").status_code == 200
    again = served.post("/responses", ask, **{"Idempotency-Key": "del-response"})
    assert again.status_code == 200 and "idempotent-replayed" not in again.headers
    assert again.json()["id"] != first.json()["id"]

    chat = {"model": served.model, "messages": [{"role": "user", "content": "Forget me too"}], "max_tokens": 4}
    named = {"X-Session-ID": "idem-deleted", "Idempotency-Key": "del-session"}
    served.post("/chat/completions", chat, **named)
    assert served.call("DELETE", "/sessions/idem-deleted").status_code == 200
    again = served.post("/chat/completions", chat, **named)
    assert again.status_code == 200 and "idempotent-replayed" not in again.headers
    assert len(served.call("GET", "/sessions/idem-deleted").json()["messages"]) == 2  # a new session's turn

    conversation = served.post("/conversations", {"items": []}).json()["id"]
    in_conversation = {**ask, "conversation": conversation}
    assert served.post("/responses", in_conversation, **{"Idempotency-Key": "del-conv"}).status_code == 200
    assert served.call("DELETE", f"/conversations/{conversation}").status_code == 200
    again = served.post("/responses", in_conversation, **{"Idempotency-Key": "del-conv"})
    assert again.status_code == 404 and again.json()["error"]["code"] == "conversation_not_found"
