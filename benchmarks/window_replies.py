"""Window policies through the public API (issue 31): greedy replies at a context budget of 45% of the
conversation's final length, every policy given the identical transcript turn by turn.

Each conversation (`--conversations`, `--turns` turns of ~60-token paragraphs and questions,
`--reply` -token greedy replies) is first run with an unbounded window: the reference transcript.
Then, for each policy, every turn is posted the way an OpenAI-style client posts it
(`SessionManager.continue_history`: the reference's earlier turns, then the next message), so
every policy answers after the same history; a session whose own reply differed from the
reference's does not hold the posted history, so chatkv forks or rebuilds it, as it would for any
client. Reported per policy: of the turns on which the window had to act (`demoted_tokens > 0`),
how many replies are identical to the reference's, their median time to first token, and the
median wall time of those turns (posting to the stored reply: under `agnostic` that includes the
KVzip reconstruction each turn runs after its reply), with its ratio to `turns` in the same run.

    .venv/bin/python benchmarks/window_replies.py --threads 1
    .venv/bin/python benchmarks/window_replies.py --threads 1 --quick     # 3 conversations
"""

from __future__ import annotations

import time
from typing import Any

from _common import (
    QUESTIONS,
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

POLICIES = ("turns", "attention", "agnostic")
BUDGET_SHARE = 0.45


def messages_of(engine: Any, index: int, turns: int) -> list[str]:
    return [
        user_message(engine, (index * 5 + k) % 20, 60, QUESTIONS[(index + k) % len(QUESTIONS)]) for k in range(turns)
    ]


def reference(engine: Any, args: Any, messages: list[str]) -> tuple[list[tuple[str, str]], list[Reply]]:
    """The unbounded run: (user text, reply text) per turn, and the replies."""
    with temp_dir("replies-ref") as root, open_manager(root / "home", engine, args.model_cache_dir) as m:
        tenant = m.create_tenant("bench")
        sid = m.open_session(tenant, system_prompt=SYSTEM_PROMPT)
        replies = [m.chat(tenant, sid, text, max_new_tokens=args.reply) for text in messages]
    return [(t, r.text) for t, r in zip(messages, replies, strict=True)], replies


def posted(
    engine: Any, args: Any, policy: str, budget: int, history: list[tuple[str, str]]
) -> list[tuple[Reply, float]]:
    """Each turn posted with the reference's earlier turns, under `policy` at `budget` tokens, with
    its wall time in seconds (from the post until the turn was stored)."""
    settings = {
        "context_budget_tokens": budget,
        "window_policy": policy,
        "window_recent_tokens": args.recent,
        "window_budget_allocation": args.allocation,
    }
    out = []
    with (
        temp_dir(f"replies-{policy}") as root,
        open_manager(root / "home", engine, args.model_cache_dir, **settings) as m,
    ):
        tenant = m.create_tenant("bench")
        for index, (text, _) in enumerate(history):
            began = time.perf_counter()
            turn = m.continue_history(tenant, SYSTEM_PROMPT, history[:index], text, max_new_tokens=args.reply)
            items = list(turn)
            reply = items[-1]
            if not isinstance(reply, Reply):
                raise RuntimeError("bug: a posted turn ended without its reply")
            out.append((reply, time.perf_counter() - began))
    return out


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=None, help="conversations (default 6)")
    parser.add_argument("--turns", type=int, default=8, help="turns per conversation")
    parser.add_argument("--reply", type=int, default=24, help="greedy reply tokens per turn")
    parser.add_argument("--recent", type=int, default=32, help="window_recent_tokens of the lossy policies")
    parser.add_argument(
        "--allocation",
        choices=("uniform", "per_head"),
        default="per_head",
        help="window_budget_allocation of the lossy policies (default per_head, as served)",
    )
    args = parser.parse_args()
    count = args.conversations or (3 if args.quick else 6)
    engine = setup(args)
    print_header(
        "window_replies: greedy replies at a 45% budget through continue_history, per window policy",
        engine,
        [f"{count} conversations of {args.turns} turns, {args.reply}-token replies, recent tokens {args.recent}"],
    )
    started = time.perf_counter()
    tally: dict[str, dict[str, Any]] = {p: {"evicting": 0, "same": 0, "ttft": [], "turn": []} for p in POLICIES}
    for c in range(count):
        began = time.perf_counter()
        history, ref = reference(engine, args, messages_of(engine, c, args.turns))
        budget = int(ref[-1].stats.cache_tokens * BUDGET_SHARE)
        line = [f"  conversation {c}: {ref[-1].stats.cache_tokens} tokens, budget {budget}"]
        for policy in POLICIES:
            timed = posted(engine, args, policy, budget, history)
            acted = [(r, s, want) for (r, s), want in zip(timed, ref, strict=True) if r.stats.demoted_tokens > 0]
            same = sum(r.token_ids == want.token_ids for r, _, want in acted)
            tally[policy]["evicting"] += len(acted)
            tally[policy]["same"] += same
            tally[policy]["ttft"] += [r.stats.ttft_s for r, _, _ in acted]
            tally[policy]["turn"] += [s for _, s, _ in acted]
            line.append(f"{policy} {same}/{len(acted)}")
        print(", ".join(line) + f" ({time.perf_counter() - began:.0f} s)", flush=True)
    rows = []
    base = {k: median(tally["turns"][k]) if tally["turns"][k] else 0.0 for k in ("ttft", "turn")}
    for policy in POLICIES:
        t = tally[policy]
        share = t["same"] / t["evicting"] if t["evicting"] else 0.0
        row = [policy, f"{t['same']} of {t['evicting']}", f"{share:.0%}"]
        for k in ("ttft", "turn"):
            m = median(t[k]) if t[k] else 0.0
            row.append(f"{m * 1000:.0f} ms ({m / base[k]:.2f}x)" if t[k] and base[k] else "-")
        rows.append(row)
    print_table(
        "Replies identical to the unbounded window's, on the turns where the window acted",
        ["policy", "identical", "share", "median TTFT of those turns (vs turns)", "median turn wall time (vs turns)"],
        rows,
    )
    print(f"total run time {time.perf_counter() - started:.0f} s")
    write_json(args.json, {"benchmark": "window_replies", "tally": tally}, engine)


if __name__ == "__main__":
    main()
