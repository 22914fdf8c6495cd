"""Forwarding turns to their session's owner, and draining, with real `chatkv serve` processes on
one PostgreSQL schema and one Redis (docs/replicas.md, "Routing", "Drain").

Turns alternating between two replicas all run on the session's owner, warm on its device, for
stateless OpenAI clients (streamed through the other replica chunk by chunk) and the session
routes alike; a forwarded request is never forwarded again and a wrong key stops at the first
replica; an owner killed mid-forward leaves no turn stored twice, and a retry with the request's
`Idempotency-Key` runs once the owner's claim died with it; a replica stopped while its
turns run finishes them and hands its sessions over through Redis at once (no lease expiry, no
rebuild); `chatkv replicas drain` makes the others take its sessions over rather than forward."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from sqlalchemy import select
from typer.testing import CliRunner

from app.cli import app
from app.http.forwarding import FORWARDED_BY_HEADER
from sessions.engine import Engine as ModelEngine
from storage.database import open_database
from storage.schema import SessionOwnerRow
from tests.app.replica_processes import Replica, replicas, start_replica
from tests.app.test_replicas import (
    MESSAGES,
    SYSTEM,
    admin_cli,
    history,
    make_tenants,
    module_database_url,  # noqa: F401  (fixture)
    module_redis_prefix,  # noqa: F401  (fixture)
    new_session,
    replica_id,
    replica_settings,
    turn,
    wait_for_redis_copy,
)
from tests.conftest import cli_environment
from tests.storage.conftest import postgres_admin  # noqa: F401  (fixture)

Pair = tuple[list[Replica], dict[str, str], dict[str, str]]


@pytest.fixture(scope="module")
def forward_pair(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    tiny_engine: ModelEngine,
    module_database_url: str,  # noqa: F811
    redis_url: str,
    module_redis_prefix: str,  # noqa: F811
) -> Iterator[Pair]:
    """Two replicas that forward (the default), the tenants' keys, and their settings (for a third
    replica a test starts beside them)."""
    root = tmp_path_factory.mktemp("forward-pair")
    settings = replica_settings(module_database_url, redis_url, module_redis_prefix, routing="forward")
    settings["ownership_lease_s"] = "15"  # nothing here waits for one of these two to expire
    keys = make_tenants(root, tiny_engine, settings)
    with replicas(root, str(tiny_model_dir), settings) as started:
        yield started, keys, settings


@contextlib.contextmanager
def third_replica(root: Path, model: Path, settings: dict[str, str], **more: str) -> Iterator[Replica]:
    """One more replica beside the pair, stopped (or already gone) at the end."""
    replica = start_replica(root, str(model), {**settings, **more})
    try:
        yield replica
    finally:
        if replica.process.poll() is None:
            replica.stop()


def counter(replica: Replica, name: str, **labels: str) -> float:
    """A counter of the replica's `/metrics` (0 when the series does not exist yet)."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    for line in replica.client.get("/metrics").text.splitlines():
        if line.startswith(name + "{") and all(label in line for label in wanted):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def lease(database_url: str, session_id: str) -> tuple[str | None, int]:
    """The session's lease row: its holder (`None`: released) and epoch (hand-overs + 1)."""
    engine = open_database(database_url)
    try:
        with engine.connect() as connection:
            row = connection.execute(
                select(SessionOwnerRow.replica_id, SessionOwnerRow.epoch).where(
                    SessionOwnerRow.session_id == session_id
                )
            ).one()
        return row[0], int(row[1])
    finally:
        engine.dispose()


def stream_openai(client: OpenAI, model: str, messages: list[dict[str, str]]) -> tuple[str, str, int]:
    """One streamed stateless turn: the session id, the reply, and the prompt tokens served from
    the cache."""
    with client.chat.completions.with_streaming_response.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ) as response:
        session_id = response.headers["x-session-id"]
        pieces, cached = [], -1
        for chunk in response.parse():
            pieces += [choice.delta.content or "" for choice in chunk.choices]
            if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return session_id, "".join(pieces), cached


def stateless_conversation(clients: list[OpenAI], model: str) -> list[tuple[str, str, int]]:
    """`MESSAGES` as a stateless client sends them (the whole conversation each time), turn `i`
    through `clients[i % len(clients)]`."""
    messages = [{"role": "system", "content": SYSTEM}]
    results = []
    for index, content in enumerate(MESSAGES):
        messages.append({"role": "user", "content": content})
        result = stream_openai(clients[index % len(clients)], model, messages)
        messages.append({"role": "assistant", "content": result[1]})
        results.append(result)
    return results


def test_stateless_openai_turns_through_either_replica_stream_from_the_warm_owner(
    forward_pair: Pair,
    module_database_url: str,  # noqa: F811
) -> None:
    (a, b), keys, _ = forward_pair
    model = a.client.get("/v1/models", headers={"Authorization": f"Bearer {keys['acme']}"}).json()["data"][0]["id"]
    acme = [OpenAI(base_url=f"{r.url}/v1", api_key=keys["acme"], max_retries=0) for r in (a, b)]
    on_device = counter(a, "chatkv_turns_total", restored_from="device")
    forwards = counter(b, "chatkv_routes_total", route="forward")
    results = stateless_conversation(acme, model)
    session_ids = {session_id for session_id, _, _ in results}
    assert len(session_ids) == 1  # found by its history every time
    (session_id,) = session_ids
    # Every turn after the first ran on a (the owner), on the cache its device kept: no hand-over.
    assert all(cached > 0 for _, _, cached in results[1:]), results
    assert counter(a, "chatkv_turns_total", restored_from="device") - on_device == len(MESSAGES) - 1
    assert counter(b, "chatkv_routes_total", route="forward") - forwards >= 2
    assert lease(module_database_url, session_id) == (replica_id(a), 1)
    # The same replies as one replica alone (another tenant, the same conversation).
    globex = OpenAI(base_url=f"{a.url}/v1", api_key=keys["globex"], max_retries=0)
    assert [reply for _, reply, _ in results] == [reply for _, reply, _ in stateless_conversation([globex], model)]


def test_the_session_routes_through_another_replica_run_on_the_owner(
    forward_pair: Pair,
    module_database_url: str,  # noqa: F811
) -> None:
    (a, b), keys, _ = forward_pair
    key = keys["acme"]
    auth = {"Authorization": f"Bearer {key}"}
    session_id = new_session(a, key)
    assert turn(a, key, session_id, MESSAGES[0])[1] == "new"
    assert turn(b, key, session_id, MESSAGES[1])[1] == "device"  # forwarded: a's device cache
    streamed = b.client.post(
        f"/v1/sessions/{session_id}/messages",
        json={"content": MESSAGES[2], "max_tokens": 12, "stream": True},
        headers=auth,
    )
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    frames = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert frames[-1]["object"] == "session.message" and frames[-1]["stats"]["restored_from"] == "device"
    assert streamed.text.endswith("data: [DONE]\n\n")
    fork = b.client.post(f"/v1/sessions/{session_id}/fork", json={"at_turn": 2}, headers=auth)
    assert fork.status_code == 201 and fork.json()["parent_id"] == session_id
    assert lease(module_database_url, fork.json()["id"])[0] == replica_id(a)  # made on a, from a's KV
    assert b.client.post(f"/v1/sessions/{session_id}/prefetch", headers=auth).status_code == 202
    assert lease(module_database_url, session_id) == (replica_id(a), 1)
    # A client that goes away, streamed or before an unstreamed answer starts, cancels a's turn.
    long = {"content": "Never mind.", "max_tokens": 3000}
    path = f"/v1/sessions/{session_id}/messages"
    with b.client.stream("POST", path, json={**long, "stream": True}, headers=auth) as answer:
        next(line for line in answer.iter_lines() if line.startswith("data:"))
    with pytest.raises(httpx.ReadTimeout):
        b.client.post(path, json=long, headers=auth, timeout=httpx.Timeout(30, read=1.0))
    assert turn_when_free(b, key, session_id, MESSAGES[3]) == "device"
    assert len(history(a, key, session_id)) == 8  # three turns and this one: nothing cancelled was stored


def turn_when_free(replica: Replica, api_key: str, session_id: str, content: str) -> str:
    """A turn, retried while the session is busy (a cancelled turn still letting it go); where its
    cache came from."""
    deadline = time.monotonic() + 10
    while (answer := replica.send(api_key, session_id, content)).status_code == 409:
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.1)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["stats"]["restored_from"])


def test_a_forwarded_request_is_never_forwarded_again_and_a_wrong_key_stops_at_the_first_replica(
    forward_pair: Pair,
    module_database_url: str,  # noqa: F811
) -> None:
    (a, b), keys, _ = forward_pair
    key = keys["acme"]
    session_id = new_session(a, key)
    turn(a, key, session_id, MESSAGES[0])
    forwards = counter(b, "chatkv_routes_total", route="forward")
    hop = {FORWARDED_BY_HEADER: replica_id(a)}
    refused = b.client.post(
        f"/v1/sessions/{session_id}/messages",
        json={"content": MESSAGES[1], "max_tokens": 12},
        headers={"Authorization": "Bearer not-a-key", **hop},
    )
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    # The marker authenticates nothing, and is not forwarded again: b takes the session over.
    answer = b.client.post(
        f"/v1/sessions/{session_id}/messages",
        json={"content": MESSAGES[1], "max_tokens": 12},
        headers={"Authorization": f"Bearer {key}", **hop},
    )
    assert answer.status_code == 200 and answer.json()["stats"]["restored_from"] == "redis"
    assert counter(b, "chatkv_routes_total", route="forward") == forwards
    assert lease(module_database_url, session_id) == (replica_id(b), 2)
    assert len(history(a, key, session_id)) == 4


def test_the_owner_killed_mid_forward_stores_no_turn_twice(
    forward_pair: Pair,
    tmp_path: Path,
    tiny_model_dir: Path,
    module_database_url: str,  # noqa: F811
) -> None:
    (a, _), keys, settings = forward_pair
    key = keys["acme"]
    with third_replica(tmp_path / "c", tiny_model_dir, settings, ownership_lease_s="3") as c:
        session_id = new_session(c, key)
        first = turn(c, key, session_id, MESSAGES[0])[0]
        wait_for_redis_copy(module_database_url, session_id, time.time())
        body = {"content": MESSAGES[1], "max_tokens": 3000, "stream": True}
        with a.client.stream(
            "POST", f"/v1/sessions/{session_id}/messages", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as response:
            assert response.status_code == 200
            lines = []
            with contextlib.suppress(httpx.TransportError):
                for line in response.iter_lines():
                    lines.append(line)
                    if len(lines) == 10:
                        c.kill()
        # An error, never a complete reply: c died mid-turn, before storing it.
        assert not any(line == "data: [DONE]" for line in lines)
        assert any("forward_failed" in line for line in lines), lines[-3:]
    assert history(a, key, session_id) == [MESSAGES[0], first]
    # The next turn through a: c cannot be reached, so a takes the session over once c's lease
    # has expired, from the copy c published to Redis.
    reply, source = turn(a, key, session_id, MESSAGES[1])
    assert source == "redis"
    assert history(a, key, session_id) == [MESSAGES[0], first, MESSAGES[1], reply]


def test_a_keyed_retry_after_the_owner_died_mid_forward_runs_once_the_owner_is_gone(
    forward_pair: Pair,
    tmp_path: Path,
    tiny_model_dir: Path,
    module_database_url: str,  # noqa: F811
) -> None:
    (a, _), keys, settings = forward_pair
    key = keys["acme"]
    headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": "owner-died"}
    with third_replica(tmp_path / "c", tiny_model_dir, settings, ownership_lease_s="3") as c:
        session_id = new_session(c, key)
        first = turn(c, key, session_id, MESSAGES[0])[0]
        wait_for_redis_copy(module_database_url, session_id, time.time())
        body = {"content": MESSAGES[1], "max_tokens": 3000, "stream": True}
        path = f"/v1/sessions/{session_id}/messages"
        with a.client.stream("POST", path, json=body, headers=headers) as response:
            assert response.status_code == 200
            lines = []
            with contextlib.suppress(httpx.TransportError):
                for line in response.iter_lines():
                    lines.append(line)
                    if len(lines) == 10:
                        c.kill()  # c claimed the key, and dies holding it
        assert any("forward_failed" in line for line in lines), lines[-3:]
    # The key's claim died with c: once c's heartbeat is a lease old, the same request runs (a
    # claim that outlived its process would answer 409 for 15 minutes).
    deadline = time.monotonic() + 60
    while (retried := a.client.post(path, json=body, headers=headers)).status_code == 409:
        assert retried.json()["error"]["code"] in ("idempotency_key_in_use", "session_busy"), retried.text
        assert time.monotonic() < deadline, retried.text
        time.sleep(0.2)
    assert retried.status_code == 200 and "idempotent-replayed" not in retried.headers
    assert retried.text.endswith("data: [DONE]\n\n")
    frames = [
        json.loads(line.removeprefix("data: ")) for line in retried.text.splitlines() if line.startswith("data: {")
    ]
    reply = frames[-1]["message"]["content"]
    assert history(a, key, session_id) == [MESSAGES[0], first, MESSAGES[1], reply]  # c stored nothing of its turn
    again = a.client.post(path, json=body, headers=headers)  # and now the answer is recorded
    assert again.headers["idempotent-replayed"] == "true"


def test_a_replica_stopped_under_load_finishes_its_turns_and_hands_its_sessions_over(
    forward_pair: Pair,
    tmp_path: Path,
    tiny_model_dir: Path,
    module_database_url: str,  # noqa: F811
) -> None:
    (a, b), keys, settings = forward_pair
    key = keys["acme"]
    auth = {"Authorization": f"Bearer {key}"}
    # A lease no test waits out: only a hand-over lets another replica run d's sessions in time.
    with third_replica(tmp_path / "d", tiny_model_dir, settings, ownership_lease_s="120") as d:
        sessions = [new_session(d, key) for _ in range(3)]
        for session_id in sessions:
            turn(d, key, session_id, MESSAGES[0])
        idle = sessions.pop()  # no turn in flight when d is stopped
        started = threading.Barrier(3, timeout=120)
        ends: dict[str, list[str]] = {}
        done_at: dict[str, float] = {}

        def stream(via: Replica, session_id: str) -> None:
            # Long enough (seconds of decoding here) to be running when the signal comes.
            body = {"content": MESSAGES[1], "max_tokens": 1200, "stream": True}
            with via.client.stream("POST", f"/v1/sessions/{session_id}/messages", json=body, headers=auth) as answer:
                lines = answer.iter_lines()
                ends[session_id] = [next(line for line in lines if line.startswith("data:"))]
                started.wait()
                ends[session_id] += list(lines)
                done_at[session_id] = time.monotonic()

        # One turn forwarded by a, one sent to d itself; SIGTERM once both are streaming.
        threads = [threading.Thread(target=stream, args=(via, s)) for via, s in zip((a, d), sessions, strict=True)]
        for thread in threads:
            thread.start()
        started.wait()
        d.process.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        # Draining, d publishes and releases its idle session at once, unasked, while its other
        # turns still run; a then takes it from Redis.
        deadline = time.monotonic() + 10
        while lease(module_database_url, idle)[0] is not None:
            assert time.monotonic() < deadline, "d kept its idle session"
            time.sleep(0.1)
        handed_at = time.monotonic()
        assert turn(a, key, idle, MESSAGES[1])[1] == "redis"
        for thread in threads:
            thread.join()
        assert d.process.wait(timeout=60) == 0
        for session_id in sessions:  # both complete, well after the signal: their reply, then the end
            assert "data: [DONE]" in ends[session_id] and '"object":"session.message"' in "".join(ends[session_id])
            assert done_at[session_id] > handed_at > signalled_at
    for session_id in sessions:
        assert lease(module_database_url, session_id)[0] is None  # published and released
    begun = time.monotonic()
    for via, session_id in zip((a, b), sessions, strict=True):
        assert turn(via, key, session_id, MESSAGES[2])[1] == "redis"
        assert len(history(via, key, session_id)) == 6
    assert time.monotonic() - begun < 30


def test_replicas_drain_makes_the_others_take_its_sessions_over(
    forward_pair: Pair,
    module_database_url: str,  # noqa: F811
) -> None:
    (a, b), keys, _ = forward_pair
    key = keys["acme"]
    session_id = new_session(b, key)
    turn(b, key, session_id, MESSAGES[0])
    assert admin_cli(a, "replicas", "drain", replica_id(b)) == {"id": replica_id(b), "draining": True}
    deadline = time.monotonic() + 20
    while b.client.get("/healthz").status_code != 503:  # b reads the mark with its next heartbeat
        assert time.monotonic() < deadline, "b never drained"
        time.sleep(0.2)
    listed = {r["id"]: r["state"] for r in admin_cli(a, "replicas")["replicas"]}
    assert (listed[replica_id(a)], listed[replica_id(b)]) == ("alive", "draining")
    # a hands b's session over rather than forward to it; b lets it go at once.
    assert turn(a, key, session_id, MESSAGES[1])[1] == "redis"
    assert lease(module_database_url, session_id) == (replica_id(a), 2)
    assert "replica not found: r_nope" in admin_cli_error(a, "replicas", "drain", "r_nope")


def admin_cli_error(replica: Replica, *args: str) -> str:
    """The one-line error of a `chatkv ARGS --server URL` that fails with exit code 2."""

    result = CliRunner().invoke(
        app, ["--home", str(replica.home), *args, "--server", replica.url], env=cli_environment()
    )
    assert result.exit_code == 2, (result.stdout, result.stderr)
    return str(result.stderr)
