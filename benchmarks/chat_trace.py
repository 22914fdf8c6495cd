"""A seeded synthetic chat-UI trace over the OpenAI endpoint, forks on and off (issue 22).

`--users` (8) simulated users (threads, each with its own official `openai` client, one tenant's
API key) click through a chat UI at the same time, the stateless way stock clients do: every
request posts the whole conversation as the client holds it (the shared system prompt, the
user / assistant turns with the replies as they were RETURNED, then the new user message),
streamed (SSE), greedy, replies of at most `--max-tokens` tokens. Each user's first step starts a
conversation (`first`); every later step, drawn from `random.Random` seeded by `--seed` and the
user's number (so both servers replay the same trace):

    continue    70%   post a new user message after the whole conversation
    regenerate  10%   drop the last reply, post the same last user message again
    edit        10%   pick one of the conversation's user messages i (uniformly, the last one
                      included), drop it and everything after, post a changed text for message i
    new         10%   start over: the shared system prompt and a new user message

The conversation the client keeps afterwards is what it posted plus the reply. Two servers, one
after the other, on the same real default model and the same home settings:

- **forks on**: `chatkv serve` as shipped: a posted history that a session holds but is not its
  whole history (regenerate, edit) forks that session, warm from its KV (`sessions.forks`);
- **forks off**: the same with `CHATKV_FORK_SESSIONS=0`: such a history starts a new session that
  prefills the whole posted history (only the system prompt comes from the tenant's prefix pool).

Token hit rate, per action and overall, tokens summed over requests (cached / computed before):

    cached           usage.prompt_tokens_details.cached_tokens of the request (the server's word:
                     prompt tokens served from its cache instead of prefilled)
    computed before  usage.prompt_tokens minus the tokens of the request's new user turn, i.e. the
                     tokens of the posted conversation up to the end of its last assistant reply
                     (for new / first / an edit of message 0: of the system prompt), which this
                     tenant had computed before (earlier requests of the same user, or the warm-up
                     request for the system prompt). The new user turn is counted with the model's
                     chat template: tokens of [system, user] with the generation prompt minus
                     tokens of [system] alone (`<|im_start|>user\\n...<|im_end|>\\n<|im_start|>
                     assistant\\n`).

So a perfect turn-boundary prefix cache scores 100% on this definition; chatkv's continue scores
slightly less, because the closing tokens of the previous reply (`<|im_end|>\\n`, and its last
generated token when the reply ended on `max_tokens`) were never fed to the model and are
prefilled with the new turn. A regenerate's re-posted user message counts as new (not computed
before), although the parent once computed it.

TTFT is as the client sees it: request sent to the first SSE chunk with content; p50 / p95 per
action. Replies are compared step by step across the two servers (greedy: they should be identical;
batching can flip a near-tie, and a reply that differs changes every later prompt of that user).

    .venv/bin/python benchmarks/chat_trace.py [--quick] [--threads 1] [--steps 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
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

ACTIONS = ("first", "continue", "regenerate", "edit", "new")
CHOICES = (("continue", 0.7), ("regenerate", 0.1), ("edit", 0.1), ("new", 0.1))
HIT_TARGET = 0.95
TTFT_RATIO_TARGET = 1.5
SERVERS = ("forks on", "forks off")


@dataclass(frozen=True)
class Step:
    """One click of the trace: the client posts its first `keep_turns` turns, then `text`."""

    action: str
    keep_turns: int
    text: str
    new_turn_tokens: int
    """Tokens of the new user turn as the chat template renders it (see the module docstring)."""


@dataclass(frozen=True)
class Result:
    """What one request measured (seconds, tokens)."""

    action: str
    started_s: float
    """When the request was sent, from the start of the trace."""
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    computed_before: int
    reply: str
    session_id: str
    same_session: bool
    """Whether the request ran on the session of the user's previous request (a continue should)."""


# -- the trace ---------------------------------------------------------------------------------


def new_turn_tokens(engine: Engine, text: str) -> int:
    """Tokens of the user turn `text` as the chat template adds it after a conversation."""

    def count(messages: list[dict[str, str]], generation_prompt: bool) -> int:
        encoded = engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True
        )
        return len(encoded["input_ids"])

    system = [{"role": "system", "content": SYSTEM_PROMPT}]
    return count([*system, {"role": "user", "content": text}], True) - count(system, False)


def build_trace(engine: Engine, args: argparse.Namespace) -> list[list[Step]]:
    """Every user's steps, from `--seed`; the same for both servers (it does not depend on replies).

    Each message is signed with its user and step, so no two conversations share a history (an
    identical history may share a session, as it should, which would blur the actions)."""
    trace = []
    for user in range(args.users):
        rng = random.Random(f"{args.seed}-{user}")
        steps: list[Step] = []
        turns = 0  # the length of the conversation the client holds
        for k in range(args.steps):
            action = "first" if k == 0 else rng.choices([a for a, _ in CHOICES], [w for _, w in CHOICES])[0]
            keep = {"first": 0, "new": 0, "continue": turns, "regenerate": turns - 1}.get(action)
            if keep is None:  # edit
                keep = rng.randrange(turns)
            if action == "regenerate":
                text = steps_text_of_turn(steps, keep)
            else:
                label = "edited message" if action == "edit" else "message"
                body = user_message(engine, rng.randrange(10_000), args.user_tokens)
                text = f"User {user}, {label} {k}: {body}"
            steps.append(Step(action, keep, text, new_turn_tokens(engine, text)))
            turns = keep + 1
        trace.append(steps)
    return trace


def steps_text_of_turn(steps: Sequence[Step], turn: int) -> str:
    """The user text of turn `turn` of the conversation the client holds after `steps`."""
    texts: list[str] = []
    for step in steps:
        texts = [*texts[: step.keep_turns], step.text]
    return texts[turn]


# -- running it --------------------------------------------------------------------------------


def run_user(client: OpenAI, model: str, steps: Sequence[Step], max_tokens: int, began: float) -> list[Result]:
    """One user's steps, one after another, each posting the conversation as the client holds it
    (`began`: `time.perf_counter()` at the start of the trace)."""
    turns: list[tuple[str, str]] = []
    results: list[Result] = []
    previous_session = None
    for step in steps:
        turns = turns[: step.keep_turns]
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        for user_text, reply in turns:
            messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply}]
        messages.append({"role": "user", "content": step.text})
        started = time.perf_counter() - began
        turn = stream_turn(client, model, messages, max_tokens)
        turns.append((step.text, turn["text"]))
        results.append(
            Result(
                action=step.action,
                started_s=started,
                ttft_s=turn["ttft_s"],
                prompt_tokens=turn["prompt_tokens"],
                cached_tokens=turn["cached_tokens"],
                computed_before=turn["prompt_tokens"] - step.new_turn_tokens,
                reply=turn["text"],
                session_id=turn["session_id"],
                same_session=turn["session_id"] == previous_session,
            )
        )
        previous_session = turn["session_id"]
    return results


def run_trace(url: str, key: str, model: str, trace: list[list[Step]], args: argparse.Namespace) -> dict[str, Any]:
    """Every user runs its steps at once (a barrier starts them together)."""
    results: list[list[Result]] = [[] for _ in trace]
    errors: list[BaseException] = []
    start = threading.Barrier(len(trace) + 1)

    def user(index: int) -> None:
        client = OpenAI(base_url=url, api_key=key, max_retries=0, timeout=600)
        start.wait()
        try:
            results[index] = run_user(client, model, trace[index], args.max_tokens, time.perf_counter())
        except Exception as exc:  # noqa: BLE001 - a thread boundary: reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(len(trace))]
    for t in threads:
        t.start()
    start.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    if errors:
        raise SystemExit(f"{len(errors)} users failed; first: {errors[0]!r}")
    return {"users": results, "wall_s": wall}


def counters(metrics_text: str, name: str, label: str) -> dict[str, float]:
    """The samples of Prometheus counter `name` summed by the value of `label`."""
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line.startswith(name + "{"):
            continue
        match = re.search(rf'{label}="([^"]*)"', line)
        if match is not None:
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def measure(
    engine: Engine, root: Path, args: argparse.Namespace, trace: list[list[Step]], forks: bool
) -> dict[str, Any]:
    """One server (forks on or off) on a fresh home: warm-up, the trace, then its fork counters."""
    name = "forks-on" if forks else "forks-off"
    home = root / name / "home"
    with open_manager(home, engine, args.model_cache_dir) as manager:
        key = manager.issue_api_key(manager.create_tenant("ui"))
        model = manager.model_name
    settings = {"CHATKV_FORK_SESSIONS": "1" if forks else "0"}
    with chatkv_server(home, args, settings, root / f"server-{name}.log") as url:
        warm = OpenAI(base_url=url, api_key=key, max_retries=0, timeout=600)
        # kernels, allocator, and the shared system prompt in the tenant's prefix pool
        warm_up = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Warm up."}]
        stream_turn(warm, model, warm_up, 4)
        run = run_trace(url, key, model, trace, args)
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
    run["forks"] = counters(metrics, "chatkv_forks_total", "source")
    run["turns"] = counters(metrics, "chatkv_turns_total", "restored_from")
    if args.keep_logs:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
        (args.keep_logs / f"server-{name}.log").write_bytes((root / f"server-{name}.log").read_bytes())
    return run


# -- the report --------------------------------------------------------------------------------


def of_action(run: dict[str, Any], action: str | None) -> list[Result]:
    return [r for user in run["users"] for r in user if action is None or r.action == action]


def hit_rate(results: Sequence[Result]) -> float | None:
    computed = sum(r.computed_before for r in results)
    return sum(r.cached_tokens for r in results) / computed if computed else None


def fmt_share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def action_rows(on: dict[str, Any], off: dict[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = []
    for action in (*ACTIONS, None):
        mine, base = of_action(on, action), of_action(off, action)
        if not mine:
            continue
        rows.append(
            [
                action or "all",
                len(mine),
                round(median([r.prompt_tokens for r in mine])),
                round(median([r.cached_tokens for r in mine])),
                fmt_share(hit_rate(mine)),
                fmt_share(hit_rate(base)),
                fmt_s(median([r.ttft_s for r in mine])),
                fmt_s(p95([r.ttft_s for r in mine])),
                fmt_s(median([r.ttft_s for r in base])),
                fmt_s(p95([r.ttft_s for r in base])),
            ]
        )
    return rows


def ttft_ratio(run: dict[str, Any], action: str) -> float | None:
    """p50 TTFT of `action` over p50 TTFT of a continue."""
    mine, cont = of_action(run, action), of_action(run, "continue")
    if not mine or not cont:
        return None
    return median([r.ttft_s for r in mine]) / median([r.ttft_s for r in cont])


def verdict(met: bool | None) -> str:
    return "n/a (no such step)" if met is None else ("met" if met else "NO")


def report(results: dict[str, dict[str, Any]]) -> None:
    on, off = results["forks on"], results["forks off"]
    print_table(
        "per action: token hit rate (cached / computed before, tokens summed) and TTFT as the client sees it",
        [
            "action",
            "requests",
            "prompt p50",
            "cached p50",
            "hit on",
            "hit off",
            "TTFT p50 on",
            "p95 on",
            "TTFT p50 off",
            "p95 off",
        ],
        action_rows(on, off),
    )
    ratios = {a: (ttft_ratio(on, a), ttft_ratio(off, a)) for a in ("regenerate", "edit", "new")}
    print_table(
        "TTFT p50 of an action / TTFT p50 of a continue",
        ["action", "forks on", "forks off"],
        [[a, fmt_ratio(r_on), fmt_ratio(r_off)] for a, (r_on, r_off) in ratios.items()],
    )
    print_table(
        "wall time of the trace and where turns' caches came from (server counters)",
        ["server", "wall", "forks by cache source", "turns by restored_from"],
        [[name, fmt_s(r["wall_s"]), fmt_counts(r["forks"]), fmt_counts(r["turns"])] for name, r in results.items()],
    )
    hit = hit_rate(of_action(on, None))
    print("\ntargets (forks on):")
    print(f"  token hit rate >= {HIT_TARGET:.0%}: {fmt_share(hit)} -> {verdict(hit is not None and hit >= HIT_TARGET)}")
    for action in ("regenerate", "edit"):
        ratio = ratios[action][0]
        met = None if ratio is None else ratio <= TTFT_RATIO_TARGET
        print(f"  {action} TTFT p50 <= {TTFT_RATIO_TARGET}x continue: {fmt_ratio(ratio)} -> {verdict(met)}")
    print_checks(on, off)


def fmt_counts(counts: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(counts.items()) if v) or "-"


def print_checks(on: dict[str, Any], off: dict[str, Any]) -> None:
    print("\nchecks:")
    for name, run in (("forks on", on), ("forks off", off)):
        continues = of_action(run, "continue")
        stayed = sum(r.same_session for r in continues)
        word = "" if stayed == len(continues) else "  <- NO"
        print(f"  {name}: continues that ran on the user's previous session: {stayed} of {len(continues)}{word}")
    pairs = [
        (u, k, a, b)
        for u, (mine, base) in enumerate(zip(on["users"], off["users"], strict=True))
        for k, (a, b) in enumerate(zip(mine, base, strict=True))
    ]
    differ = [(u, k, a.action) for u, k, a, b in pairs if a.reply != b.reply]
    if not differ:
        print(f"  replies identical across the two servers: yes ({len(pairs)} steps)")
    else:
        users = sorted({u for u, _, _ in differ})
        firsts = [min(k for du, k, _ in differ if du == u) for u in users]
        where = ", ".join(f"user {u} from step {k}" for u, k in zip(users, firsts, strict=True))
        print(f"  replies identical across the two servers: WARNING: {len(differ)} of {len(pairs)} differ ({where})")


def main() -> None:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="requests per user")
    parser.add_argument("--user-tokens", type=int, default=64, help="tokens per user message")
    parser.add_argument("--max-tokens", type=int, default=24, help="most tokens per reply")
    parser.add_argument("--keep-logs", type=Path, default=None, help="copy the two servers' logs to this folder")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.user_tokens, args.max_tokens = 5, 32, 12
    engine = setup(args)
    print_header(
        "chatkv: a synthetic chat-UI trace over the OpenAI HTTP API, forks on vs off",
        engine,
        [
            f"{args.users} users x {args.steps} steps (seed {args.seed}; after each user's first: continue 70%, "
            f"regenerate 10%, edit 10%, new 10%), stateless streaming clients (official openai package), "
            f"~{args.user_tokens}-token messages, replies <= {args.max_tokens} tokens, greedy; one chatkv serve "
            f"each (server torch threads: {args.threads or 'default'})",
        ],
    )
    trace = build_trace(engine, args)
    with temp_dir("chat-trace") as root:
        results = {name: measure(engine, root, args, trace, forks=name == "forks on") for name in SERVERS}
    report(results)
    write_json(
        args.json,
        {
            "trace": [[asdict(s) for s in steps] for steps in trace],
            **{
                name: {
                    "wall_s": r["wall_s"],
                    "forks": r["forks"],
                    "turns": r["turns"],
                    "users": [[asdict(x) for x in user] for user in r["users"]],
                }
                for name, r in results.items()
            },
        },
        engine,
    )


if __name__ == "__main__":
    main()
