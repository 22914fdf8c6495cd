"""Restore throughput of a session cache from Redis: one value read by one GET (before issue 20)
against the chunked blob read pipelined and opened as its chunks arrive (issue 20).

For histories of about 1,000, 2,000 and 4,000 tokens (real default model; one session whose cache
is built by one turn), the session's device cache is sealed with chatkv's own sealer and stored
in Redis (`--redis-url`, default the local one, under a throw-away key prefix) through chatkv's
Redis store, then restored the way a replica restores it: the store reads, the sealer decrypts and
decodes onto the device (`EncryptedCacheSealer.open_session`; the base layer is not part of it).
Variants, each timed `--repeats` times (median and best; the machine may be shared):

- single GET:      the blob sealed whole (as before chunking: one AES-GCM over the payload),
                   stored as one value; `get` (one GET) then open. Blobs of that format still
                   open, so this is the old path on the same code and the same machine.
- chunked, joined: the chunked blob read whole (every chunk fetched, then joined) and then opened:
                   pipelining without the overlap.
- chunked, streamed (1 / 2 / 4 MiB chunks): what the restore does: `SharedBlobStore.read` hands
                   each chunk to the sealer as it arrives, received from the socket straight into
                   a buffer the store reuses (issue 32), which decrypts it into place (a payload
                   buffer mapped for it) while Redis sends the next ones.
- 2 MiB streamed, before issue 32: the same with each chunk read by redis-py's reply parser (a new
                   `bytes` per chunk) and decrypted into a `bytearray`, as before issue 32 (the
                   two module functions swapped back for this row only: `before_issue_32`).

Each with redis-py's pure-Python reply parser and with hiredis (a C extension redis-py uses when
it is installed; `--parsers`; chunks bypass it since issue 32, so it matters for the manifest and
the rows before issue 32). Beside each: "read only" (the store's pieces as it reads them,
nothing opened or joined) and "open only" (the sealer on the whole blob already in memory), so the
two costs can be told apart. The write path, beside them: "seal" (the sealer making the variant's
blob from the device cache: encode and encrypt) and "write" (`RedisBlobStore.put` of that blob:
every chunk and the manifest in one pipeline, the replaced blob's chunks deleted, its row), each
write a newly sealed blob as a write-back makes. MB/s = sealed blob bytes / seconds.

    .venv/bin/python benchmarks/redis_restore.py --threads 1
    .venv/bin/python benchmarks/redis_restore.py --quick   # 1,000 / 2,000 tokens, 3 repeats
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis
from _common import (
    SYSTEM_PROMPT,
    base_parser,
    fmt_mb,
    median,
    open_manager,
    print_header,
    print_table,
    setup,
    temp_dir,
    user_message,
    write_json,
)
from redis._parsers import _HiredisParser, _RESP2Parser
from redis.utils import HIREDIS_AVAILABLE

from cache.ids import SessionId, TenantId
from cache.serialization import FORMAT_VERSION, session_cache_to_tensors
from cache.session_cache import SessionCache
from cache.tiers import CacheKey
from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.offload import SharedBlobStore
from storage import chunked_blobs, codec, redis_store
from storage.chunked_blobs import CHUNK_BYTES
from storage.keyring import blob_aad, seal
from storage.redis_store import READ_WINDOW, RedisBlobStore, connect_redis

MiB = 1024 * 1024


def timed(call: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return times


def whole_blob(fingerprint: str, data_key: bytes, key: CacheKey, cache: SessionCache) -> bytes:
    """The blob as the sealer wrote it before chunking: one AES-GCM over the safetensors payload."""
    tensors, header = session_cache_to_tensors(cache)
    header["model_fingerprint"] = fingerprint
    payload = codec.encode(tensors, header)
    return seal(data_key, payload, blob_aad(key.tenant_id, key.name, fingerprint, FORMAT_VERSION))


@contextlib.contextmanager
def before_issue_32() -> Iterator[None]:
    """Chunks read by redis-py's reply parser and decrypted into a `bytearray`, as before issue 32."""
    reader, buffer = redis_store._bulk_reader, chunked_blobs.payload_buffer
    redis_store._bulk_reader, chunked_blobs.payload_buffer = (lambda connection, buffers: None), bytearray
    try:
        yield
    finally:
        redis_store._bulk_reader, chunked_blobs.payload_buffer = reader, buffer


BEFORE_32 = f"chunked {CHUNK_BYTES // MiB} MiB, streamed, before issue 32"
VARIANTS: list[tuple[str, int | None, bool]] = [
    ("single GET (before)", None, False),
    (f"chunked {CHUNK_BYTES // MiB} MiB, joined", CHUNK_BYTES, False),
    *[(f"chunked {mib} MiB, streamed", mib * MiB, True) for mib in (1, 2, 4)],
    (BEFORE_32, CHUNK_BYTES, True),
]
"""(name, chunk bytes or None for a whole blob, read streamed)."""


def time_variant(
    variant: tuple[str, int | None, bool],
    manager: SessionManager,
    store: RedisBlobStore[CacheKey],
    key: CacheKey,
    cache: SessionCache,
    repeats: int,
) -> dict[str, Any]:
    """Store the session's blob sealed as `variant` says, then time its restore, read and open."""
    name, chunk_bytes, streamed = variant
    sealer, shared = manager.internals.sealer, SharedBlobStore(store)
    data_key = manager.internals.keys.data_key(key.tenant_id)
    if chunk_bytes is not None:
        sealer.chunk_bytes = chunk_bytes

    def sealed() -> bytes | bytearray:
        if chunk_bytes is None:
            return whole_blob(manager.internals.engine.fingerprint, data_key, key, cache)
        return sealer.seal_session(key, cache)

    # Each write a new blob (a new blob id) replacing the last, as a write-back or hand-over does.
    seal_s, write_s = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        blob = sealed()
        sealed_at = time.perf_counter()
        store.put(key, blob)  # the chunks and manifest in one pipeline, the old chunks deleted, the row
        seal_s.append(sealed_at - started)
        write_s.append(time.perf_counter() - sealed_at)

    def restore() -> SessionCache:
        return sealer.open_session(key, shared.read(key) if streamed else store.get(key))

    assert restore().own_token_ids == cache.own_token_ids
    restore_s = timed(restore, repeats)
    read_s = timed(lambda: list(store.read(key)), repeats)  # the pieces, not joined
    open_s = timed(functools.partial(sealer.open_session, key, store.get(key)), repeats)
    mb = len(blob) / 1e6
    return {
        "variant": name,
        "blob_bytes": len(blob),
        "restore_s": restore_s,
        "restore_mb_s_median": mb / median(restore_s),
        "restore_mb_s_best": mb / min(restore_s),
        "read_mb_s_median": mb / median(read_s),
        "open_mb_s_median": mb / median(open_s),
        "seal_s": seal_s,
        "write_s": write_s,
        "seal_mb_s_median": mb / median(seal_s),
        "write_mb_s_median": mb / median(write_s),
    }


def clients(args: Any) -> dict[str, redis.Redis | redis.RedisCluster]:
    """A client per reply parser asked for (`--parsers`) that is installed."""
    made: dict[str, redis.Redis | redis.RedisCluster] = {}
    for name in args.parsers.split(","):
        if name == "hiredis" and not HIREDIS_AVAILABLE:
            print("  hiredis is not installed: its rows are skipped")
            continue
        parser = {"python": _RESP2Parser, "hiredis": _HiredisParser}[name]
        client = connect_redis(args.redis_url, cluster=args.redis_cluster, timeout_s=10.0)
        pools = [client.connection_pool] if isinstance(client, redis.Redis) else []
        if isinstance(client, redis.RedisCluster):
            pools = [n.redis_connection.connection_pool for n in client.get_nodes() if n.redis_connection]
        for pool in pools:
            pool.connection_kwargs["parser_class"] = parser
        made[name] = client
    return made


def measure_size(
    engine: Engine,
    args: Any,
    size: int,
    by_parser: dict[str, Any],
    variants: list[tuple[str, int | None, bool]] = VARIANTS,
) -> list[dict]:
    """Build a ~`size`-token session (one turn) and time each of `variants` (default all), with every
    parser, on its cache. `args` needs `model_cache_dir` and `repeats`."""
    prefix = f"ckvbench-{secrets.token_hex(4)}"
    results = []
    with temp_dir(f"redis-restore{size}") as root, open_manager(root / "home", engine, args.model_cache_dir) as manager:
        tenant = manager.create_tenant("bench")
        session = manager.open_session(tenant, system_prompt=SYSTEM_PROMPT)
        manager.chat(tenant, session, user_message(engine, 0, size - 60), max_new_tokens=8)
        tokens = manager.session_info(tenant, session).token_count
        key = CacheKey.for_session(TenantId(tenant.id), SessionId(session))
        cache = manager.internals.tiers.peek(key)
        assert cache is not None, "the session's cache should be on the device after its turn"
        for parser, client in by_parser.items():
            store: RedisBlobStore[CacheKey] = RedisBlobStore(
                client, manager.internals.metadata, engine.fingerprint, CacheKey, prefix=prefix
            )
            try:
                for variant in variants:
                    with before_issue_32() if variant[0] == BEFORE_32 else contextlib.nullcontext():
                        timing = time_variant(variant, manager, store, key, cache, args.repeats)
                    results.append({"size": size, "tokens": tokens, "parser": parser, **timing})
                    mb_s, write = timing["restore_mb_s_median"], timing["write_mb_s_median"]
                    print(
                        f"  {tokens} tokens, {parser}, {variant[0]}: {mb_s:.0f} MB/s (median), write {write:.0f} MB/s",
                        flush=True,
                    )
            finally:
                store.delete(key)
                manager.internals.sealer.chunk_bytes = CHUNK_BYTES
    return results


def print_results(records: list[dict], sizes: list[int], parsers: list[str]) -> None:
    rows = [
        [
            rec["tokens"],
            rec["parser"],
            rec["variant"],
            fmt_mb(rec["blob_bytes"]),
            f"{median(rec['restore_s']) * 1000:.0f} ms",
            f"{min(rec['restore_s']) * 1000:.0f} ms",
            f"{rec['restore_mb_s_median']:.0f}",
            f"{rec['restore_mb_s_best']:.0f}",
            f"{rec['read_mb_s_median']:.0f}",
            f"{rec['open_mb_s_median']:.0f}",
            f"{rec['seal_mb_s_median']:.0f}",
            f"{rec['write_mb_s_median']:.0f}",
        ]
        for rec in records
    ]
    headers = ["tokens", "parser", "variant", "blob", "restore p50", "best", "MB/s p50", "MB/s best"]
    headers += ["read only MB/s", "open only MB/s", "seal MB/s", "write MB/s"]
    print_table("Restore from Redis (MB/s = sealed blob bytes / seconds)", headers, rows)
    default = f"chunked {CHUNK_BYTES // MiB} MiB, streamed"
    for size in sizes:
        for parser in parsers:
            of = {r["variant"]: r for r in records if r["size"] == size and r["parser"] == parser}
            before, after = of["single GET (before)"]["restore_mb_s_median"], of[default]["restore_mb_s_median"]
            print(
                f"{size} tokens, {parser} parser: {default} {after:.0f} MB/s, single GET {before:.0f} MB/s: "
                f"{after / before:.1f}x"
            )
            if BEFORE_32 in of:
                before = of[BEFORE_32]["restore_mb_s_median"]
                print(f"  against {BEFORE_32}: {before:.0f} MB/s: {after / before:.2f}x")
            seal, write = of[default]["seal_mb_s_median"], of[default]["write_mb_s_median"]
            print(f"  the write path, {default}: seal {seal:.0f} MB/s, write (put) {write:.0f} MB/s")


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="history sizes in tokens (default 1000,2000,4000)")
    parser.add_argument("--repeats", type=int, default=None, help="timings per variant (default 5; --quick 3)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the Redis to measure against")
    parser.add_argument("--redis-cluster", action="store_true", help="--redis-url names a Redis Cluster node")
    parser.add_argument("--parsers", default="python,hiredis", help="redis-py reply parsers to compare")
    args = parser.parse_args()
    sizes = [int(s) for s in (args.sizes or ("1000,2000" if args.quick else "1000,2000,4000")).split(",")]
    args.repeats = args.repeats or (3 if args.quick else 5)
    by_parser = clients(args)
    server = next(iter(by_parser.values())).info("server")
    version = server.get("redis_version") if isinstance(server, dict) else "?"
    engine = setup(args)
    print_header(
        "redis_restore: restore throughput from Redis, one GET vs chunks read pipelined and opened as they arrive",
        engine,
        [
            f"Redis {version} at {args.redis_url}{' (cluster)' if args.redis_cluster else ''}; redis-py "
            f"{redis.__version__}, reply parsers: {', '.join(by_parser)}; {READ_WINDOW} chunk GETs in flight; "
            f"{args.repeats} timings per variant",
            "restore = store read + decrypt + decode onto the device (the session blob only, not its base layer)",
        ],
    )
    records: list[dict] = []
    for size in sizes:
        records += measure_size(engine, args, size, by_parser)
    for client in by_parser.values():
        client.close()
    print_results(records, sizes, list(by_parser))
    write_json(args.json, {"benchmark": "redis_restore", "results": records}, engine)


if __name__ == "__main__":
    main()
