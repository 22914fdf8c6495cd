"""Multi-turn chat over the OpenAI-compatible HTTP API: session reuse against re-prefilling every turn.

`--users` (8) simulated users (threads, each with its own official `openai` client) hold
`--turns` (5) turn conversations at the same time with one `chatkv serve` process, the stateless
way stock clients do: every request posts the whole conversation so far, streamed (SSE), greedy.
Servers one after the other, on the same real default model:

- **chatkv**: the server finds each posted history's session and continues it from its cache
  (`usage.prompt_tokens_details.cached_tokens` says how much was served from it);
- **re-prefill**: the same server with `CHATKV_REUSE_KV=0`, the benchmark baseline: every turn
  takes the rebuild path (the whole conversation prefilled, no prefix pool, no cache kept), what a
  server without KV reuse does.

A third server holds the same conversations the Responses way (**responses**): each turn sends
only the new user message with `previous_response_id` (the stream of
`client.responses.create(..., stream=True)`), so the chain continues its session with nothing
posted twice and nothing looked up by history. Each pattern has a fresh server of its own, so
neither runs beside the other's sessions (an earlier version ran Responses second on the chatkv
server, behind 8 sessions' write-backs).

Per turn: TTFT as the client sees it (request sent to the first SSE chunk with content), median and
p95 over users; then aggregate throughput (completion tokens of every turn of every user over the
wall time of the whole run) and the server process's CPU time over the measured turns (it moves
little with other processes' load, wall time does: on a shared machine it is the steadier way to
see what the Responses pattern costs beside chat completions). Replies are compared across the
servers (greedy: they should be identical; batching can flip a near-tie, which is reported, not
hidden).

Those three patterns run one after the other, so on a shared machine the load drifts between them
and the responses/chatkv TTFT ratio of that table swings with it. The **paired** comparison
(`--mode paired`, or after the concurrent one with the default `--mode both`) cancels the drift:
one fresh server holds both patterns, chat completions under one tenant and Responses under another
(tenants share nothing: no session, no prefix pool entry, no cache crosses them, so neither pattern
reuses the other's work), and `--paired-users` users take their turns one request at a time, each
turn a pair of one chat completions and one Responses request in the order A B, B A, A B, ... so
each pattern goes first as often as second; after each request `--settle` seconds pass so its
after-reply work does not run into the next one. One request at a time leaves no batching in the
TTFT. Printed: per turn the two TTFT medians and the median of the per-pair ratios
responses/chat completions with its range, then the median ratio over all pairs and over the warm
turns (1 on) with a bootstrap 95% interval, and the server CPU time of each pattern's requests.

    .venv/bin/python benchmarks/http_multiturn.py [--quick] [--threads 1] [--mode both|concurrent|paired]
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from _common import (
    SYSTEM_PROMPT,
    base_parser,
    chatkv_server,
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

from sessions.engine import Engine


@dataclass
class UserRun:
    """One simulated user's conversation and what each of its turns measured."""

    ttft_s: list[float] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    sessions: set[str] = field(default_factory=set)


def stream_response_turn(
    client: OpenAI, model: str, previous: str | None, text: str, max_tokens: int
) -> dict[str, Any]:
    """One streamed, greedy Responses turn sending only `text` after `previous` (a response id;
    `None`: the first turn, with the system prompt as `instructions`). TTFT is from sending the
    request to the first text delta (seconds). Returns what `stream_turn` returns, `session_id`
    being the response's id."""
    started = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    final = None
    instructions = SYSTEM_PROMPT if previous is None else None
    stream = client.responses.create(
        model=model,
        input=text,
        instructions=instructions,
        previous_response_id=previous,
        max_output_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    for event in stream:
        if event.type == "response.output_text.delta" and event.delta:
            ttft = ttft if ttft is not None else time.perf_counter() - started
            pieces.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    if final is None or final.usage is None:
        raise SystemExit("the server sent no final response event")
    return {
        "ttft_s": ttft if ttft is not None else time.perf_counter() - started,
        "text": "".join(pieces),
        "session_id": final.id,
        "cached_tokens": final.usage.input_tokens_details.cached_tokens,
        "prompt_tokens": final.usage.input_tokens,
        "completion_tokens": final.usage.output_tokens,
    }


def run_users(
    url: str, key: str, model: str, messages: list[list[str]], args: argparse.Namespace, *, responses: bool = False
) -> dict[str, Any]:
    """Every user holds its conversation at once (a barrier starts them together): stateless chat
    completions, or with `responses` a Responses chain (only the new message each turn)."""
    runs = [UserRun() for _ in messages]
    errors: list[BaseException] = []
    start = threading.Barrier(len(messages) + 1)

    def user(index: int) -> None:
        client = OpenAI(base_url=url, api_key=key, max_retries=0, timeout=600)
        run = runs[index]
        conversation = [{"role": "system", "content": SYSTEM_PROMPT}]
        previous = None
        start.wait()
        try:
            for text in messages[index]:
                if responses:
                    turn = stream_response_turn(client, model, previous, text, args.max_tokens)
                    previous = turn["session_id"]
                    run.replies.append(turn["text"])
                    _record(run, turn)
                    continue
                conversation.append({"role": "user", "content": text})
                turn = stream_turn(client, model, conversation, args.max_tokens)
                conversation.append({"role": "assistant", "content": turn["text"]})
                run.replies.append(turn["text"])
                run.sessions.add(turn["session_id"])
                _record(run, turn)
        except Exception as exc:  # noqa: BLE001 - a thread boundary: reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(len(messages))]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    if errors:
        raise SystemExit(f"{len(errors)} users failed; first: {errors[0]!r}")
    tokens = sum(sum(r.completion_tokens) for r in runs)
    return {"runs": runs, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


def _record(run: UserRun, turn: dict[str, Any]) -> None:
    run.ttft_s.append(turn["ttft_s"])
    run.cached_tokens.append(turn["cached_tokens"])
    run.prompt_tokens.append(turn["prompt_tokens"])
    run.completion_tokens.append(turn["completion_tokens"])


def measure(
    engine: Engine, root: Path, args: argparse.Namespace, messages: list[list[str]], pattern: str
) -> dict[str, dict[str, Any]]:
    """One pattern (`chatkv`, `responses` or `re-prefill`) on a fresh server of its own. Returns
    its results under its name."""
    home = root / pattern / "home"
    with open_manager(home, engine, args.model_cache_dir) as manager:
        key = manager.issue_api_key(manager.create_tenant("bot"))
        model = manager.model_name
    settings = {"CHATKV_REUSE_KV": "0" if pattern == "re-prefill" else "1"}
    with chatkv_server(home, args, settings, home.parent / f"server-{pattern}.log") as url:
        warm = OpenAI(base_url=url, api_key=key, max_retries=0, timeout=600)
        stream_turn(warm, model, [{"role": "user", "content": "Warm up."}], 4)  # kernels, allocator
        server = _server_process(url)
        before = server.cpu_times()
        figures = run_users(url, key, model, messages, args, responses=pattern == "responses")
        after = server.cpu_times()
        # CPU time barely moves with other processes' load (wall time on a shared 2-core machine
        # does), so it shows what one pattern costs the server beside another.
        figures["server_cpu_s"] = (after.user + after.system) - (before.user + before.system)
        return {pattern: figures}


@dataclass
class Pair:
    """One user's turn both ways on the paired server: TTFT (seconds) and server CPU time (seconds,
    the request's window and its settle time) of the chat completions (`chat`) and Responses
    (`resp`) request, and which went first."""

    user: int
    turn: int
    chat_first: bool
    chat_ttft_s: float
    resp_ttft_s: float
    chat_cpu_s: float
    resp_cpu_s: float

    @property
    def ratio(self) -> float:
        """Responses TTFT over chat completions TTFT."""
        return self.resp_ttft_s / self.chat_ttft_s


def measure_paired(
    engine: Engine, root: Path, args: argparse.Namespace, messages: list[list[str]]
) -> tuple[list[Pair], list[UserRun], list[UserRun]]:
    """Both patterns on one fresh server, each under its own tenant, one request at a time in the
    order A B, B A, ... (pair k runs chat completions first when k is even). Returns the pairs and
    each pattern's runs (chat completions, Responses)."""
    home = root / "paired" / "home"
    with open_manager(home, engine, args.model_cache_dir) as manager:
        chat_key = manager.issue_api_key(manager.create_tenant("chat"))
        resp_key = manager.issue_api_key(manager.create_tenant("responses"))
        model = manager.model_name
    with chatkv_server(home, args, {"CHATKV_REUSE_KV": "1"}, home.parent / "server-paired.log") as url:
        chat = OpenAI(base_url=url, api_key=chat_key, max_retries=0, timeout=600)
        resp = OpenAI(base_url=url, api_key=resp_key, max_retries=0, timeout=600)
        # Kernels and allocator; the same system prompt both ways, so each tenant's prefix pool
        # starts alike.
        stream_turn(chat, model, [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hi."}], 4)
        stream_response_turn(resp, model, None, "Hi.", 4)
        server = _server_process(url)
        chat_runs = [UserRun() for _ in messages]
        resp_runs = [UserRun() for _ in messages]
        conversations = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in messages]
        previous: list[str | None] = [None] * len(messages)
        pairs: list[Pair] = []

        def timed(request: Any) -> tuple[dict[str, Any], float]:
            before = server.cpu_times()
            turn = request()
            time.sleep(args.settle)  # the request's after-reply work lands in its own window
            after = server.cpu_times()
            return turn, (after.user + after.system) - (before.user + before.system)

        def chat_turn(u: int, text: str) -> tuple[dict[str, Any], float]:
            conversations[u].append({"role": "user", "content": text})
            turn, cpu = timed(lambda: stream_turn(chat, model, conversations[u], args.max_tokens))
            conversations[u].append({"role": "assistant", "content": turn["text"]})
            chat_runs[u].sessions.add(turn["session_id"])
            return turn, cpu

        def resp_turn(u: int, text: str) -> tuple[dict[str, Any], float]:
            turn, cpu = timed(lambda: stream_response_turn(resp, model, previous[u], text, args.max_tokens))
            previous[u] = turn["session_id"]
            return turn, cpu

        for t in range(args.turns):
            for u, texts in enumerate(messages):
                chat_first = len(pairs) % 2 == 0
                if chat_first:
                    (a, a_cpu), (b, b_cpu) = chat_turn(u, texts[t]), resp_turn(u, texts[t])
                else:
                    (b, b_cpu), (a, a_cpu) = resp_turn(u, texts[t]), chat_turn(u, texts[t])
                for run, turn in ((chat_runs[u], a), (resp_runs[u], b)):
                    run.replies.append(turn["text"])
                    _record(run, turn)
                pairs.append(Pair(u, t, chat_first, a["ttft_s"], b["ttft_s"], a_cpu, b_cpu))
    return pairs, chat_runs, resp_runs


def bootstrap_median_interval(values: list[float], seed: int, resamples: int = 2000) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the median over `resamples` resamples of `values` with
    replacement (the percentile bootstrap, Efron 1979)."""
    rng = random.Random(seed)
    medians = sorted(median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def report_paired(
    pairs: list[Pair], chat_runs: list[UserRun], resp_runs: list[UserRun], args: argparse.Namespace
) -> None:
    """The paired comparison's tables and summary lines."""
    rows = []
    for t in range(args.turns):
        turn = [p for p in pairs if p.turn == t]
        ratios = [p.ratio for p in turn]
        rows.append(
            [
                t,
                len(turn),
                round(median([r.cached_tokens[t] for r in chat_runs])),
                round(median([r.cached_tokens[t] for r in resp_runs])),
                fmt_s(median([p.chat_ttft_s for p in turn])),
                fmt_s(median([p.resp_ttft_s for p in turn])),
                f"{median(ratios):.3f}x",
                f"{min(ratios):.2f}-{max(ratios):.2f}",
            ]
        )
    print_table(
        f"paired, one request at a time, one server, two tenants (settle {args.settle} s): TTFT per turn",
        [
            "turn",
            "pairs",
            "chat cached p50",
            "responses cached p50",
            "chat p50",
            "responses p50",
            "responses/chat per-pair p50",
            "per-pair range",
        ],
        rows,
    )
    for label, chosen in (("all turns", pairs), ("warm turns (1 on)", [p for p in pairs if p.turn > 0])):
        if not chosen:
            continue
        ratios = [p.ratio for p in chosen]
        low, high = bootstrap_median_interval(ratios, args.seed)
        first = median([p.ratio for p in chosen if p.chat_first] or [float("nan")])
        second = median([p.ratio for p in chosen if not p.chat_first] or [float("nan")])
        print(
            f"paired TTFT responses/chat completions, {label}: median {median(ratios):.3f}x over {len(ratios)} pairs "
            f"(bootstrap 95% {low:.3f}-{high:.3f}; chat first {first:.3f}x, responses first {second:.3f}x)"
        )
    chat_cpu, resp_cpu = sum(p.chat_cpu_s for p in pairs), sum(p.resp_cpu_s for p in pairs)
    print(
        f"paired server CPU time: chat completions {fmt_s(chat_cpu)}, responses {fmt_s(resp_cpu)} "
        f"({resp_cpu / chat_cpu:.3f}x; request windows plus settle, 10 ms clock ticks)"
    )
    same = sum(a.replies == b.replies for a, b in zip(chat_runs, resp_runs, strict=True))
    verdict = "yes" if same == len(chat_runs) else f"WARNING: {len(chat_runs) - same} of {len(chat_runs)} differ"
    print(f"paired replies identical between chat completions and responses: {verdict}")


def _server_process(url: str) -> psutil.Process:
    """The `chatkv serve` child process listening at `url`'s port."""
    port = url.rsplit(":", 1)[1].split("/", 1)[0]
    for child in psutil.Process().children():
        if port in child.cmdline():
            return child
    raise SystemExit(f"no server process listens on port {port}")


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--user-tokens", type=int, default=80, help="tokens per user message")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens per reply")
    parser.add_argument(
        "--mode", choices=["both", "concurrent", "paired"], default="both", help="which comparisons to run"
    )
    parser.add_argument(
        "--paired-users", type=int, default=None, help="users of the paired comparison (default and most: --users)"
    )
    parser.add_argument("--settle", type=float, default=0.2, help="seconds of quiet after each paired request")
    args = parser.parse_args()
    if args.quick:
        args.turns, args.user_tokens, args.max_tokens = 3, 40, 16
    args.paired_users = args.users if args.paired_users is None else args.paired_users
    if not 1 <= args.paired_users <= args.users:
        parser.error(f"--paired-users must be between 1 and --users ({args.users}), got {args.paired_users}")
    if args.settle < 0:
        parser.error(f"--settle must be >= 0, got {args.settle}")
    engine = setup(args)
    print_header(
        "chatkv: multi-turn chat over the OpenAI HTTP API, session reuse vs re-prefill, and the Responses API",
        engine,
        [
            f"{args.users} users x {args.turns} turns, stateless streaming clients (official openai package), "
            f"~{args.user_tokens}-token messages, replies <= {args.max_tokens} tokens, greedy "
            f"(server torch threads: {args.threads or 'default'})",
            f"comparisons: {args.mode}; concurrent: one chatkv serve per pattern, one after the other; paired: "
            f"{args.paired_users} users one request at a time, chat completions and Responses on one server "
            "under two tenants, orders alternating",
        ],
    )
    # The fixed texts repeat after 12 paragraphs: each user signs its messages, so no two users
    # hold the same conversation (identical histories may share a session, as they should).
    messages = [
        [f"User {u}: {user_message(engine, u * args.turns + t, args.user_tokens)}" for t in range(args.turns)]
        for u in range(args.users)
    ]
    payload: dict[str, Any] = {}
    with temp_dir("http-multiturn") as root:
        if args.mode in ("both", "concurrent"):
            results = {
                **measure(engine, root, args, messages, "chatkv"),
                **measure(engine, root, args, messages, "responses"),
                **measure(engine, root, args, messages, "re-prefill"),
            }
            report_concurrent(results, args)
            payload.update(
                {
                    name: {
                        "wall_s": r["wall_s"],
                        "tokens": r["tokens"],
                        "tokens_per_s": r["tokens_per_s"],
                        "users": [
                            {"ttft_s": u.ttft_s, "cached_tokens": u.cached_tokens, "prompt_tokens": u.prompt_tokens}
                            for u in r["runs"]
                        ],
                    }
                    for name, r in results.items()
                }
            )
        if args.mode in ("both", "paired"):
            paired_messages = messages[: args.paired_users]
            pairs, chat_runs, resp_runs = measure_paired(engine, root, args, paired_messages)
            report_paired(pairs, chat_runs, resp_runs, args)
            payload["paired"] = [vars(p) for p in pairs]
    write_json(args.json, payload, engine)


def report_concurrent(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """The concurrent comparison's tables and summary lines."""
    ours, base, chained = results["chatkv"]["runs"], results["re-prefill"]["runs"], results["responses"]["runs"]
    rows = []
    for t in range(args.turns):
        on = [r.ttft_s[t] for r in ours]
        off = [r.ttft_s[t] for r in base]
        chain = [r.ttft_s[t] for r in chained]
        rows.append(
            [
                t,
                round(median([r.prompt_tokens[t] for r in ours])),
                round(median([r.cached_tokens[t] for r in ours])),
                round(median([r.cached_tokens[t] for r in chained])),
                fmt_s(median(on)),
                fmt_s(p95(on)),
                fmt_s(median(chain)),
                fmt_s(p95(chain)),
                fmt_s(median(off)),
                fmt_s(p95(off)),
                fmt_ratio(median(off) / median(on)),
                fmt_ratio(median(on) / median(chain)),
            ]
        )
    print_table(
        "per-turn TTFT as the client sees it (request to first content chunk), over users",
        [
            "turn",
            "prompt tokens p50",
            "cached p50",
            "responses cached p50",
            "chatkv p50",
            "chatkv p95",
            "responses p50",
            "responses p95",
            "re-prefill p50",
            "re-prefill p95",
            "re-prefill/chatkv p50",
            "chatkv/responses p50",
        ],
        rows,
    )
    print_table(
        "aggregate throughput (completion tokens of all turns / wall time of the whole run)",
        ["server", "tokens", "wall", "tokens/s", "server CPU", "server CPU per turn"],
        [
            [
                name,
                r["tokens"],
                fmt_s(r["wall_s"]),
                f"{r['tokens_per_s']:.1f}",
                fmt_s(r["server_cpu_s"]),
                fmt_s(r["server_cpu_s"] / (args.users * args.turns)),
            ]
            for name, r in results.items()
        ],
    )
    cpu_ratio = results["responses"]["server_cpu_s"] / results["chatkv"]["server_cpu_s"]
    print(f"\nserver CPU time responses / chatkv (stateless chat completions): {fmt_ratio(cpu_ratio)}")
    ratio = results["chatkv"]["tokens_per_s"] / results["re-prefill"]["tokens_per_s"]
    last = args.turns - 1
    print(f"\nthroughput chatkv / re-prefill: {fmt_ratio(ratio)}")
    chain_ratio = results["responses"]["tokens_per_s"] / results["chatkv"]["tokens_per_s"]
    print(f"throughput responses / chatkv (stateless chat completions): {fmt_ratio(chain_ratio)}")
    print(
        f"last turn TTFT p50: chatkv {fmt_s(median([r.ttft_s[last] for r in ours]))}, re-prefill "
        f"{fmt_s(median([r.ttft_s[last] for r in base]))} "
        f"({fmt_ratio(median([r.ttft_s[last] for r in base]) / median([r.ttft_s[last] for r in ours]))})"
    )
    one_session = all(len(r.sessions) == 1 for r in ours + base)
    print(f"each user's turns continued one session: {'yes' if one_session else 'NO'}")
    same = sum(a.replies == b.replies for a, b in zip(ours, base, strict=True))
    verdict = "yes" if same == len(ours) else f"WARNING: {len(ours) - same} of {len(ours)} differ"
    print(f"replies identical, chatkv and re-prefill: {verdict}")
    same = sum(a.replies == b.replies for a, b in zip(ours, chained, strict=True))
    verdict = "yes" if same == len(ours) else f"WARNING: {len(ours) - same} of {len(ours)} differ"
    print(f"replies identical between chat completions and responses: {verdict}")


if __name__ == "__main__":
    main()
