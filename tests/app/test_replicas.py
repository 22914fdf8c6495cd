"""Replicas past one machine, with real processes and real services: two `chatkv serve` processes,
each with its own home, on one PostgreSQL schema, one Redis (or Redis Cluster) and one master key.

One session's turns alternate between the replicas and equal a single replica's replies, each turn
after the first restoring its cache from Redis; a replica killed between turns or in the middle of
a turn loses no committed message and the other continues the session after its lease expires;
tenants stay apart, a value copied between sessions' Redis keys is rejected, and a flushed or
stopped Redis costs rebuilds, never a failed turn. Replies of the tiny random model are compared
with those of one replica alone (same weights, same thread count: greedy decoding is exact)."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import Connection, Engine, select
from typer.testing import CliRunner

from app.cli import app
from sessions.engine import Engine as ModelEngine
from sessions.manager import SessionManager
from storage.database import open_database
from storage.schema import CacheBlobRow, SessionOwnerRow
from tests.app.replica_processes import Replica, replicas
from tests.conftest import cli_environment, make_settings
from tests.redis_servers import RedisServer, delete_prefixed
from tests.storage.conftest import fresh_schema, postgres_admin  # noqa: F401  (fixture)

LEASE_S = 3.0
MESSAGES = ["Hello there", "What is two plus two?", "Tell me more about it", "And then what?"]
SYSTEM = "You are terse."


@pytest.fixture
def database_url(postgres_admin: Engine) -> Iterator[str]:  # noqa: F811
    yield from fresh_schema(postgres_admin)


@pytest.fixture(scope="module")
def module_database_url(postgres_admin: Engine) -> Iterator[str]:  # noqa: F811
    yield from fresh_schema(postgres_admin)


@pytest.fixture(scope="module")
def module_redis_prefix(redis_url: str) -> Iterator[str]:
    prefix = f"ckvtest-{secrets.token_hex(6)}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        delete_prefixed(client, prefix)
    finally:
        client.close()


def replica_settings(database_url: str, redis_url: str, prefix: str, **more: str) -> dict[str, str]:
    """Replicas that hand sessions over (the tests of forwarding to the owner, the default, are
    `tests/app/test_replica_forwarding.py`)."""
    return {
        "routing": "handover",
        "database_url": database_url,
        "redis_url": redis_url,
        "redis_prefix": prefix,
        "ownership_lease_s": str(LEASE_S),
        "ownership_wait_s": "20",
        "ownership_idle_s": "120",
        **more,
    }


def make_tenants(tmp_path: Path, engine: ModelEngine, settings: dict[str, str]) -> dict[str, str]:
    """Tenants `acme` and `globex` with API keys, created in the shared database."""
    keys = {}
    overrides = {k: v for k, v in settings.items() if k in ("database_url", "redis_url", "redis_prefix")}
    with SessionManager(make_settings(tmp_path / "admin-home", **overrides), engine=engine) as manager:
        for name in ("acme", "globex"):
            keys[name] = manager.issue_api_key(manager.create_tenant(name))
    return keys


def new_session(replica: Replica, api_key: str) -> str:
    response = replica.client.post(
        "/v1/sessions", json={"system_prompt": SYSTEM}, headers={"Authorization": f"Bearer {api_key}"}
    )
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def turn(replica: Replica, api_key: str, session_id: str, content: str) -> tuple[str, str]:
    """One turn; its reply text and where its cache came from."""
    response = replica.send(api_key, session_id, content)
    assert response.status_code == 200, response.text
    body = response.json()
    return body["message"]["content"], body["stats"]["restored_from"]


def logs_of(*started: Replica) -> str:
    """The replicas' logs, for an assertion message (why a turn rebuilt instead of restoring)."""
    return "\n".join(f"--- {r.url}\n{r.log.read_text()}" for r in started)


def history(replica: Replica, api_key: str, session_id: str) -> list[str]:
    response = replica.client.get(f"/v1/sessions/{session_id}", headers={"Authorization": f"Bearer {api_key}"})
    assert response.status_code == 200, response.text
    return [m["content"] for m in response.json()["messages"]]


def reference(replica: Replica, api_key: str, contents: list[str]) -> list[str]:
    """The replies of one replica alone to `contents`, on a new session."""
    session_id = new_session(replica, api_key)
    return [turn(replica, api_key, session_id, content)[0] for content in contents]


def wait_until(database_url: str, done: Callable[[Connection], bool], what: str) -> None:
    """Poll the shared database (every 0.1 s, up to 30 s) until `done(connection)`."""
    engine = open_database(database_url)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with engine.connect() as connection:
                if done(connection):
                    return
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting until {what}")
    finally:
        engine.dispose()


def wait_for_redis_copy(database_url: str, session_id: str, after: float) -> None:
    """Until the session's cache is published to Redis by a write that recorded its row at or after
    `after` (Unix s): the write-back of a turn answered just before `after` runs after the answer."""

    def published(connection: Connection) -> bool:
        created = connection.execute(
            select(CacheBlobRow.created_at).where(CacheBlobRow.name == session_id, CacheBlobRow.location == "redis")
        ).scalar_one_or_none()
        return created is not None and created.timestamp() >= after

    wait_until(database_url, published, f"session {session_id} is published to Redis")


def wait_for_release(database_url: str, session_id: str) -> None:
    """Until no replica holds the session's ownership lease (it was published and released)."""

    def released(connection: Connection) -> bool:
        owner = connection.execute(
            select(SessionOwnerRow.replica_id).where(SessionOwnerRow.session_id == session_id)
        ).scalar_one_or_none()
        return owner is None

    wait_until(database_url, released, f"session {session_id} is released")


SMALL_BUDGET_BYTES = 300_000


@pytest.fixture(scope="module")
def shared_pair(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    tiny_engine: ModelEngine,
    module_database_url: str,
    redis_url: str,
    module_redis_prefix: str,
) -> Iterator[tuple[list[Replica], dict[str, str]]]:
    """Two replicas the tests of this module share (none of them kills one), with small device
    and host budgets so that caches keep moving between the tiers."""
    root = tmp_path_factory.mktemp("shared-pair")
    budgets = {"device_budget_bytes": str(SMALL_BUDGET_BYTES), "host_budget_bytes": str(SMALL_BUDGET_BYTES)}
    # No test of this module kills a replica, so nothing waits for a lease to expire: a longer
    # lease keeps a keeper thread that a loaded machine stalls for seconds from losing one.
    settings = replica_settings(module_database_url, redis_url, module_redis_prefix, ownership_lease_s="15", **budgets)
    keys = make_tenants(root, tiny_engine, settings)
    with replicas(root, str(tiny_model_dir), settings) as started:
        yield started, keys


@pytest.fixture
def pair(
    tmp_path: Path, tiny_model_dir: Path, tiny_engine: ModelEngine, database_url: str, redis_url: str, redis_prefix: str
) -> Iterator[tuple[list[Replica], dict[str, str]]]:
    """Two replicas of one test alone (it kills one)."""
    settings = replica_settings(database_url, redis_url, redis_prefix)
    keys = make_tenants(tmp_path, tiny_engine, settings)
    with replicas(tmp_path, str(tiny_model_dir), settings) as started:
        yield started, keys


def test_turns_alternating_between_replicas_equal_one_replica_and_restore_from_redis(
    shared_pair: tuple[list[Replica], dict[str, str]], module_database_url: str
) -> None:
    (a, b), keys = shared_pair
    key = keys["acme"]
    session_id = new_session(a, key)
    replies, sources = [], []
    for index, content in enumerate(MESSAGES):
        reply, source = turn((a, b)[index % 2], key, session_id, content)
        replies.append(reply)
        sources.append(source)
    assert sources == ["new", "redis", "redis", "redis"], logs_of(a, b)
    assert replies == reference(a, key, MESSAGES)
    assert history(b, key, session_id) == [m for pair_ in zip(MESSAGES, replies, strict=True) for m in pair_]
    # One lease row; its epoch grew with every hand-over (A, B, A, B, and A again for the reference).
    engine = open_database(module_database_url)
    try:
        with engine.connect() as connection:
            owners = connection.execute(
                select(SessionOwnerRow.epoch, SessionOwnerRow.last_owner).where(
                    SessionOwnerRow.session_id == session_id
                )
            ).all()
    finally:
        engine.dispose()
    assert len(owners) == 1 and owners[0][0] == len(MESSAGES)
    inspected = admin_cli(b, "sessions", "inspect", session_id, "--tenant", "acme")
    # The fourth turn ran on b, which still holds the session (it is not idle long enough to let go).
    assert (inspected["owner"], inspected["owner_url"], inspected["redis_copy"]) == (replica_id(b), b.url, True)
    # Liveness and cache bytes come with heartbeats (every lease_s / 3), so the listing lags the
    # turns by up to one heartbeat, more on a loaded machine: poll it for a bounded time.
    deadline = time.monotonic() + 30
    while True:
        listed = admin_cli(a, "replicas")["replicas"]
        ours = [r for r in listed if r["url"] in (a.url, b.url)]
        if len(ours) == 2 and all(r["alive"] and r["cache_bytes"] > 0 for r in ours):
            break
        assert time.monotonic() < deadline, f"replicas never all alive with cache bytes: {listed}"
        time.sleep(0.5)


def admin_cli(replica: Replica, *args: str) -> Any:
    """`chatkv ARGS --json --server URL` against the replica's admin API (its home's admin token)."""
    env = cli_environment()
    result = CliRunner().invoke(app, ["--home", str(replica.home), *args, "--json", "--server", replica.url], env=env)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return json.loads(result.stdout)


def replica_id(replica: Replica) -> str:
    return (replica.home / "replica.id").read_text().strip()


def test_tenants_stay_apart_through_either_replica(shared_pair: tuple[list[Replica], dict[str, str]]) -> None:
    (a, b), keys = shared_pair
    session_id = new_session(a, keys["acme"])
    turn(a, keys["acme"], session_id, MESSAGES[0])
    for replica in (a, b):
        assert replica.send(keys["globex"], session_id, "let me in").status_code == 404
        got = replica.client.get(f"/v1/sessions/{session_id}", headers={"Authorization": f"Bearer {keys['globex']}"})
        assert got.status_code == 404
    assert history(b, keys["acme"], session_id)[0] == MESSAGES[0]


def test_a_value_copied_to_another_sessions_redis_key_is_rejected_and_rebuilt(
    shared_pair: tuple[list[Replica], dict[str, str]], module_database_url: str, redis_url: str
) -> None:
    (a, b), keys = shared_pair
    database_url = module_database_url
    key = keys["acme"]
    first, second = new_session(a, key), new_session(a, key)
    started = time.time()
    replies = {}
    for session_id in (first, second):
        replies[session_id] = [turn(a, key, session_id, MESSAGES[0])[0]]
        wait_for_redis_copy(database_url, session_id, started)
    client = redis.Redis.from_url(redis_url)
    try:
        names = {s: [k for k in client.scan_iter(match=f"*{{{s}}}")] for s in (first, second)}
        assert len(names[first]) == 1 and len(names[second]) == 1
        client.set(names[second][0], client.get(names[first][0]) or b"")  # first's blob under second's key
    finally:
        client.close()
    reply, source = turn(b, key, second, MESSAGES[1])  # b has no local copy: it must read Redis
    assert source == "rebuilt"
    assert [replies[second][0], reply] == reference(b, key, MESSAGES[:2])
    metrics = b.client.get("/metrics").text
    assert any(
        line.startswith("chatkv_integrity_failures_total{") and 'tier="redis"' in line and "replica=" in line
        for line in metrics.splitlines()
    ), metrics


def test_many_threads_over_two_replicas_keep_every_session_whole(
    shared_pair: tuple[list[Replica], dict[str, str]],
) -> None:
    (a, b), keys = shared_pair
    sessions = [(keys[name], new_session(a, keys[name])) for name in ("acme", "globex") for _ in range(3)]
    sent: dict[str, list[str]] = {sid: [] for _, sid in sessions}
    errors: list[str] = []

    def chat(api_key: str, session_id: str, worker: int) -> None:
        for index in range(4):
            content = f"{session_id} message {index}"
            response = (a, b)[(worker + index) % 2].send(api_key, session_id, content)
            if response.status_code != 200:
                errors.append(response.text)
                return
            sent[session_id] += [content, response.json()["message"]["content"]]

    threads = [threading.Thread(target=chat, args=(k, s, i)) for i, (k, s) in enumerate(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for api_key, session_id in sessions:
        assert history(a, api_key, session_id) == sent[session_id]
    for replica in (a, b):
        metrics = replica.client.get("/metrics").text
        assert _gauge(metrics, "chatkv_tier_bytes", 'tier="device"') <= SMALL_BUDGET_BYTES
        assert _gauge(metrics, "chatkv_tier_bytes", 'tier="host"') <= SMALL_BUDGET_BYTES


def _gauge(metrics: str, name: str, label: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {label} not in /metrics")


def test_a_replica_killed_between_turns_is_taken_over_from_redis(
    pair: tuple[list[Replica], dict[str, str]], database_url: str
) -> None:
    (a, b), keys = pair
    key = keys["acme"]
    session_id = new_session(a, key)
    replies = [turn(a, key, session_id, content)[0] for content in MESSAGES[:2]]
    wait_for_redis_copy(database_url, session_id, time.time())  # the second turn's copy
    a.kill()
    started = time.monotonic()
    reply, source = turn(b, key, session_id, MESSAGES[2])
    assert time.monotonic() - started < LEASE_S + 10
    assert source == "redis", logs_of(a, b)
    assert [*replies, reply] == reference(b, key, MESSAGES[:3])
    assert len(history(b, key, session_id)) == 6


def test_a_replica_killed_in_the_middle_of_a_turn_loses_no_committed_message(
    pair: tuple[list[Replica], dict[str, str]],
) -> None:
    (a, b), keys = pair
    key = keys["acme"]
    session_id = new_session(a, key)
    first = turn(a, key, session_id, MESSAGES[0])[0]
    with a.client.stream(
        "POST",
        f"/v1/sessions/{session_id}/messages",
        json={"content": MESSAGES[1], "max_tokens": 3000, "stream": True},
        headers={"Authorization": f"Bearer {key}"},
    ) as response:
        assert response.status_code == 200
        received = 0
        for line in response.iter_lines():
            received += line.startswith("data:")
            if received >= 5:
                break
        a.kill()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{a.url}/healthz")
    assert history(b, key, session_id) == [MESSAGES[0], first]
    reply, source = turn(b, key, session_id, MESSAGES[1])
    assert source in ("redis", "rebuilt")
    assert [first, reply] == reference(b, key, MESSAGES[:2])


def test_replicas_on_a_redis_cluster_alternate_and_take_over(
    tmp_path: Path,
    tiny_model_dir: Path,
    tiny_engine: ModelEngine,
    database_url: str,
    redis_cluster_url: str,
    redis_cluster_prefix: str,
) -> None:
    settings = replica_settings(database_url, redis_cluster_url, redis_cluster_prefix, redis_cluster="1")
    keys = make_tenants(tmp_path, tiny_engine, settings)
    key = keys["acme"]
    with replicas(tmp_path, str(tiny_model_dir), settings) as (a, b):
        session_id = new_session(a, key)
        results = [turn((a, b)[i % 2], key, session_id, content) for i, content in enumerate(MESSAGES[:3])]
        assert [source for _, source in results] == ["new", "redis", "redis"], logs_of(a, b)
        wait_for_redis_copy(database_url, session_id, time.time())  # the third turn's copy
        a.kill()  # a holds the session after the third turn
        reply, source = turn(b, key, session_id, MESSAGES[3])
        assert source == "redis", logs_of(a, b)
        assert [r for r, _ in results] + [reply] == reference(b, key, MESSAGES)


def test_a_flushed_or_stopped_redis_costs_a_rebuild_never_a_turn(
    tmp_path: Path,
    tiny_model_dir: Path,
    tiny_engine: ModelEngine,
    database_url: str,
    private_redis: RedisServer,
) -> None:
    # Sessions idle for a second are published and released, so the flush below hits a session that
    # no replica holds (an owner handing over after the flush would just publish it again).
    settings = replica_settings(database_url, private_redis.url, "ckv", ownership_idle_s="1")
    keys = make_tenants(tmp_path, tiny_engine, settings)
    key = keys["acme"]
    with replicas(tmp_path, str(tiny_model_dir), settings) as (a, b):
        session_id = new_session(a, key)
        replies = [turn(a, key, session_id, MESSAGES[0])[0]]
        wait_for_release(database_url, session_id)
        client = private_redis.client()
        client.flushall()
        client.close()
        reply, source = turn(b, key, session_id, MESSAGES[1])
        assert source == "rebuilt"
        replies.append(reply)
        private_redis.stop()
        for index, replica in ((2, a), (3, b)):
            reply, source = turn(replica, key, session_id, MESSAGES[index])
            assert source == "rebuilt"
            replies.append(reply)
        assert replies == reference(a, key, MESSAGES)
        assert len(history(b, key, session_id)) == 2 * len(MESSAGES)
