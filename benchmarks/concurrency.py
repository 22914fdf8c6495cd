"""Concurrent sessions: aggregate throughput, TTFT and queue wait with the engine loop's batching.

N sessions (one tenant each, about `--history-tokens` of history each) send one message at the same
moment and each decodes up to `--new-tokens` tokens. Per N, in one run on one loaded model:

- **chatkv**: the engine loop batches every running turn into each forward pass;
- **chatkv, batching off**: `max_batch_requests = 1` (the running turns take turns, one forward pass
  each: the behaviour before the engine loop);
- **transformers batch**: plain `transformers` greedy decoding of the same N conversations as one
  left-padded batch (`tokenizer.apply_chat_template`, a fresh `DynamicCache` passed as `cache=`,
  `--new-tokens` steps), its prefill of the whole history included.

Throughput is generated tokens over wall time from the common start to the last reply (prefill
included for every column); chatkv's replies end at a stop token, the transformers batch always
runs `--new-tokens` steps, so the table shows both token counts. chatkv prefills only the new
message (the history is cached: the product's point), the transformers batch the whole history, so
each N also prints a **decode-only** rate: the transformers batch's tokens after its prefill over its
decode time, chatkv's tokens after the last turn's first token over the time from then to the last
reply (every turn is decoding by then). Each N's line is printed as soon as it is measured (a
loaded machine may not live to the table). Then two latency checks at
`--busy` running turns: the TTFT of one turn that arrives while the others decode, against the
same turn alone; and the gap between consecutive streamed tokens of the running turns while a
`--long-prompt-tokens` prefill arrives, against the same gaps without it and against one step that
carries a full token budget.

    .venv/bin/python benchmarks/concurrency.py [--quick] [--threads 1] [--sessions 8 16]
        [--no-unbatched] [--no-latency] [--prefill-tokens P]
"""

from __future__ import annotations

import argparse
import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _common import (
    QUESTIONS,
    SYSTEM_PROMPT,
    base_parser,
    fmt_ratio,
    fmt_s,
    median,
    open_manager,
    p95,
    print_header,
    print_table,
    setup,
    sync,
    temp_dir,
    user_message,
    write_json,
)
from transformers import DynamicCache

from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.records import Reply


class Session:
    """One prepared session: tenant, id, its history as messages (for the baseline) and the next message."""

    def __init__(self, manager: SessionManager, index: int, args: argparse.Namespace) -> None:
        self.tenant = manager.create_tenant(f"bench{index}")
        self.sid = manager.open_session(self.tenant, system_prompt=SYSTEM_PROMPT)
        first = user_message(
            manager.internals.engine, index, args.history_tokens - 60, QUESTIONS[index % len(QUESTIONS)]
        )
        reply = manager.chat(self.tenant, self.sid, first, max_new_tokens=48)
        self.history = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": first},
            {"role": "assistant", "content": reply.text},
        ]
        self.next_message = "Now explain it again in much more detail, point by point."


def prepare(manager: SessionManager, count: int, args: argparse.Namespace, offset: int = 0) -> list[Session]:
    sessions = [Session(manager, offset + i, args) for i in range(count)]
    manager.internals.tiers.flush()
    return sessions


def run_together(
    manager: SessionManager, sessions: list[Session], new_tokens: int, ignore_eos: bool = False
) -> dict[str, Any]:
    """Every session sends its next message at once; returns throughput, TTFT and queue figures.
    `ignore_eos`: no stop token ends a reply, so each runs to `new_tokens` as the transformers batch does."""
    replies: list[Reply | None] = [None] * len(sessions)
    start = threading.Barrier(len(sessions) + 1)

    def turn(i: int) -> None:
        start.wait()
        s = sessions[i]
        replies[i] = manager.chat(s.tenant, s.sid, s.next_message, max_new_tokens=new_tokens, ignore_eos=ignore_eos)

    threads = [threading.Thread(target=turn, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    done = [r for r in replies if r is not None]
    tokens = sum(r.stats.decode_tokens for r in done)
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        # From the last first token on, every turn decodes: the aggregate decode rate, prefill excluded.
        "decode_tokens_per_s": (tokens - len(done)) / max(wall - max(r.stats.ttft_s for r in done), 1e-9),
        "ttft_s": [r.stats.ttft_s for r in done],
        "queue_s": [r.stats.queue_s for r in done],
        "reused_tokens": [r.stats.reused_tokens for r in done],
    }


@torch.inference_mode()
def transformers_batch(engine: Engine, sessions: list[Session], new_tokens: int) -> dict[str, Any]:
    """Plain transformers: the N conversations as one left-padded batch, greedy, `new_tokens` steps."""
    tokenizer = engine.tokenizer
    rows = []
    for s in sessions:
        messages = [*s.history, {"role": "user", "content": s.next_message}]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        rows.append(tokenizer.encode(rendered, add_special_tokens=False))
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else engine.stop_token_ids[0]
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=engine.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=engine.device)
    # On a GPU the kernels run asynchronously: synchronise before every clock read (chatkv's turns
    # wait for each sampled token anyway).
    sync(engine)
    began = time.perf_counter()
    cache = DynamicCache()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = engine.model(
        input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
    )
    sync(engine)
    prefill_s = time.perf_counter() - began
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(new_tokens - 1):
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        positions = positions[:, -1:] + 1
        out = engine.model(input_ids=token, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    sync(engine)
    wall = time.perf_counter() - began
    tokens = new_tokens * len(sessions)
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "prefill_s": prefill_s,
        "decode_tokens_per_s": (tokens - len(sessions)) / (wall - prefill_s),
    }


def stream_gaps(
    manager: SessionManager,
    session: Session,
    new_tokens: int,
    out: list[float],
    go: threading.Event,
    ignore_eos: bool = False,
) -> None:
    """Stream one turn, appending the times at which pieces arrive."""
    go.wait()
    stream = manager.stream_chat(
        session.tenant, session.sid, session.next_message, max_new_tokens=new_tokens, ignore_eos=ignore_eos
    )
    for item in stream:
        if not isinstance(item, Reply):
            out.append(time.perf_counter())


def latency_checks(engine: Engine, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The arriving turn's TTFT, and the running decodes' token gaps while a long prefill arrives."""
    busy = args.busy
    with open_manager(
        root / "latency",
        engine,
        args.model_cache_dir,
        max_step_tokens=args.step_tokens,
        max_prefill_tokens=args.prefill_tokens,
    ) as manager:
        twins = prepare(manager, 2, args, offset=100)  # same history twice: one solo, one under load
        twins[1].next_message = twins[0].next_message
        solo = manager.chat(twins[0].tenant, twins[0].sid, twins[0].next_message, max_new_tokens=8).stats.ttft_s

        offsets = itertools.count(200, busy)

        def run_with_arrival(arrive: Any) -> tuple[list[list[float]], Any]:
            runners = prepare(manager, busy, args, offset=next(offsets))
            stamps: list[list[float]] = [[] for _ in runners]
            go = threading.Event()
            threads = [
                threading.Thread(target=stream_gaps, args=(manager, s, args.new_tokens, stamps[i], go, args.ignore_eos))
                for i, s in enumerate(runners)
            ]
            for t in threads:
                t.start()
            go.set()
            # Every running turn is decoding (or a reply ended early at a stop token: do not wait forever).
            while min(len(s) for s in stamps) < 4 and all(t.is_alive() for t in threads):
                time.sleep(0.005)
            arrived_at = time.perf_counter()
            result = arrive()
            for t in threads:
                t.join()
            return [[b - a for a, b in itertools.pairwise(s) if b >= arrived_at] for s in stamps], result

        _, loaded = run_with_arrival(
            lambda: manager.chat(twins[1].tenant, twins[1].sid, twins[1].next_message, max_new_tokens=8).stats.ttft_s
        )
        quiet_gaps, _ = run_with_arrival(lambda: None)
        long_session = prepare(manager, 1, args, offset=300)[0]
        long_text = user_message(engine, 7, args.long_prompt_tokens)
        gaps, long_reply = run_with_arrival(
            lambda: manager.chat(long_session.tenant, long_session.sid, long_text, max_new_tokens=4)
        )
        step_floor = full_step_s(engine, args.step_tokens)
    quiet = [g for row in quiet_gaps for g in row]
    during = [g for row in gaps for g in row[: max(1, len(row) // 2)]]
    return {
        "solo_ttft_s": solo,
        "loaded_ttft_s": loaded,
        "quiet_gap_median_s": median(quiet),
        "long_prefill_tokens": long_reply.stats.prefill_tokens,
        "long_prefill_ttft_s": long_reply.stats.ttft_s,
        "gap_during_prefill_max_s": max(during),
        "gap_during_prefill_median_s": median(during),
        "budget_step_s": step_floor,
    }


@torch.inference_mode()
def full_step_s(engine: Engine, step_tokens: int) -> float:
    """Time of one forward pass of `step_tokens` prefill tokens after ~300 cached tokens (median of 3)."""
    times = []
    for _ in range(3):
        working = engine.empty_cache(None).to_working_cache(300 + step_tokens)
        engine.prefill(working, list(range(1000, 1300)))
        sync(engine)
        began = time.perf_counter()
        engine.prefill(working, list(range(2000, 2000 + step_tokens)))
        sync(engine)
        times.append(time.perf_counter() - began)
    return median(times)


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--history-tokens", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--busy", type=int, default=7, help="running turns in the latency checks")
    parser.add_argument("--long-prompt-tokens", type=int, default=2000)
    parser.add_argument("--step-tokens", type=int, default=256, help="the loop's max_step_tokens")
    parser.add_argument("--prefill-tokens", type=int, default=32, help="the loop's max_prefill_tokens (0: no cap)")
    parser.add_argument(
        "--unbatched",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the 'batching off' column (N turns one after another: the slowest part at large N)",
    )
    parser.add_argument(
        "--latency", action=argparse.BooleanOptionalAction, default=True, help="run the two latency checks"
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="chatkv's measured replies run to --new-tokens (stop tokens masked), as the transformers batch "
        "always does: equal token counts in both columns (a random --model stops at arbitrary points)",
    )
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.new_tokens, args.busy, args.long_prompt_tokens = [1, 2, 4], 16, 3, 600
    engine = setup(args)
    print_header(
        "chatkv: concurrent sessions through the engine loop",
        engine,
        [
            f"{args.history_tokens}-token histories, up to {args.new_tokens} new tokens per turn, greedy; "
            f"max_step_tokens {args.step_tokens}, max_prefill_tokens {args.prefill_tokens}",
        ],
    )
    rows, raw = [], []
    with temp_dir("concurrency") as root:
        for n in args.sessions:
            figures: dict[str, Any] = {"sessions": n}
            columns = (("chatkv", 0), ("batching off", 1)) if args.unbatched else (("chatkv", 0),)
            for label, batch_cap in columns:
                # A manager configures the shared engine loop from its settings when it opens.
                limits = {
                    "max_step_tokens": args.step_tokens,
                    "max_prefill_tokens": args.prefill_tokens,
                    "max_batch_requests": batch_cap,
                }
                with open_manager(root / f"{label}-{n}", engine, args.model_cache_dir, **limits) as manager:
                    sessions = prepare(manager, n, args)
                    figures[label] = run_together(manager, sessions, args.new_tokens, args.ignore_eos)
                    baseline_sessions = sessions
            figures["transformers"] = transformers_batch(engine, baseline_sessions, args.new_tokens)
            raw.append(figures)
            ours, plain = figures["chatkv"], figures["transformers"]
            off = figures.get("batching off", {"tokens_per_s": float("nan"), "ttft_s": [float("nan")]})
            # One line per N as soon as it is measured: on a loaded machine a run may not live to the table.
            print(
                f"N={n}: chatkv {ours['tokens_per_s']:.1f} tok/s, transformers batch {plain['tokens_per_s']:.1f} tok/s "
                f"({fmt_ratio(ours['tokens_per_s'] / plain['tokens_per_s'])}); decode only: chatkv "
                f"{ours['decode_tokens_per_s']:.1f}, transformers {plain['decode_tokens_per_s']:.1f} tok/s "
                f"({fmt_ratio(ours['decode_tokens_per_s'] / plain['decode_tokens_per_s'])}); "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            rows.append(
                [
                    n,
                    f"{ours['tokens_per_s']:.1f}",
                    f"{off['tokens_per_s']:.1f}",
                    f"{plain['tokens_per_s']:.1f}",
                    fmt_ratio(ours["tokens_per_s"] / plain["tokens_per_s"]),
                    f"{ours['tokens']} / {plain['tokens']}",
                    fmt_s(median(ours["ttft_s"])),
                    fmt_s(p95(ours["ttft_s"])),
                    fmt_s(median(ours["queue_s"])),
                    fmt_s(p95(ours["queue_s"])),
                    fmt_s(median(off["ttft_s"])),
                    fmt_s(p95(off["ttft_s"])),
                ]
            )
        one = raw[0]["chatkv"]["tokens_per_s"] if raw and raw[0]["sessions"] == 1 else None
        print_table(
            "aggregate throughput (generated tokens / wall time, prefill included) and TTFT",
            [
                "N",
                "chatkv tok/s",
                "batching off tok/s",
                "transformers batch tok/s",
                "chatkv / transformers",
                "tokens chatkv / transformers",
                "TTFT p50",
                "TTFT p95",
                "queue p50",
                "queue p95",
                "off: TTFT p50",
                "off: TTFT p95",
            ],
            rows,
        )
        if one and args.unbatched:
            for figures in raw:
                n = figures["sessions"]
                print(
                    f"N={n}: chatkv {fmt_ratio(figures['chatkv']['tokens_per_s'] / one)} of N=1; "
                    f"batching off {fmt_ratio(figures['batching off']['tokens_per_s'] / one)} of N=1"
                )
        latency = latency_checks(engine, args, root) if args.latency else None
    if latency is None:
        write_json(args.json, {"throughput": raw}, engine)
        return
    print(
        f"\narriving turn among {args.busy} decoding: TTFT {fmt_s(latency['loaded_ttft_s'])} vs alone "
        f"{fmt_s(latency['solo_ttft_s'])} ({fmt_ratio(latency['loaded_ttft_s'] / latency['solo_ttft_s'])})"
    )
    print(
        f"{args.busy} running decodes, gap between streamed tokens: {fmt_s(latency['quiet_gap_median_s'])} median "
        f"without a long prefill; while a {latency['long_prefill_tokens']}-token prefill arrives: median "
        f"{fmt_s(latency['gap_during_prefill_median_s'])}, max {fmt_s(latency['gap_during_prefill_max_s'])}; "
        f"one {args.step_tokens}-token step alone: {fmt_s(latency['budget_step_s'])}"
    )
    write_json(args.json, {"throughput": raw, "latency": latency}, engine)


if __name__ == "__main__":
    main()
