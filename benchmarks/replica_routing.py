"""Stateless OpenAI clients spread over two replicas: forwarding each turn to its session's owner,
against handing the session over, against one replica (issue 20).

`--users` (8) simulated users (threads, each with its own official `openai` client) hold
`--turns` (6) turn conversations at the same time, the stateless way stock clients do: every
request posts the whole conversation so far, streamed (SSE), greedy, no `X-Session-ID`. User `u`
sends its turn `t` to replica `(u + t) % replicas`: every user alternates between the replicas,
and half the users start on each (a load balancer that spreads requests without affinity). Three
deployments on the same real default model, each on a fresh PostgreSQL schema (`--postgres-url`,
default the test server) and its own key prefix in one Redis (`--redis-url`), every replica a
real `chatkv serve` process with its own home, all started at once; the deployments take turns
(turn `t` of every user of one deployment at once, then of the next, in an order that rotates
with `t`), so a change in the machine's load falls on all three alike:

- **forward**:  two replicas, `CHATKV_ROUTING=forward` (the default): a turn that reaches the
                replica not owning its session is passed to the owner and streamed back;
- **handover**: two replicas, `CHATKV_ROUTING=handover` (before issue 20): the owner publishes the
                session's cache to Redis and releases it, the replica that got the turn restores it;
- **one replica**: the same users against one replica (the baseline of the TTFT ratio).

Reported per deployment:

- warm turns: turns after a user's first whose prompt was served from the session's own cache:
  `usage.prompt_tokens_details.cached_tokens` at least the previous turn's prompt tokens (the
  shared system-prompt base layer alone does not count); beside it where the replicas say each
  turn's cache came from (`chatkv_turns_total{restored_from}`: device, host, disk, redis, rebuilt);
- hand-overs: lease changes of the users' sessions, read from the shared database before the
  replicas stop (each lease's `epoch` counts its takes: epoch - 1 per session;
  `CHATKV_OWNERSHIP_IDLE_S` is set long enough that no idle release adds to it); beside it the
  turns each route took (`chatkv_routes_total{route}`: local, forward, handover, forward_failed);
- TTFT of the turns after the first as the client sees it (request sent to the first SSE chunk
  with content), p50 and p95 over every user's turns, and the p50 ratio to one replica; with forwarding
  also the p50 of the turns that reached the session's owner against the forwarded ones (the same
  deployment at the same moments: what the extra hop costs);
- whether every user's replies are identical across the deployments (greedy; batching can flip a
  near-tie, which is reported, not hidden), and turns that failed (an HTTP error ends that user's
  conversation; reported).

Then the Redis restore throughput at about 1,000 / 2,000 / 4,000 tokens, measured by
`redis_restore.py`'s own code (`measure_size`) for the variant the replicas use (chunks read
pipelined and opened as they arrive), with redis-py's hiredis parser when installed, after one
untimed warm-up size (a process's first restores run slower).

The replicas wait up to 120 s for a hand-over (`CHATKV_OWNERSHIP_WAIT_S`; the default 10 s can
pass on a loaded machine, and a 409 would end that user's conversation); everything else is the
product's default. `--log-dir` keeps their logs.

Targets (issue 20): >= 95% warm turns and 0 hand-overs while both replicas live; TTFT p50 within
1.3x of one replica. Nothing is asserted: the figures are printed as measured.

    .venv/bin/python benchmarks/replica_routing.py [--quick] [--threads 1]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import openai
import redis
from _common import (
    SYSTEM_PROMPT,
    base_parser,
    chatkv_server,
    fmt_mb,
    fmt_ratio,
    fmt_s,
    median,
    open_manager,
    p95,
    print_header,
    print_table,
    setup,
    stream_turn,
    temp_dir,
    user_message,
    write_json,
)
from openai import OpenAI
from redis.utils import HIREDIS_AVAILABLE
from redis_restore import VARIANTS, measure_size
from redis_restore import clients as redis_clients
from sqlalchemy import create_engine, select, text
from sqlalchemy.engine import Engine as SqlEngine
from sqlalchemy.exc import OperationalError

from sessions.engine import Engine
from storage.chunked_blobs import CHUNK_BYTES
from storage.schema import SessionOwnerRow

MiB = 1024 * 1024
DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@dataclass(frozen=True)
class Deployment:
    name: str
    replicas: int
    routing: str


DEPLOYMENTS = (
    Deployment("forward", 2, "forward"),
    Deployment("handover", 2, "handover"),
    Deployment("one replica", 1, "forward"),
)
BASELINE = "one replica"


@dataclass
class UserRun:
    """One simulated user's conversation and what each of its turns measured."""

    ttft_s: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)
    error: str | None = None


# -- the shared database and Redis ---------------------------------------------------------------


@contextlib.contextmanager
def fresh_schema(admin: SqlEngine) -> Iterator[str]:
    """The URL of a new, empty PostgreSQL schema (its `search_path`), dropped at the end."""
    schema = f"ckv_bench_{secrets.token_hex(6)}"
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = admin.url.render_as_string(hide_password=False)
    separator = "&" if "?" in url else "?"
    try:
        yield f"{url}{separator}options={quote(f'-csearch_path={schema}')}"
    finally:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


def delete_prefixed(redis_url: str, prefix: str) -> None:
    """Delete every key under `<prefix>:` (SCAN; never FLUSHALL on a shared server)."""
    client = redis.Redis.from_url(redis_url)
    try:
        for key in client.scan_iter(match=f"{prefix}:*"):
            client.delete(key)
    finally:
        client.close()


def lease_epochs(database_url: str, session_ids: set[str]) -> dict[str, int]:
    """Each session's lease epoch (1 + the times another take followed a release or an expiry)."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(select(SessionOwnerRow.session_id, SessionOwnerRow.epoch)).all()
    finally:
        engine.dispose()
    return {str(session_id): int(epoch) for session_id, epoch in rows if str(session_id) in session_ids}


def counters(base_url: str, name: str, label: str) -> dict[str, float]:
    """One counter of a replica's `/metrics`, by the value of `label`."""
    values: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line.rpartition(" ")
            marker = f'{label}="'
            if marker in labels:
                key = labels.split(marker, 1)[1].split('"', 1)[0]
                values[key] = values.get(key, 0.0) + float(value)
    return values


def summed(per_replica: list[dict[str, float]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for values in per_replica:
        for key, value in values.items():
            total[key] = total.get(key, 0) + round(value)
    return total


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


# -- replicas and users ----------------------------------------------------------------------------


@dataclass
class Live:
    """A deployment while it runs: its database, key prefix, tenant key and replicas."""

    deployment: Deployment
    folder: Path
    database_url: str
    prefix: str
    key: str
    model: str
    settings: dict[str, str]
    runs: list[UserRun]
    conversations: list[list[dict[str, str]]]
    urls: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def bases(self) -> list[str]:
        return [url.removesuffix("/v1") for url in self.urls]

    def counted(self, name: str, label: str) -> dict[str, int]:
        return summed([counters(base, name, label) for base in self.bases])


def prepare(
    deployment: Deployment,
    engine: Engine,
    admin: SqlEngine,
    root: Path,
    args: argparse.Namespace,
    stack: contextlib.ExitStack,
) -> Live:
    """A fresh schema and key prefix for `deployment` (removed when `stack` closes, after the
    replicas' logs are kept) and its tenant."""
    prefix = f"ckvbench-{secrets.token_hex(4)}"
    folder = root / deployment.name.replace(" ", "-")
    database_url = stack.enter_context(fresh_schema(admin))
    stack.callback(delete_prefixed, args.redis_url, prefix)
    if args.log_dir is not None:
        stack.callback(keep_logs, folder, args.log_dir)
    shared = {"database_url": database_url, "redis_url": args.redis_url, "redis_prefix": prefix}
    with open_manager(folder / "admin-home", engine, args.model_cache_dir, **shared) as manager:
        key = manager.issue_api_key(manager.create_tenant("bench"))
        model = manager.model_name
    settings = {
        "CHATKV_DATABASE_URL": database_url,
        "CHATKV_REDIS_URL": args.redis_url,
        "CHATKV_REDIS_PREFIX": prefix,
        "CHATKV_ROUTING": deployment.routing,
        # A hand-over waits for the owner's turn to end; on a loaded machine that can take longer
        # than the default 10 s, and a 409 would end the user's conversation.
        "CHATKV_OWNERSHIP_WAIT_S": "120",
        # No idle release during the run: every lease change counted is a hand-over.
        "CHATKV_OWNERSHIP_IDLE_S": "3600",
    }
    users = range(args.users)
    conversations = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in users]
    runs = [UserRun() for _ in users]
    return Live(deployment, folder, database_url, prefix, key, model, settings, runs, conversations)


def keep_logs(folder: Path, log_dir: Path) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    for log in folder.glob("replica*.log"):
        shutil.copy(log, log_dir / f"{folder.name}-{log.name}")


@contextlib.contextmanager
def started_replicas(lives: list[Live], args: argparse.Namespace) -> Iterator[None]:
    """`chatkv serve` for every replica of every deployment, started side by side (the model loads
    take most of the start), their `/v1` URLs put in `Live.urls`; every started one is stopped
    (SIGTERM: it drains) at the end."""
    homes = [(live, live.folder / f"replica{i}") for live in lives for i in range(live.deployment.replicas)]
    servers = [chatkv_server(home, args, live.settings, home.parent / f"{home.name}.log") for live, home in homes]
    with contextlib.ExitStack() as stack:
        with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
            futures = [pool.submit(server.__enter__) for server in servers]
        for server, future in zip(servers, futures, strict=True):
            if future.exception() is None:
                stack.push(server)
        for (live, _), future in zip(homes, futures, strict=True):
            live.urls.append(future.result())  # re-raises a failed start, after the others stop
        yield


def wave(live: Live, turn_index: int, messages: list[list[str]], args: argparse.Namespace) -> None:
    """Turn `turn_index` of every user of `live` at once (a barrier starts them together); user
    `u` sends it to replica `(u + turn_index) % replicas`. A user whose turn fails stops there."""
    start = threading.Barrier(len(messages) + 1)

    def user(index: int) -> None:
        run, conversation = live.runs[index], live.conversations[index]
        url = live.urls[(index + turn_index) % len(live.urls)]
        client = OpenAI(base_url=url, api_key=live.key, max_retries=0, timeout=600)
        start.wait()
        if run.error is not None:
            return
        conversation.append({"role": "user", "content": messages[index][turn_index]})
        try:
            turn = stream_turn(client, live.model, conversation, args.max_tokens)
        except openai.APIError as exc:  # reported with the results; the conversation cannot go on
            run.error = f"turn {turn_index}: {type(exc).__name__}: {exc}"
            return
        conversation.append({"role": "assistant", "content": turn["text"]})
        run.ttft_s.append(turn["ttft_s"])
        run.cached_tokens.append(turn["cached_tokens"])
        run.prompt_tokens.append(turn["prompt_tokens"])
        run.replies.append(turn["text"])
        run.sessions.append(turn["session_id"])

    threads = [threading.Thread(target=user, args=(i,)) for i in range(len(messages))]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    live.wall_s += time.perf_counter() - began


def run_all(lives: list[Live], messages: list[list[str]], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every deployment's users, turn by turn, the deployments interleaved (a rotating order per
    turn), so a change in the machine's load falls on all of them alike; what each measured."""
    for live in lives:
        for i, url in enumerate(live.urls):  # kernels, allocator; a session no user posts
            warm = OpenAI(base_url=url, api_key=live.key, max_retries=0, timeout=600)
            stream_turn(warm, live.model, [{"role": "user", "content": f"Warm up {i}."}], 4)
    routes0 = [live.counted("chatkv_routes_total", "route") for live in lives]
    sources0 = [live.counted("chatkv_turns_total", "restored_from") for live in lives]
    for turn_index in range(args.turns):
        began = time.perf_counter()
        for k in range(len(lives)):
            wave(lives[(turn_index + k) % len(lives)], turn_index, messages, args)
        print(f"  turn {turn_index}: {fmt_s(time.perf_counter() - began)} (every deployment)", flush=True)
    results = {}
    for live, r0, s0 in zip(lives, routes0, sources0, strict=True):
        epochs = lease_epochs(live.database_url, {s for r in live.runs for s in r.sessions})
        results[live.deployment.name] = {
            "deployment": live.deployment,
            "runs": live.runs,
            "wall_s": live.wall_s,
            "routes": delta(live.counted("chatkv_routes_total", "route"), r0),
            "restored_from": delta(live.counted("chatkv_turns_total", "restored_from"), s0),
            "epochs": epochs,
            "handovers": sum(epoch - 1 for epoch in epochs.values()),
        }
    return results


# -- reporting ---------------------------------------------------------------------------------------


def warm_turns(runs: list[UserRun]) -> tuple[int, int]:
    """(warm, eligible): turns after a user's first whose cached prompt tokens cover the previous
    turn's whole prompt."""
    warm = eligible = 0
    for run in runs:
        for t in range(1, len(run.cached_tokens)):
            eligible += 1
            warm += run.cached_tokens[t] >= run.prompt_tokens[t - 1]
    return warm, eligible


def follow_up_ttfts(runs: list[UserRun]) -> list[float]:
    return [s for run in runs for s in run.ttft_s[1:]]


def fmt_counts(values: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(values.items())) or "-"


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    base_p50 = median(follow_up_ttfts(results[BASELINE]["runs"]))
    rows = []
    for name, result in results.items():
        runs: list[UserRun] = result["runs"]
        warm, eligible = warm_turns(runs)
        ttfts = follow_up_ttfts(runs)
        deployment: Deployment = result["deployment"]
        rows.append(
            [
                name,
                deployment.replicas,
                deployment.routing if deployment.replicas > 1 else "-",
                f"{warm}/{eligible} ({100 * warm / eligible:.0f}%)" if eligible else "-",
                result["handovers"],
                fmt_s(median(ttfts)),
                fmt_s(p95(ttfts)),
                fmt_ratio(median(ttfts) / base_p50),
                sum(r.error is not None for r in runs),
                fmt_s(result["wall_s"]),
            ]
        )
    print_table(
        "per deployment: turns after each user's first (TTFT: request to first content chunk)",
        [
            *["deployment", "replicas", "routing", "warm turns", "hand-overs", "TTFT p50", "TTFT p95"],
            *[f"p50 / {BASELINE}", "failed users", "wall"],
        ],
        rows,
    )
    print_table(
        "what the replicas counted during the users' turns (all turns, the first ones included)",
        ["deployment", "cache came from (chatkv_turns_total)", "routes (chatkv_routes_total)"],
        [[name, fmt_counts(r["restored_from"]), fmt_counts(r["routes"])] for name, r in results.items()],
    )
    turns = max(len(run.ttft_s) for r in results.values() for run in r["runs"])
    per_turn = []
    for t in range(turns):
        row: list[object] = [t]
        for result in results.values():
            at = [run.ttft_s[t] for run in result["runs"] if len(run.ttft_s) > t]
            row.append(fmt_s(median(at)) if at else "-")
        per_turn.append(row)
    print_table("TTFT p50 over users, per turn", ["turn", *[f"{name} p50" for name in results]], per_turn)

    for name, result in results.items():
        for index, run in enumerate(result["runs"]):
            if run.error:
                print(f"{name}: user {index} stopped at {run.error}")
            if len(set(run.sessions)) > 1:
                print(f"{name}: WARNING user {index}'s turns continued {len(set(run.sessions))} sessions")
    for name, result in results.items():
        if result["deployment"].replicas == 2 and result["deployment"].routing == "forward":
            # A session is made where its user's first turn lands and stays there when forwarded,
            # so turn t reaches the owner when t is even and is forwarded when t is odd.
            on_owner = [s for run in result["runs"] for t, s in enumerate(run.ttft_s) if t and t % 2 == 0]
            elsewhere = [s for run in result["runs"] for t, s in enumerate(run.ttft_s) if t % 2 == 1]
            if on_owner and elsewhere:
                print(
                    f"{name}: TTFT p50 of the turns that reached the session's owner {fmt_s(median(on_owner))}, "
                    f"of the forwarded ones {fmt_s(median(elsewhere))} "
                    f"({fmt_ratio(median(elsewhere) / median(on_owner))})"
                )
    baseline = results[BASELINE]["runs"]
    for name, result in results.items():
        if name == BASELINE:
            continue
        same = sum(a.replies == b.replies for a, b in zip(result["runs"], baseline, strict=True))
        verdict = "yes" if same == len(baseline) else f"WARNING: {len(baseline) - same} of {len(baseline)} users differ"
        print(f"replies identical, {name} vs {BASELINE}: {verdict}")
    print()
    for name in (d.name for d in DEPLOYMENTS if d.replicas > 1):
        result = results[name]
        warm, eligible = warm_turns(result["runs"])
        ratio = median(follow_up_ttfts(result["runs"])) / base_p50
        print(
            f"{name}: warm {100 * warm / max(eligible, 1):.0f}% (target >= 95%), hand-overs {result['handovers']} "
            f"(target 0), TTFT p50 {ratio:.2f}x one replica (target <= 1.3x)"
        )


def redis_restore_rates(engine: Engine, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Restore MB/s of the variant the replicas use, by `redis_restore.measure_size`."""
    variant = next(v for v in VARIANTS if v[1] == CHUNK_BYTES and v[2])
    restore_args = argparse.Namespace(
        model_cache_dir=args.model_cache_dir,
        repeats=args.restore_repeats,
        redis_url=args.redis_url,
        redis_cluster=False,
        parsers="hiredis" if HIREDIS_AVAILABLE else "python",
    )
    by_parser = redis_clients(restore_args)
    try:
        # The first restores of a process run markedly slower (allocator, first large buffers):
        # one untimed size first, as redis_restore.py's other variants precede this one there.
        print("  warm-up, not reported:", flush=True)
        measure_size(engine, argparse.Namespace(**{**vars(restore_args), "repeats": 1}), 1000, by_parser, [variant])
        records = []
        for size in args.restore_sizes:
            records += measure_size(engine, restore_args, size, by_parser, [variant])
    finally:
        for client in by_parser.values():
            client.close()
    print_table(
        f"Redis restore ({variant[0]}, {restore_args.parsers} parser, {args.restore_repeats} timings; "
        "MB/s = sealed blob bytes / seconds)",
        ["tokens", "blob", "restore p50", "best", "MB/s p50", "MB/s best"],
        [
            [
                r["tokens"],
                fmt_mb(r["blob_bytes"]),
                f"{median(r['restore_s']) * 1000:.0f} ms",
                f"{min(r['restore_s']) * 1000:.0f} ms",
                f"{r['restore_mb_s_median']:.0f}",
                f"{r['restore_mb_s_best']:.0f}",
            ]
            for r in records
        ],
    )
    return records


def main() -> None:
    parser = base_parser((__doc__ or "").splitlines()[0])
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--user-tokens", type=int, default=None, help="tokens per user message (60; --quick 12)")
    parser.add_argument("--max-tokens", type=int, default=None, help="most tokens per reply (48; --quick 16)")
    parser.add_argument(
        "--postgres-url",
        default=DEFAULT_POSTGRES_URL,
        help="a PostgreSQL database the benchmark may create (and drops) schemas in",
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the replicas' shared Redis")
    parser.add_argument("--restore-sizes", default="1000,2000,4000", help="history tokens of the Redis restore rows")
    parser.add_argument("--restore-repeats", type=int, default=None, help="timings per size (default 5; --quick 3)")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the replicas' logs here")
    args = parser.parse_args()
    args.user_tokens = args.user_tokens or (12 if args.quick else 60)
    args.max_tokens = args.max_tokens or (16 if args.quick else 48)
    args.restore_repeats = args.restore_repeats or (3 if args.quick else 5)
    args.restore_sizes = [int(s) for s in args.restore_sizes.split(",")]
    admin = create_engine(args.postgres_url, pool_pre_ping=True, connect_args={"connect_timeout": 5})
    try:
        with admin.connect() as connection:
            version = connection.execute(text("SHOW server_version")).scalar()
    except OperationalError as exc:
        raise SystemExit(f"PostgreSQL at {args.postgres_url} does not answer: {exc.orig}") from None
    try:
        redis_version = redis.Redis.from_url(args.redis_url, socket_timeout=5).info("server")["redis_version"]
    except redis.RedisError as exc:
        raise SystemExit(f"Redis at {args.redis_url} does not answer: {exc}") from None
    engine = setup(args)
    print_header(
        "chatkv: stateless clients over two replicas, forwarding vs hand-over vs one replica",
        engine,
        [
            f"{args.users} users x {args.turns} turns at once, stateless streaming clients (official openai package, "
            f"no X-Session-ID), ~{args.user_tokens}-token messages, replies <= {args.max_tokens} tokens, greedy; "
            "user u sends turn t to replica (u + t) % replicas",
            f"each deployment: real chatkv serve processes (server torch threads: {args.threads or 'default'}), "
            f"a fresh schema on PostgreSQL {version}, a fresh key prefix on Redis {redis_version} ({args.redis_url})",
        ],
    )
    # Each user signs its messages, so no two users post the same history (they would share a session).
    messages = [
        [f"User {u}: {user_message(engine, u * args.turns + t, args.user_tokens)}" for t in range(args.turns)]
        for u in range(args.users)
    ]
    try:
        with temp_dir("replica-routing") as root, contextlib.ExitStack() as stack:
            lives = [prepare(deployment, engine, admin, root, args, stack) for deployment in DEPLOYMENTS]
            began = time.perf_counter()
            print(f"\nstarting {sum(d.replicas for d in DEPLOYMENTS)} replicas ...", flush=True)
            with started_replicas(lives, args):
                print(f"  started in {fmt_s(time.perf_counter() - began)}", flush=True)
                results = run_all(lives, messages, args)
    finally:
        admin.dispose()
    report(results, args)
    restores = redis_restore_rates(engine, args)
    write_json(
        args.json,
        {
            "benchmark": "replica_routing",
            "deployments": {
                name: {
                    "replicas": r["deployment"].replicas,
                    "routing": r["deployment"].routing,
                    "wall_s": r["wall_s"],
                    "handovers": r["handovers"],
                    "lease_epochs": r["epochs"],
                    "routes": r["routes"],
                    "restored_from": r["restored_from"],
                    "users": [
                        {
                            "ttft_s": u.ttft_s,
                            "cached_tokens": u.cached_tokens,
                            "prompt_tokens": u.prompt_tokens,
                            "replies": u.replies,
                            "error": u.error,
                        }
                        for u in r["runs"]
                    ],
                }
                for name, r in results.items()
            },
            "redis_restore": restores,
        },
        engine,
    )


if __name__ == "__main__":
    main()
