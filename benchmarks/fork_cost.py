"""What a fork costs (issue 22): making its cache from the parent's by sharing the parent's tensors
read-only (slices: what chatkv does) against copying them, and the fork's first turn against a
fresh session that prefills the same history, on the real default model, greedy.

A parent session of `--turns` turns of ~`--message-tokens`-token messages; then `--repeats` times:
`SessionCache.prefix` of its cache cut one turn back (views) and the same prefix copied
(`clone`), timed; a fork of the parent keeping all but its last turn, whose next turn's TTFT is
measured; and a new session opened with the same history (the turns as text, what a server
without forks does for a regenerate), whose first turn prefills it. The fork's reply is checked
equal to the fresh session's (greedy).

    .venv/bin/python benchmarks/fork_cost.py --threads 1
    .venv/bin/python benchmarks/fork_cost.py --threads 1 --quick
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from _common import (
    SYSTEM_PROMPT,
    base_parser,
    median,
    open_manager,
    print_header,
    print_table,
    setup,
    temp_dir,
    user_message,
    write_json,
)

from cache.tiers import CacheKey

REPLY_TOKENS = 24
QUESTION = "Say that again in one short sentence."


def run(engine: Any, args: Any) -> dict[str, Any]:
    measured: dict[str, list[float]] = {"views_s": [], "copy_s": [], "fork_ttft_s": [], "fresh_ttft_s": []}
    same, copied_bytes, cached_tokens = 0, 0, 0
    with temp_dir("fork-cost") as root, open_manager(root / "home", engine, args.model_cache_dir) as m:
        tenant = m.create_tenant("bench").id
        parent = m.open_session(tenant, SYSTEM_PROMPT)
        for index in range(args.turns):
            m.chat(tenant, parent, user_message(engine, index, args.message_tokens), max_new_tokens=REPLY_TOKENS)
        cache = m.internals.tiers.peek(CacheKey.for_session(tenant, parent))
        assert cache is not None, "the parent's cache is on the device"
        cached_tokens = cache.total_tokens
        history = m.history(tenant, parent)
        kept = [(u.text, a.text) for u, a in zip(history[:-2:2], history[1:-2:2], strict=True)]
        cut = cache.layers[-1].original_start  # the last turn's layer starts here: a fork before it
        for _ in range(args.repeats):
            started = time.perf_counter()
            prefix = cache.prefix(cut, transcript_digest="bench", rendering_digest="bench")
            measured["views_s"].append(time.perf_counter() - started)
            assert prefix is not None
            started = time.perf_counter()
            copied = replace(
                prefix,
                own_keys=tuple(k.clone() for k in prefix.own_keys),
                own_values=tuple(v.clone() for v in prefix.own_values),
            )
            measured["copy_s"].append(time.perf_counter() - started)
            copied_bytes = copied.own_nbytes
            fork = m.fork(tenant, parent, args.turns - 1)
            forked = m.chat(tenant, fork, QUESTION, max_new_tokens=REPLY_TOKENS)
            measured["fork_ttft_s"].append(forked.stats.ttft_s)
            fresh = m.open_session(tenant, SYSTEM_PROMPT, history=kept)
            reply = m.chat(tenant, fresh, QUESTION, max_new_tokens=REPLY_TOKENS)
            measured["fresh_ttft_s"].append(reply.stats.ttft_s)
            same += reply.text == forked.text
            print(
                f"  fork: TTFT {forked.stats.ttft_s * 1000:.0f} ms ({forked.stats.prefill_tokens} prefilled); "
                f"fresh: {reply.stats.ttft_s * 1000:.0f} ms ({reply.stats.prefill_tokens} prefilled)"
            )
    return {**measured, "same_replies": same, "copied_bytes": copied_bytes, "parent_tokens": cached_tokens}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=None, help="turns of the parent (default 4)")
    parser.add_argument("--message-tokens", type=int, default=None, help="tokens per message (default 450)")
    parser.add_argument("--repeats", type=int, default=None, help="measured forks (default 5)")
    args = parser.parse_args()
    args.turns = args.turns or (2 if args.quick else 4)
    args.message_tokens = args.message_tokens or (150 if args.quick else 450)
    args.repeats = args.repeats or (2 if args.quick else 5)
    engine = setup(args)
    print_header(
        "fork_cost: a fork's cache shared read-only or copied, and its first turn against a fresh prefill",
        engine,
        [
            f"parent: {args.turns} turns of ~{args.message_tokens}-token messages, {REPLY_TOKENS}-token greedy "
            f"replies; forks keep all but the last turn; {args.repeats} repeats; medians"
        ],
    )
    results = run(engine, args)
    views, copy = median(results["views_s"]), median(results["copy_s"])
    fork, fresh = median(results["fork_ttft_s"]), median(results["fresh_ttft_s"])
    print_table(
        f"Fork of a {results['parent_tokens']}-token session (medians)",
        ["what", "time", "ratio"],
        [
            ["prefix as views (shared, read-only)", f"{views * 1000:.2f} ms", "1.0x"],
            [
                f"prefix copied ({results['copied_bytes'] / 2**20:.1f} MB)",
                f"{copy * 1000:.1f} ms",
                f"{copy / views:.0f}x",
            ],
            ["fork's first turn, TTFT", f"{fork * 1000:.0f} ms", "1.0x"],
            ["fresh session, same history, TTFT", f"{fresh * 1000:.0f} ms", f"{fresh / fork:.1f}x"],
        ],
    )
    print(f"replies of the fork equal to the fresh session's: {results['same_replies']}/{args.repeats}")
    write_json(args.json, {"benchmark": "fork_cost", "results": results}, engine)


if __name__ == "__main__":
    main()
