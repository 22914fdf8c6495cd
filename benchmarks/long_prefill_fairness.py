"""Fairness under long prefills: another tenant's short turn while long requests prefill.

One `chatkv serve` process (the real HTTP API, official `openai` client). A **short** tenant sends
`--short-turns` small turns one after another (a one-message conversation each, `--short-max-tokens`
reply tokens, streamed, greedy) and the benchmark takes each turn's TTFT as the client sees it.
Three phases in one run, on one server:

- **idle**: nothing else runs (the baseline);
- **1 long**: one other tenant's request posting `--long-messages` messages (a long stateless
  history; the server prefills what its window keeps, several thousand tokens) runs meanwhile;
- **4 long**: four such requests, from four tenants, run meanwhile.

The short turns of a loaded phase start `--settle-s` after the long requests are sent, and only
turns that finished before the last long request count; the last phase's long requests are not
waited for (the server stops under them: four take tens of minutes on a loaded 2-core machine).
Printed: the short turn's TTFT p50 and max per phase, the loaded p50 over the idle p50 (target:
<= 2x), the long requests' own TTFT, and the server's resident memory before, at peak and after.

    .venv/bin/python benchmarks/long_prefill_fairness.py [--quick] [--threads 1]
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from _common import (
    SYSTEM_PROMPT,
    base_parser,
    chatkv_server,
    fmt_mb,
    fmt_ratio,
    fmt_s,
    median,
    open_manager,
    print_header,
    print_table,
    setup,
    stream_turn,
    temp_dir,
    write_json,
)
from openai import OpenAI

from sessions.engine import Engine


def long_history(tenant: int, messages: int) -> list[dict[str, str]]:
    """`messages` short messages (user and assistant in turn, a user message last), distinct per tenant."""
    history = [{"role": "system", "content": SYSTEM_PROMPT}]
    for i in range(messages - 1):
        role = "user" if i % 2 == 0 else "assistant"
        history.append({"role": role, "content": f"note {tenant}.{i}: item {i * 7 % 101}"})
    if history[-1]["role"] == "user":
        history.append({"role": "assistant", "content": "ok"})
    history.append({"role": "user", "content": "Summarise the notes."})
    return history


def short_turns(
    url: str, key: str, model: str, count: int, max_tokens: int, until: threading.Event | None
) -> list[float]:
    """TTFTs of `count` one-message turns sent one after another (stopping early once `until` is set)."""
    client = OpenAI(base_url=url, api_key=key, max_retries=0, timeout=600)
    ttfts = []
    for i in range(count):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"Say hello {i}."}]
        turn = stream_turn(client, model, messages, max_tokens)
        if until is not None and until.is_set():
            break
        ttfts.append(turn["ttft_s"])
    return ttfts


def run_long(url: str, key: str, model: str, history: list[dict[str, str]], out: list[dict[str, Any]]) -> None:
    client = OpenAI(base_url=url, api_key=key, max_retries=0, timeout=7200)
    try:
        out.append(stream_turn(client, model, history, 4))
    # A thread boundary: the server stops under the last phase's long requests (not waited for).
    except Exception:  # noqa: BLE001
        return


def loaded_phase(
    url: str, short_key: str, long_keys: list[str], model: str, args: argparse.Namespace, pid: int, wait: bool
) -> dict[str, Any]:
    """Short turns while `len(long_keys)` long requests run; with `wait`, until the long requests end."""
    results: list[dict[str, Any]] = []
    done = threading.Event()
    threads = [
        threading.Thread(
            target=run_long, args=(url, k, model, long_history(i, args.long_messages), results), daemon=True
        )
        for i, k in enumerate(long_keys)
    ]
    began = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(args.settle_s)  # the long requests are parsed, planned and admitted
    peak = [psutil.Process(pid).memory_info().rss]

    def watch() -> None:
        for t in threads:
            t.join()
        done.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ttfts = short_turns(url, short_key, model, args.short_turns, args.short_max_tokens, done)
    while wait and not done.wait(0.2):
        peak.append(psutil.Process(pid).memory_info().rss)
    peak.append(psutil.Process(pid).memory_info().rss)
    return {
        "ttft_s": ttfts,
        "long_ttft_s": [r["ttft_s"] for r in results],
        "long_wall_s": time.perf_counter() - began,
        "long_prompt_tokens": [r["prompt_tokens"] for r in results],
        "peak_rss_bytes": max(peak),
    }


def server_pid(port_url: str) -> int:
    port = int(port_url.rsplit(":", 1)[1].split("/")[0])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return conn.pid
    raise SystemExit(f"no process listens on port {port}")


def measure(engine: Engine, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    home = root / "home"
    with open_manager(home, engine, args.model_cache_dir) as manager:
        short_key = manager.issue_api_key(manager.create_tenant("short"))
        long_keys = [manager.issue_api_key(manager.create_tenant(f"long{i}")) for i in range(max(args.long))]
        model = manager.model_name
    settings = {
        "CHATKV_MAX_PREFILL_TOKENS": str(args.prefill_tokens),
        "CHATKV_MAX_STEP_TOKENS": str(args.step_tokens),
    }
    with chatkv_server(home, args, settings, root / "server.log") as url:
        pid = server_pid(url)
        warm = OpenAI(base_url=url, api_key=short_key, max_retries=0, timeout=600)
        stream_turn(warm, model, [{"role": "user", "content": "Warm up."}], 4)
        rss_before = psutil.Process(pid).memory_info().rss
        idle = short_turns(url, short_key, model, args.short_turns, args.short_max_tokens, None)
        # The last phase's long requests are not waited for (the server stops under them): on a
        # loaded 2-core machine four of them take tens of minutes.
        phases = {
            n: loaded_phase(url, short_key, long_keys[:n], model, args, pid, wait=i < len(args.long) - 1)
            for i, n in enumerate(args.long)
        }
        rss_after = psutil.Process(pid).memory_info().rss  # the last phase's long requests still run
    return {"idle_ttft_s": idle, "phases": phases, "rss_before": rss_before, "rss_after": rss_after}


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--long-messages", type=int, default=2047, help="messages posted by each long request")
    parser.add_argument("--long", type=int, nargs="+", default=[1, 4], help="long requests at once, per phase")
    parser.add_argument("--short-turns", type=int, default=8)
    parser.add_argument("--short-max-tokens", type=int, default=4)
    parser.add_argument("--step-tokens", type=int, default=256, help="the server's max_step_tokens")
    parser.add_argument(
        "--prefill-tokens", type=int, default=32, help="the server's max_prefill_tokens (0: the old rule)"
    )
    parser.add_argument("--settle-s", type=float, default=1.0, help="wait after the long requests are sent")
    args = parser.parse_args()
    if args.quick:
        args.long_messages, args.short_turns = 400, 4
    engine = setup(args)
    print_header(
        "chatkv: another tenant's short turn while long requests prefill (HTTP API)",
        engine,
        [
            f"long requests of {args.long_messages} messages; short turns of {args.short_max_tokens} tokens, "
            f"{args.short_turns} per phase, one at a time; server torch threads: {args.threads or 'default'}; "
            f"max_step_tokens {args.step_tokens}, max_prefill_tokens {args.prefill_tokens}",
        ],
    )
    with temp_dir("long-prefill") as root:
        figures = measure(engine, root, args)
    idle = median(figures["idle_ttft_s"])
    rows = [["idle", len(figures["idle_ttft_s"]), fmt_s(idle), fmt_s(max(figures["idle_ttft_s"])), "1.00x", "-", "-"]]
    for n, phase in figures["phases"].items():
        ttft = phase["ttft_s"]
        rows.append(
            [
                f"{n} long",
                len(ttft),
                fmt_s(median(ttft)) if ttft else "-",
                fmt_s(max(ttft)) if ttft else "-",
                fmt_ratio(median(ttft) / idle) if ttft else "-",
                fmt_s(median(phase["long_ttft_s"])) if phase["long_ttft_s"] else "not waited for",
                round(median(phase["long_prompt_tokens"])) if phase["long_prompt_tokens"] else "-",
            ]
        )
    print_table(
        "short turn TTFT (client side) idle and while long requests run",
        ["phase", "short turns", "TTFT p50", "TTFT max", "p50 / idle p50", "long TTFT p50", "long prompt tokens"],
        rows,
    )
    peak = max(p["peak_rss_bytes"] for p in figures["phases"].values())
    print(
        f"\nserver RSS: {fmt_mb(figures['rss_before'])} before the long requests, peak {fmt_mb(peak)}, "
        f"after {fmt_mb(figures['rss_after'])}"
    )
    write_json(args.json, figures, engine)


if __name__ == "__main__":
    main()
