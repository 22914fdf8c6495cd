"""What a rebuild costs, holds and keeps under each window policy (issues 13, 31): the next turn's
TTFT when the session's cache is gone (dropped: after a restart without a stored copy, or a
rejected one) against the same turn with the cache on the device (an evicting turn, the window
being full), the most tokens one buffer held meanwhile, and how close the rebuilt window's greedy
reply is to an unbounded cache's, for `window_policy` `turns`, `attention` and `agnostic` at one
context budget, on the real default model.

A rebuild under `turns` prefills the whole turns that fit the budget. The `at once` rows are
`window_rebuild_chunk_tokens` 0 (chatkv's default): `attention` prefills the past down to 1.25x
the budget in one buffer and evicts by the new turn's queries; `agnostic` drops whole turns like
`turns`. The plain `attention` and `agnostic` rows are chunked rebuilds (issue 31 item 4): whole
oldest turns dropped down to 1.5x the budget, the rest prefilled in chunks of `--chunk` (128)
tokens, each scoring what is held by its own queries and evicting down to the budget before the
next (`TurnWindow.prefill_evicting`); the turn's own prefill then evicts the rest.

1. Cost: each mode gets its own home and the same messages: `--turns` turns of ~100-token
   paragraphs (16-token replies) that outgrow `--budget`, then `--repeats` pairs of measured
   turns: one with the cache on the device (reuse), then one after `evict_session(..., "drop")`
   (rebuild). Medians of TTFT, tokens prefilled, `TurnStats.peak_tokens` and cache tokens after.
2. Quality: `--quality` conversations are first run with an unbounded window (the reference
   transcript). Each of their last `--points` turns is then posted with the reference's earlier
   turns (`continue_history`) to a fresh tenant under every mode, so every mode rebuilds the same
   token stream; an unbounded home does the same (the reference reply for that stream). Reported:
   replies identical to the unbounded one, and the mean number of leading reply tokens that agree.

    .venv/bin/python benchmarks/window_rebuild.py --threads 1
    .venv/bin/python benchmarks/window_rebuild.py --threads 1 --quick
"""

from __future__ import annotations

import time
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

from sessions.records import Reply

MODES = (
    ("turns", "turns", False),
    ("attention", "attention", True),
    ("attention at once", "attention", False),
    ("agnostic", "agnostic", True),
    ("agnostic at once", "agnostic", False),
)
"""(label, window_policy, chunked): chunked rebuilds use `--chunk`, the others 0."""
REPLY_TOKENS = 16
MESSAGE_TOKENS = 100


def mode_settings(args: Any, policy: str, chunked: bool) -> dict[str, Any]:
    return {
        "persist": "on_evict",  # no background sealing beside the measured turns
        "context_budget_tokens": args.budget,
        "window_policy": policy,
        "window_recent_tokens": args.recent,
        "window_rebuild_chunk_tokens": args.chunk if chunked else 0,
    }


def run_cost(engine: Any, args: Any, label: str, policy: str, chunked: bool) -> dict[str, list[dict[str, Any]]]:
    measured: dict[str, list[dict[str, Any]]] = {"reuse": [], "rebuild": []}
    with (
        temp_dir(f"rebuild-{policy}") as root,
        open_manager(root / "home", engine, args.model_cache_dir, **mode_settings(args, policy, chunked)) as m,
    ):
        tenant = m.create_tenant("bench")
        sid = m.open_session(tenant, system_prompt=SYSTEM_PROMPT)
        index = 0
        for _ in range(args.turns):
            m.chat(tenant, sid, user_message(engine, index, MESSAGE_TOKENS), max_new_tokens=REPLY_TOKENS)
            index += 1
        for _ in range(args.repeats):
            for kind in ("reuse", "rebuild"):
                if kind == "rebuild":
                    m.evict_session(tenant, sid, "drop")
                text = user_message(engine, index, MESSAGE_TOKENS)
                stats = m.chat(tenant, sid, text, max_new_tokens=REPLY_TOKENS).stats
                index += 1
                measured[kind].append(
                    {
                        "ttft_s": stats.ttft_s,
                        "prefill_tokens": stats.prefill_tokens,
                        "peak_tokens": stats.peak_tokens,
                        "cache_tokens": stats.cache_tokens,
                        "restored_from": stats.restored_from,
                    }
                )
                print(
                    f"  {label}: {kind}: TTFT {stats.ttft_s * 1000:.0f} ms, prefill {stats.prefill_tokens} tokens, "
                    f"peak {stats.peak_tokens}, cache {stats.cache_tokens} tokens, from {stats.restored_from}",
                    flush=True,
                )
    return measured


def reference_history(engine: Any, args: Any, conversation: int) -> list[tuple[str, str]]:
    """An unbounded run of `args.turns` turns: (user text, reply text) per turn."""
    messages = [user_message(engine, conversation * 7 + k, MESSAGE_TOKENS) for k in range(args.turns)]
    with temp_dir("rebuild-ref") as root, open_manager(root / "home", engine, args.model_cache_dir) as m:
        tenant = m.create_tenant("bench")
        sid = m.open_session(tenant, system_prompt=SYSTEM_PROMPT)
        replies = [m.chat(tenant, sid, text, max_new_tokens=REPLY_TOKENS).text for text in messages]
    return list(zip(messages, replies, strict=True))


def rebuilt_replies(
    engine: Any, args: Any, settings: dict[str, Any], histories: list[list[tuple[str, str]]]
) -> list[Reply]:
    """For each history and each of its last `args.points` turns: that turn posted with the earlier
    ones to a fresh tenant (so the session is new and its first turn rebuilds the window)."""
    out = []
    with (
        temp_dir("rebuild-quality") as root,
        open_manager(root / "home", engine, args.model_cache_dir, **settings) as m,
    ):
        for c, history in enumerate(histories):
            for k in range(len(history) - args.points, len(history)):
                tenant = m.create_tenant(f"c{c}-t{k}")
                items = list(
                    m.continue_history(tenant, SYSTEM_PROMPT, history[:k], history[k][0], max_new_tokens=REPLY_TOKENS)
                )
                reply = items[-1]
                if not isinstance(reply, Reply):
                    raise RuntimeError("bug: a posted turn ended without its reply")
                out.append(reply)
    return out


def agreeing(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Leading tokens two replies share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run_quality(engine: Any, args: Any) -> dict[str, Any]:
    histories = [reference_history(engine, args, c) for c in range(args.quality)]
    unbounded = rebuilt_replies(engine, args, {"persist": "on_evict"}, histories)
    out: dict[str, Any] = {}
    for label, policy, chunked in MODES:
        replies = rebuilt_replies(engine, args, mode_settings(args, policy, chunked), histories)
        pairs = list(zip(replies, unbounded, strict=True))
        out[label] = {
            "identical": sum(r.token_ids == u.token_ids for r, u in pairs),
            "agreeing_tokens": [agreeing(r.token_ids, u.token_ids) for r, u in pairs],
            "ttft_s": [r.stats.ttft_s for r in replies],
            "peak_tokens": [r.stats.peak_tokens for r in replies],
            "prefill_tokens": [r.stats.prefill_tokens for r in replies],
            "sources": sorted({r.stats.restored_from for r in replies}),
            "count": len(pairs),
        }
        q = out[label]
        print(
            f"  quality {label}: {q['identical']}/{q['count']} identical, "
            f"{sum(q['agreeing_tokens']) / len(pairs):.1f} leading tokens agree, from {q['sources']}",
            flush=True,
        )
    return out


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=600, help="context_budget_tokens of every mode")
    parser.add_argument("--recent", type=int, default=32, help="window_recent_tokens of the lossy policies")
    parser.add_argument("--chunk", type=int, default=128, help="window_rebuild_chunk_tokens of the chunked rows")
    parser.add_argument("--turns", type=int, default=None, help="turns before the measured ones (default 14)")
    parser.add_argument("--repeats", type=int, default=None, help="reuse/rebuild pairs per mode (default 5)")
    parser.add_argument("--quality", type=int, default=None, help="reference conversations (default 4; 0: none)")
    parser.add_argument("--points", type=int, default=3, help="rebuilt turns per reference conversation")
    args = parser.parse_args()
    args.turns = args.turns or (8 if args.quick else 14)
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.quality = (1 if args.quick else 4) if args.quality is None else args.quality
    engine = setup(args)
    print_header(
        "window_rebuild: next-turn TTFT, peak tokens and reply quality after the cache is dropped, per window policy",
        engine,
        [
            f"context budget {args.budget} tokens, window_recent_tokens {args.recent}, chunked rebuilds in "
            f"{args.chunk}-token chunks; {args.turns} turns of ~100-token messages first, then {args.repeats} "
            f"pairs (reuse, then rebuild after a drop); {REPLY_TOKENS}-token greedy replies; medians; quality: "
            f"{args.quality} conversations x last {args.points} turns rebuilt from the same posted history"
        ],
    )
    started = time.perf_counter()
    results = {label: run_cost(engine, args, label, policy, chunked) for label, policy, chunked in MODES}
    rows = []
    for label, _, _ in MODES:
        for kind in ("reuse", "rebuild"):
            runs = results[label][kind]
            rows.append(
                [
                    f"{label}: {kind}",
                    f"{median([r['ttft_s'] for r in runs]) * 1000:.0f} ms",
                    f"{median([r['prefill_tokens'] for r in runs]):.0f}",
                    f"{max(r['peak_tokens'] for r in runs)}",
                    f"{median([r['cache_tokens'] for r in runs]):.0f}",
                    "/".join(sorted({r["restored_from"] for r in runs})),
                ]
            )
    print_table(
        "Next-turn TTFT by window policy (medians; peak: the largest)",
        ["mode: turn", "TTFT", "prefilled tokens", "peak tokens", "cache tokens after", "cache from"],
        rows,
    )

    def ttft(label: str, kind: str) -> float:
        return median([r["ttft_s"] for r in results[label][kind]])

    for label, _, _ in MODES:
        print(
            f"{label}: rebuild / reuse {ttft(label, 'rebuild') / ttft(label, 'reuse'):.1f}x; vs turns: reuse "
            f"(an evicting turn) {ttft(label, 'reuse') / ttft('turns', 'reuse'):.2f}x, rebuild "
            f"{ttft(label, 'rebuild') / ttft('turns', 'rebuild'):.2f}x"
        )
    quality = run_quality(engine, args) if args.quality else {}
    if quality:
        qrows = []
        for label, _, _ in MODES:
            q = quality[label]
            qrows.append(
                [
                    label,
                    f"{q['identical']} of {q['count']}",
                    f"{sum(q['agreeing_tokens']) / q['count']:.1f} of {REPLY_TOKENS}",
                    f"{median(q['ttft_s']) * 1000:.0f} ms",
                    f"{median(q['prefill_tokens']):.0f}",
                    f"{max(q['peak_tokens'])}",
                ]
            )
        print_table(
            "Rebuilt from the same posted history: greedy replies against an unbounded cache's",
            ["mode", "identical", "leading tokens agreeing", "TTFT (median)", "prefilled", "peak tokens"],
            qrows,
        )
    print(f"total run time {time.perf_counter() - started:.0f} s")
    write_json(args.json, {"benchmark": "window_rebuild", "results": results, "quality": quality}, engine)


if __name__ == "__main__":
    main()
