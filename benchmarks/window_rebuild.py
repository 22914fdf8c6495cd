"""What a rebuild costs under each window policy (issue 13): the next turn's TTFT when the session's
cache is gone (dropped: after a restart without a stored copy, or a rejected one) against the same
turn with the cache on the device (an evicting turn, the window being full), for `window_policy`
`turns`, `attention` and `agnostic` at one context budget, on the real default model, greedy.

A rebuild under `turns` (and `agnostic`) prefills the whole turns that fit the budget. Under
`attention` it drops whole oldest turns down to the budget plus a quarter of it, prefills that kept
past at contiguous positions, then the turn's own prefill scores it and evicts per KV head down to
the budget (`TurnPreparer._rebuild_by_attention`, issue 31: the cost follows the budget).

Each policy gets its own home and the same conversation: `--turns` turns of ~100-token paragraphs
(16-token replies) that outgrow `--budget`, then `--repeats` pairs of measured turns: one with the
cache on the device (reuse), then one after `evict_session(..., "drop")` (rebuild).

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

POLICIES = ("turns", "attention", "agnostic")
REPLY_TOKENS = 16
MESSAGE_TOKENS = 100


def run_policy(engine: Any, args: Any, policy: str) -> dict[str, Any]:
    settings = {
        "persist": "on_evict",  # no background sealing beside the measured turns
        "context_budget_tokens": args.budget,
        "window_policy": policy,
        "window_recent_tokens": args.recent,
    }
    measured: dict[str, list[dict[str, Any]]] = {"reuse": [], "rebuild": []}
    with (
        temp_dir(f"rebuild-{policy}") as root,
        open_manager(root / "home", engine, args.model_cache_dir, **settings) as m,
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
                        "cache_tokens": stats.cache_tokens,
                        "restored_from": stats.restored_from,
                    }
                )
                print(
                    f"  {policy}: {kind}: TTFT {stats.ttft_s * 1000:.0f} ms, prefill {stats.prefill_tokens} tokens, "
                    f"cache {stats.cache_tokens} tokens, from {stats.restored_from}"
                )
    return measured


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=600, help="context_budget_tokens of both policies")
    parser.add_argument("--recent", type=int, default=32, help="window_recent_tokens of the attention policy")
    parser.add_argument("--turns", type=int, default=None, help="turns before the measured ones (default 14)")
    parser.add_argument("--repeats", type=int, default=None, help="reuse/rebuild pairs per policy (default 5)")
    args = parser.parse_args()
    args.turns = args.turns or (6 if args.quick else 14)
    args.repeats = args.repeats or (2 if args.quick else 5)
    engine = setup(args)
    print_header(
        "window_rebuild: next-turn TTFT after the cache is dropped, window_policy turns vs attention vs agnostic",
        engine,
        [
            f"context budget {args.budget} tokens, window_recent_tokens {args.recent}; {args.turns} turns of "
            f"~100-token messages first, then {args.repeats} pairs (reuse, then rebuild after a drop); "
            f"{REPLY_TOKENS}-token greedy replies; medians"
        ],
    )
    started = time.perf_counter()
    results = {policy: run_policy(engine, args, policy) for policy in POLICIES}
    rows = []
    for policy in POLICIES:
        for kind in ("reuse", "rebuild"):
            runs = results[policy][kind]
            rows.append(
                [
                    f"{policy}: {kind}",
                    f"{median([r['ttft_s'] for r in runs]) * 1000:.0f} ms",
                    f"{median([r['prefill_tokens'] for r in runs]):.0f}",
                    f"{median([r['cache_tokens'] for r in runs]):.0f}",
                    "/".join(sorted({r["restored_from"] for r in runs})),
                ]
            )
    print_table(
        "Next-turn TTFT by window policy (medians)",
        ["policy: turn", "TTFT", "prefilled tokens", "cache tokens after", "cache from"],
        rows,
    )

    def ttft(policy: str, kind: str) -> float:
        return median([r["ttft_s"] for r in results[policy][kind]])

    for policy in POLICIES:
        print(
            f"{policy}: rebuild / reuse {ttft(policy, 'rebuild') / ttft(policy, 'reuse'):.1f}x; vs turns: reuse "
            f"(an evicting turn) {ttft(policy, 'reuse') / ttft('turns', 'reuse'):.2f}x, rebuild "
            f"{ttft(policy, 'rebuild') / ttft('turns', 'rebuild'):.2f}x"
        )
    print(f"total run time {time.perf_counter() - started:.0f} s")
    write_json(args.json, {"benchmark": "window_rebuild", "results": results}, engine)


if __name__ == "__main__":
    main()
