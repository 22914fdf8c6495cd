"""Follow-up TTFT while the background write-back of other sessions runs (issue 3's write-behind).

Two sessions of about `--history-tokens` (2,000) tokens take turns back to back, as two busy users
of one server would: each turn starts the moment the other session's turn ends, so the other
session's write-back (seal: safetensors encoding and AES-GCM, then the file write) is due exactly
while this turn runs. Measured per persistence mode, `--turns` (8) turns, median TTFT:

- write_back:          `persist = "write_back"` (default): the writer yields to turns (it starts once
                       no turn has been in flight for 50 ms, pauses between its steps, and goes
                       ahead after 2 s at the latest);
- write_back, eager:   the same, with the yielding switched off (settle 0 s, deferral 0 s): the
                       writer seals beside the turn, as chatkv did before it yielded;
- on_evict:            no background writer at all (the baseline: nothing competes with the turn).

The ratio column is on_evict's TTFT over this mode's: 1.0x means the writer costs the turns
nothing. Sealing holds the GIL, and a turn's hundreds of short torch calls each wait for it (a GIL
convoy), so the eager writer costs far more than its own CPU time.

    .venv/bin/python benchmarks/write_back_contention.py            # ~2,000-token sessions, 8 turns
    .venv/bin/python benchmarks/write_back_contention.py --quick    # ~1,000 tokens, 4 turns
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from _common import (
    SYSTEM_PROMPT,
    base_parser,
    fmt_ratio,
    fmt_s,
    median,
    open_manager,
    print_header,
    print_table,
    setup,
    temp_dir,
    user_message,
    write_json,
)

import cache.write_back as write_back
from sessions.engine import Engine

MODES: list[tuple[str, str, float, float]] = [
    ("write_back", "write_back", write_back.WRITE_BACK_SETTLE_S, write_back.WRITE_BACK_MAX_DEFER_S),
    ("write_back, eager", "write_back", 0.0, 0.0),
    ("on_evict", "on_evict", write_back.WRITE_BACK_SETTLE_S, write_back.WRITE_BACK_MAX_DEFER_S),
]


def run_mode(
    engine: Engine, args: argparse.Namespace, root: Path, label: str, persist: str, settle: float, defer: float
) -> dict[str, Any]:
    # The manager's TierManager builds its WriteBack with the module defaults; set them for this run only.
    saved = write_back.WRITE_BACK_SETTLE_S, write_back.WRITE_BACK_MAX_DEFER_S
    write_back.WRITE_BACK_SETTLE_S, write_back.WRITE_BACK_MAX_DEFER_S = settle, defer
    try:
        home = root / label.replace(", ", "-")
        with open_manager(home, engine, args.model_cache_dir, persist=persist) as manager:
            tenant = manager.create_tenant("bench")
            sessions = [manager.open_session(tenant, system_prompt=SYSTEM_PROMPT) for _ in range(2)]
            for number, session_id in enumerate(sessions):
                index = number * 50
                while manager.session_info(tenant, session_id).token_count < args.history_tokens - 60:
                    manager.chat(tenant, session_id, user_message(engine, index, 450), max_new_tokens=16)
                    index += 1
            manager.internals.tiers.flush()
            ttfts, prefills, sources = [], [], []
            for turn in range(args.turns):
                message = f"Thank you ({turn}). Which of these texts did you find the most interesting?"
                reply = manager.chat(tenant, sessions[turn % 2], message, max_new_tokens=4)
                ttfts.append(reply.stats.ttft_s)
                prefills.append(reply.stats.prefill_tokens)
                sources.append(reply.stats.restored_from)
            tokens = [manager.session_info(tenant, s).token_count for s in sessions]
    finally:
        write_back.WRITE_BACK_SETTLE_S, write_back.WRITE_BACK_MAX_DEFER_S = saved
    result = {
        "mode": label,
        "persist": persist,
        "settle_s": settle,
        "max_defer_s": defer,
        "ttft_s": ttfts,
        "median_ttft_s": median(ttfts),
        "prefill_tokens": prefills,
        "restored_from": sources,
        "session_tokens": tokens,
    }
    print(f"  {label}: TTFT {', '.join(fmt_s(t) for t in ttfts)}; median {fmt_s(result['median_ttft_s'])}", flush=True)
    return result


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--history-tokens", type=int, default=None, help="tokens per session (default 2000)")
    parser.add_argument("--turns", type=int, default=None, help="measured turns per mode, alternating (default 8)")
    args = parser.parse_args()
    args.history_tokens = args.history_tokens or (1000 if args.quick else 2000)
    args.turns = args.turns or (4 if args.quick else 8)
    engine = setup(args)
    print_header(
        "write_back_contention: follow-up TTFT while other sessions' caches are written back",
        engine,
        [
            f"two sessions of ~{args.history_tokens} tokens taking {args.turns} turns back to back, "
            "alternating; short follow-up messages; median TTFT per mode",
        ],
    )
    with temp_dir("write-back") as root:
        results = [run_mode(engine, args, root, *mode) for mode in MODES]
    baseline = next(r for r in results if r["mode"] == "on_evict")["median_ttft_s"]
    rows = [
        [
            r["mode"],
            f"{r['settle_s']:g} s / {r['max_defer_s']:g} s" if r["persist"] == "write_back" else "-",
            max(r["session_tokens"]),
            fmt_s(r["median_ttft_s"]),
            fmt_ratio(baseline / r["median_ttft_s"]),
            "/".join(sorted(set(r["restored_from"]))),
        ]
        for r in results
    ]
    print_table(
        "Follow-up TTFT with other sessions' write-backs due (ratio = on_evict TTFT / this mode's)",
        ["mode", "settle / max defer", "session tokens", "median TTFT", "vs no writer", "cache from"],
        rows,
    )
    write_json(args.json, {"results": results}, engine)


if __name__ == "__main__":
    main()
