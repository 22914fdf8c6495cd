"""Sessions per device budget, bytes per session in the host and disk tiers, and the first-turn TTFT
gain of a shared base layer (issue 4).

Part 1, capacity. With a fixed device budget (`--device-budget`, default 64 MiB of KV cache), one
tenant opens `--sessions` sessions of about `--session-tokens` tokens each (a `--system-tokens`
system prompt shared by all of them, plus one turn), with and without `Settings.share_base`. After
the turns, the tier manager has moved least-recently-used sessions off the device to keep it within
budget; the table shows how many stayed resident. Every session is then evicted to host
(`evict_session(..., "host")`) and then to disk, and the bytes each tier holds per session are
reported for every `offload_precision` (exact / int8 / int4; the base layer always stays exact, and
the most recent `quant_residual_tokens` stay exact). Residency does not depend on the precision (the
device tier is always exact), so the int8 and int4 rows use a few sessions only.

Part 2, first-turn TTFT of a new session whose system prompt is `--ttft-system-tokens` (500) tokens:
shared base already in the tenant's prefix pool (another session computed it) vs no sharing (the
session prefills its own base), with the naive full prefill (`apply_chat_template` + `transformers`)
for reference.

    .venv/bin/python benchmarks/capacity.py            # 20 sessions per sharing mode, 5 TTFT runs
    .venv/bin/python benchmarks/capacity.py --quick    # 14 sessions, 2 TTFT runs
"""

from __future__ import annotations

from typing import Any

from _common import (
    PARAGRAPHS,
    base_parser,
    chat_messages,
    fmt_mb,
    fmt_ratio,
    fmt_s,
    median,
    naive_first_token,
    open_manager,
    print_header,
    print_table,
    setup,
    temp_dir,
    user_message,
    write_json,
)

from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.settings import parse_bytes

FIRST_REPLY_TOKENS = 16


def system_prompt(engine: Engine, tokens: int) -> str:
    """A deterministic system prompt of about `tokens` tokens (the rendering adds a few)."""
    head = "You are the assistant of a small museum. Use the notes below to answer visitors.\n\n"
    text = head
    i = 0
    while len(engine.tokenizer.encode(text, add_special_tokens=False)) < tokens:
        text += PARAGRAPHS[i % len(PARAGRAPHS)] + "\n\n"
        i += 1
    ids = engine.tokenizer.encode(text, add_special_tokens=False)[:tokens]
    return engine.tokenizer.decode(ids).rsplit(" ", 1)[0] + "."


def first_message_for(engine: Engine, manager: SessionManager, system: str, session_tokens: int) -> str:
    """A first user message sized so that the session holds about `session_tokens` tokens after its
    first turn (system prompt, message, framing, a reply of `FIRST_REPLY_TOKENS`)."""
    base = len(manager.internals.template.system_prefix_ids(system))
    room = session_tokens - base - FIRST_REPLY_TOKENS - 8
    return user_message(engine, 3, max(room, 16), question="Answer in one sentence: what is this about?")


def capacity_run(
    engine: Engine, args: Any, root: Any, share: bool, precision: str, sessions: int, budget: int
) -> dict[str, Any]:
    home = root / f"cap-{share}-{precision}"
    with open_manager(
        home,
        engine,
        args.model_cache_dir,
        device_budget_bytes=budget,
        share_base=share,
        offload_precision=precision,
    ) as manager:
        tenant = manager.create_tenant("bench")
        system = system_prompt(engine, args.system_tokens)
        message = first_message_for(engine, manager, system, args.session_tokens)
        ids, tokens, base_tokens = [], [], 0
        for _ in range(sessions):
            sid = manager.open_session(tenant, system_prompt=system)
            reply = manager.chat(tenant, sid, message, max_new_tokens=FIRST_REPLY_TOKENS)
            manager.internals.tiers.flush()
            ids.append(sid)
            tokens.append(reply.stats.cache_tokens)
            base_tokens = len(manager.internals.template.system_prefix_ids(system))
        stats = manager.stats()
        device = stats["tiers"]["device"]
        tiers_after = {t: stats["tiers"][t]["sessions"] for t in ("device", "host", "disk")}
        resident = device["sessions"]
        pool = stats["base_layers_in_pool"]
        # Sessions the budget pushed off the device may already be on disk (a persisted cache skips
        # the host tier); the others are evicted to host explicitly and measured there.
        for sid in ids:
            if manager.session_info(tenant, sid).tier == "device":
                manager.evict_session(tenant, sid, "host")
        in_host = [sid for sid in ids if manager.session_info(tenant, sid).tier == "host"]
        host_per_session = [manager.inspect_session(tenant, sid).cache_bytes for sid in in_host]
        host_total = manager.stats()["tiers"]["host"]["bytes"]
        for sid in ids:
            manager.evict_session(tenant, sid, "disk")
        disk_per_session = [manager.inspect_session(tenant, sid).cache_bytes for sid in ids]
        disk_total = manager.stats()["tiers"]["disk"]["bytes"]
    return {
        "share_base": share,
        "precision": precision,
        "sessions": sessions,
        "session_tokens": median(tokens),
        "base_tokens": base_tokens,
        "resident_on_device": resident,
        "device_bytes": device["bytes"],
        "device_budget": budget,
        "base_layers_in_pool": pool,
        "host_bytes_per_session": median(host_per_session) if host_per_session else None,
        "host_sessions_measured": len(host_per_session),
        "tiers_after_turns": tiers_after,
        "host_bytes_total": host_total,
        "disk_session_blob_bytes": median(disk_per_session),
        "disk_bytes_total": disk_total,
        "disk_base_blob_bytes_total": disk_total - sum(disk_per_session),
    }


def ttft_run(engine: Engine, args: Any, root: Any, share: bool, runs: int) -> dict[str, Any]:
    home = root / f"ttft-{share}"
    with open_manager(home, engine, args.model_cache_dir, share_base=share) as manager:
        tenant = manager.create_tenant("bench")
        system = system_prompt(engine, args.ttft_system_tokens)
        message = "Hello! What can I see in the museum today?"
        if share:  # another session of the tenant puts the base into the prefix pool
            manager.chat(tenant, manager.open_session(tenant, system_prompt=system), message, max_new_tokens=4)
        replies = []
        for _ in range(runs):
            sid = manager.open_session(tenant, system_prompt=system)
            replies.append(manager.chat(tenant, sid, message, max_new_tokens=4))
            manager.internals.tiers.flush()
    naive = [naive_first_token(engine, chat_messages(system, [], message)) for _ in range(runs)] if share else []
    return {
        "share_base": share,
        "ttft_s": median([r.stats.ttft_s for r in replies]),
        "ttft_runs_s": [r.stats.ttft_s for r in replies],
        "prefill_tokens": replies[0].stats.prefill_tokens,
        "base_reused_tokens": replies[0].stats.base_reused_tokens,
        "context_tokens": replies[0].stats.prefill_tokens + replies[0].stats.reused_tokens,
        "naive_ttft_s": median([n[0] for n in naive]) if naive else None,
    }


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--device-budget", default="64MiB", help="device-tier budget (default 64MiB)")
    parser.add_argument("--sessions", type=int, default=None, help="sessions per sharing mode (default 20)")
    parser.add_argument("--session-tokens", type=int, default=300, help="tokens per session (default 300)")
    parser.add_argument("--system-tokens", type=int, default=200, help="system prompt tokens (default 200)")
    parser.add_argument("--ttft-system-tokens", type=int, default=500, help="system prompt for part 2 (500)")
    parser.add_argument("--ttft-runs", type=int, default=None, help="new sessions per mode in part 2 (default 5)")
    args = parser.parse_args()
    budget = parse_bytes(args.device_budget)
    sessions = args.sessions or (14 if args.quick else 20)
    few = 3
    ttft_runs = args.ttft_runs or (2 if args.quick else 5)

    engine = setup(args)
    print_header(
        "capacity: sessions per device budget, bytes per session per tier, shared-base first-turn TTFT",
        engine,
        [
            f"device budget {args.device_budget} ({budget} bytes); {sessions} sessions of ~{args.session_tokens} "
            f"tokens ({args.system_tokens}-token system prompt + one turn); quant_residual_tokens = default (32)",
        ],
    )
    results: list[dict[str, Any]] = []
    ttft: list[dict[str, Any]] = []
    with temp_dir("capacity") as root:
        for share in (True, False):
            for precision in ("exact", "int8", "int4"):
                count = sessions if precision == "exact" else few
                result = capacity_run(engine, args, root, share, precision, count, budget)
                results.append(result)
                print(
                    f"  share_base={share} {precision}: {result['resident_on_device']} of {count} resident (tiers "
                    f"after the turns: {result['tiers_after_turns']}), host {fmt_mb(result['host_bytes_per_session'])}"
                    f"/session",
                    flush=True,
                )
        for share in (True, False):
            ttft.append(ttft_run(engine, args, root, share, ttft_runs))

    def base_share(r: dict[str, Any]) -> int:
        """Sessions one base blob is spread over: all `sessions` when shared, one otherwise."""
        return sessions if r["share_base"] else r["sessions"]

    rows = []
    for r in results:
        resident = f"{r['resident_on_device']} of {r['sessions']}" if r["precision"] == "exact" else "(same)"
        rows.append(
            [
                "shared" if r["share_base"] else "per session",
                r["precision"],
                resident,
                fmt_mb(r["device_bytes"]) if r["precision"] == "exact" else "-",
                r["base_layers_in_pool"] if r["precision"] == "exact" else "-",
                fmt_mb(r["host_bytes_per_session"]),
                fmt_mb(r["disk_session_blob_bytes"]),
                fmt_mb(r["disk_base_blob_bytes_total"]),
                fmt_mb(r["disk_session_blob_bytes"] + r["disk_base_blob_bytes_total"] / base_share(r)),
            ]
        )
    sample = results[0]
    print_table(
        f"Capacity: device budget {fmt_mb(budget)}; sessions of ~{sample['session_tokens']:.0f} tokens with a "
        f"{sample['base_tokens']}-token base layer; KV {engine.layout.bytes_per_token} bytes/token on the device",
        [
            "base",
            "offload precision",
            "resident on device",
            "device bytes",
            "bases in pool",
            "host bytes/session",
            "disk bytes/session",
            "disk base blobs (all)",
            f"disk bytes/session incl. base (over {sessions})",
        ],
        rows,
    )
    print(
        "host bytes = the session's sealed blob (the base layer is not copied into it); disk: session blobs plus "
        "base-layer blobs (one per distinct base: one when shared, one per session otherwise); the last column "
        f"spreads a shared base blob over {sessions} sessions. "
        "Rows marked (same): residency does not depend on the offload precision."
    )
    shared, alone = ttft
    naive_s = shared["naive_ttft_s"]
    print_table(
        f"First turn of a new session, {shared['base_reused_tokens'] or alone['prefill_tokens']}-token system "
        f"prompt (medians of {ttft_runs})",
        ["mode", "context", "prefill tokens", "base reused", "TTFT", "vs naive"],
        [
            ["naive full prefill", shared["context_tokens"], shared["context_tokens"], 0, fmt_s(naive_s), "1.0x"],
            [
                "chatkv, no sharing",
                alone["context_tokens"],
                alone["prefill_tokens"],
                alone["base_reused_tokens"],
                fmt_s(alone["ttft_s"]),
                fmt_ratio(naive_s / alone["ttft_s"]),
            ],
            [
                "chatkv, shared base (pool hit)",
                shared["context_tokens"],
                shared["prefill_tokens"],
                shared["base_reused_tokens"],
                fmt_s(shared["ttft_s"]),
                fmt_ratio(naive_s / shared["ttft_s"]),
            ],
        ],
    )
    print(f"\nshared base vs no sharing: first-turn TTFT {alone['ttft_s'] / shared['ttft_s']:.1f}x lower")
    exact_shared = next(r for r in results if r["share_base"] and r["precision"] == "exact")
    exact_alone = next(r for r in results if not r["share_base"] and r["precision"] == "exact")
    print(
        f"resident sessions within {fmt_mb(budget)}: {exact_shared['resident_on_device']} with a shared base vs "
        f"{exact_alone['resident_on_device']} without (of {sessions} opened)"
    )
    write_json(args.json, {"benchmark": "capacity", "capacity": results, "first_turn_ttft": ttft}, engine)


if __name__ == "__main__":
    main()
