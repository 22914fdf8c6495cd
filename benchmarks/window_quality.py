"""Window policies compared (issues 13, 31): `turns` (whole oldest turns demoted) against `attention`
(tokens evicted per KV head by the attention of the new turn's last queries, SnapKV-style) and
`agnostic` (the same eviction by scores fixed when the earlier turns committed), on the real default
model, greedy. The replay logs every turn's queries and commits `agnostic`'s scores, as chatkv's
runner does under that policy.

Each conversation is first run through chatkv with an unbounded window (the reference: exact cache,
its greedy replies). Then, for each policy and context budget, the same conversation (the
reference's user messages and replies, teacher-forced) is replayed into a session cache with
chatkv's own window step (`sessions.turn.window.TurnWindow.fit`, the code a turn runs) before every
turn, so every policy sees the same history and differs only in what its window kept. (In the
replay each turn layer starts with the closing of the previous reply instead of ending with it,
as chatkv's manager does; a 2-token difference per layer boundary.)

1. Recall: `--recall` (30) conversations in which turn 1 states a fact (an order number, a name,
   a date), 10-14 short filler turns follow (replies cut at 4 tokens, to keep the run short) and
   the last turn asks for the fact (a 16-token reply). The budget
   (`--recall-budget`, 256 tokens) is small enough that `turns` must drop turn 1. Reported: the
   share of final replies that contain the fact, per policy and for the unbounded reference.
2. Quality at equal cache size: `--conversations` (20) long conversations (`--turns` 5 turns of
   ~60-token paragraphs and questions, 16-token replies). The last reply of the reference is fed
   after each policy's cache: top-1 agreement of the next-token argmax with the reference and
   mean KL(reference || policy) over the reply's positions, at budgets of 10/25/50/75% of the full
   length.
   Since `turns` drops whole turns it often holds far fewer tokens than the budget, so each
   policy's *actual* cache size (tokens held when the last turn starts) is reported, and the cache
   size each policy needs for 95% top-1 agreement is interpolated on its own curve of agreement
   against actual size (linear between measured points; the unbounded cache is the 100% point).
   Where the attention policy's recent window (never evicted) leaves no room for a turn at a small
   budget, chatkv refuses the turn (`ContextTooLong`); the benchmark then measures that
   conversation with `window_recent_tokens` 0 and counts it.
3. Cost: seconds per evicting turn (the window step, then the prefill of the turn's ids and its
   teacher-forced reply), `attention` against `turns` at the same budget; the `attention` turn
   prefills its ids once on the full cache with the observation window captured, then evicts and
   carries the prefill over (split out: the observed prefill, the gather and carry).

    .venv/bin/python benchmarks/window_quality.py --threads 1
    .venv/bin/python benchmarks/window_quality.py --threads 1 --quick     # 6 + 4 conversations
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import torch
from _common import PARAGRAPHS, QUESTIONS, base_parser, open_manager, print_header, print_table, setup, temp_dir
from _common import write_json as write_json_file

from cache.attention_scores import QueryLog
from cache.ids import PrefixKey
from cache.session_cache import BaseLayer, LayerKind, LayerSpan, SessionCache
from cache.token_eviction import committed_scores
from cache.window_policy import WindowPolicy
from cache.working_cache import WorkingCache
from sessions.engine import Engine
from sessions.errors import ContextTooLong
from sessions.sampling import SamplingParams
from sessions.turn.window import FittedWindow, TurnWindow

SYSTEM = "You are a helpful assistant. Answer briefly."
POLICIES = ("turns", "attention", "agnostic")
FRACTIONS = (0.1, 0.25, 0.5, 0.75)
REPORTED = FRACTIONS
FACTS = (
    ("order number", ("48213", "77530", "19064", "62871", "30495")),
    ("name", ("Marguerite", "Tobias", "Ingrid", "Oswaldo", "Priyanka")),
    ("appointment date", ("March 14", "October 3", "June 27", "January 9", "August 21")),
)
FILLERS = (
    "What is a good name for a cat?",
    "Tell me a fun fact about the ocean.",
    "How do I boil an egg?",
    "What colour is the sky at sunset?",
    "Give me a word that rhymes with tree.",
    "What is the capital of Italy?",
    "How many legs does a spider have?",
    "Suggest a quick breakfast.",
    "What is two plus five?",
    "Name a famous painter.",
    "Why do leaves fall in autumn?",
    "What sound does a cow make?",
    "Recommend a board game.",
    "What is the opposite of cold?",
)


@dataclass
class Conversation:
    """The reference run: fed ids per turn (user ids, then the reply's ids), the last turn apart."""

    base_ids: tuple[int, ...]
    turns: list[tuple[tuple[int, ...], tuple[int, ...]]]
    final_user: tuple[int, ...]
    final_reply: tuple[int, ...]
    final_text: str

    @property
    def full_tokens(self) -> int:
        fed = sum(len(u) + len(r) - 1 for u, r in self.turns)
        return len(self.base_ids) + fed + len(self.final_user)


def reference(manager: Any, tenant: Any, messages: list[str], reply_tokens: list[int]) -> Conversation:
    """Run `messages` through chatkv unbounded; split what was fed by turn."""
    sid = manager.open_session(tenant, system_prompt=SYSTEM)
    replies = [manager.chat(tenant, sid, m, max_new_tokens=n) for m, n in zip(messages, reply_tokens, strict=True)]
    history = manager.history(tenant, sid)
    users = [m.token_ids for m in history if m.role == "user"]
    base_ids = tuple(manager.internals.template.system_prefix_ids(SYSTEM))
    first = users[0]
    if tuple(first[: len(base_ids)]) == base_ids:
        users[0] = first[len(base_ids) :]
    turns = [(tuple(u), tuple(r.token_ids)) for u, r in zip(users[:-1], replies[:-1], strict=True)]
    return Conversation(base_ids, turns, tuple(users[-1]), tuple(replies[-1].token_ids), replies[-1].text)


@dataclass
class Replayed:
    fitted: FittedWindow  # fitted for the final turn (base attached), its prefill possibly begun
    scoring_s: list[float]
    eviction_s: list[float]
    plain_s: list[float]
    turn_s: list[float]  # evicting turns: window step plus the prefill of the turn's ids and reply
    commit_s: list[float]  # every turn: the `agnostic` commit-time scores from the logged queries
    snapshots: list[tuple[SessionCache, int]]  # (cache before turn i, its stream length), unbounded runs

    @property
    def cache(self) -> SessionCache:
        return self.fitted.cache


def replay(
    engine: Engine,
    base: BaseLayer,
    conv: Conversation,
    window: WindowPolicy,
    max_new: int,
    time_plain: bool = False,
    unbounded: Replayed | None = None,
) -> Replayed:
    """Feed the reference's turns with `window` fitted before each, as a chatkv turn does (an
    evicting `attention` turn continues the working buffer its window step prefilled). With the
    `unbounded` replay's snapshots, start at the last turn before this window first has to act
    (until then every window holds the same cache)."""
    fitting = TurnWindow(engine, window)
    cache, stream, first = engine.empty_cache(base), len(conv.base_ids), 0
    if unbounded is not None:
        for index, (snapshot, length) in enumerate(unbounded.snapshots):
            user = conv.turns[index][0] if index < len(conv.turns) else conv.final_user
            if snapshot.total_tokens + len(user) + max_new > window.budget_tokens:
                break
            cache, stream, first = snapshot, length, index
    timings: tuple[list[float], list[float], list[float], list[float], list[float]] = ([], [], [], [], [])
    snapshots: list[tuple[SessionCache, int]] = []

    def fit(cache: SessionCache, user: tuple[int, ...]) -> FittedWindow:
        fitted: FittedWindow = fitting.fit(cache, (), user, max_new)
        if fitted.scoring_s:
            timings[0].append(fitted.scoring_s)
            timings[1].append(fitted.eviction_s)
        if fitted.demoted_tokens and time_plain:
            started = time.perf_counter()
            engine.prefill(cache.to_working_cache(len(user)), user)
            timings[2].append(time.perf_counter() - started)
        return fitted

    for index in range(first, len(conv.turns)):
        user, reply = conv.turns[index]
        snapshots.append((cache, stream))
        started = time.perf_counter()
        fitted = fit(cache, user)
        fed = (*user, *reply[:-1])
        span = LayerSpan(LayerKind.TURN, index, len(fed), stream, fitted.cache.next_position)
        working = working_of(fitted, len(fed))
        with QueryLog(working) as log:  # every policy's cache carries `agnostic`'s commit-time scores
            engine.prefill(working, fed[fitted.prefilled_tokens :])
        if fitted.demoted_tokens:
            timings[3].append(time.perf_counter() - started - (timings[2][-1] if time_plain else 0.0))
        cache = fitted.cache.after_turn(working, fed, [span])
        if cache.full_layers:
            committing = time.perf_counter()
            cache = cache.with_scores(committed_scores(fitted.cache, cache, log.turn_scores()))
            timings[4].append(time.perf_counter() - committing)
        stream += len(fed)
    snapshots.append((cache, stream))
    return Replayed(fit(cache, conv.final_user), *timings, snapshots)


def working_of(fitted: FittedWindow, extra_tokens: int) -> WorkingCache:
    """The buffer a turn continues: the one the window step prefilled, or a new one."""
    return fitted.working if fitted.working is not None else fitted.cache.to_working_cache(extra_tokens)


@torch.inference_mode()
def forced_log_probs(engine: Engine, fitted: FittedWindow, prefill: tuple[int, ...], reply: tuple[int, ...]) -> Any:
    """`[len(reply), vocab]` float64 log-probabilities at each reply position, the reference reply fed
    after the turn's `prefill` (the part of it the window step prefilled already is not fed again;
    positions continue from the working buffer's, as the engine's do)."""
    ahead = fitted.prefilled_tokens
    ids = [*prefill[ahead:], *reply[:-1]]
    working = working_of(fitted, len(ids))
    input_ids = torch.tensor([ids], dtype=torch.long, device=engine.device)
    start = fitted.cache.next_position + ahead
    positions = torch.arange(start, start + len(ids), device=engine.device)[None]
    out = engine.model(input_ids=input_ids, position_ids=positions, cache=working, use_cache=True)
    return torch.log_softmax(out.logits[0, len(prefill) - ahead - 1 :].to(torch.float64), dim=-1)


def final_reply(engine: Engine, fitted: FittedWindow, conv: Conversation, max_new: int) -> str:
    working = working_of(fitted, len(conv.final_user) + max_new)
    params = SamplingParams(max_new_tokens=max_new)
    ids = list(engine.generate(working, conv.final_user[fitted.prefilled_tokens :], params))
    return str(engine.tokenizer.decode(ids, skip_special_tokens=True))


def shared_base(engine: Engine, base_ids: tuple[int, ...]) -> BaseLayer:
    keys, values = engine.compute_prefix(base_ids)
    return BaseLayer(PrefixKey("window-quality"), base_ids, keys, values)


# -- 1. recall -------------------------------------------------------------------------------------


def recall_messages(index: int) -> tuple[list[str], str]:
    what, values = FACTS[index % len(FACTS)]
    value = values[(index // len(FACTS)) % len(values)]
    fillers = [FILLERS[(index + k) % len(FILLERS)] for k in range(10 + index % 5)]
    first = f"Please remember this for later: my {what} is {value}."
    return [first, *fillers, f"Earlier I told you my {what}. What is it?"], value


def contains(reply: str, fact: str) -> bool:
    """The fact in the reply, ignoring case, spaces and punctuation ("48,213" counts as "48213")."""

    def squash(text: str) -> str:
        return "".join(ch for ch in text.lower() if ch.isalnum())

    return squash(fact) in squash(reply)


def run_recall(engine: Engine, manager: Any, tenant: Any, count: int, budget: int, recent: int) -> dict[str, Any]:
    hits = {"unbounded": 0, "replay_unbounded": 0, "replay_checked": 0, **dict.fromkeys(POLICIES, 0)}
    timings: dict[str, list[float]] = {
        "scoring": [],
        "eviction": [],
        "plain": [],
        "commit": [],
        **{p: [] for p in POLICIES},
    }
    sizes: dict[str, list[int]] = {p: [] for p in POLICIES}
    max_new = 16
    for c in range(count):
        began = time.perf_counter()
        messages, fact = recall_messages(c)
        conv = reference(manager, tenant, messages, [4] * (len(messages) - 1) + [max_new])
        base = shared_base(engine, conv.base_ids)
        found = contains(conv.final_text, fact)
        hits["unbounded"] += found
        line = [f"  recall {c}: fact {fact!r}, {conv.full_tokens} tokens; unbounded {found}"]
        unbounded = replay(engine, base, conv, WindowPolicy(100_000), max_new)
        if c < 5:  # the replay is faithful: same answers as chatkv's own unbounded turns
            hits["replay_checked"] += 1
            hits["replay_unbounded"] += contains(final_reply(engine, unbounded.fitted, conv, max_new), fact)
        for policy in POLICIES:
            window = WindowPolicy(budget, policy=policy, recent_tokens=recent)
            replayed = replay(engine, base, conv, window, max_new, c < 6, unbounded)
            text = final_reply(engine, replayed.fitted, conv, max_new)
            found = contains(text, fact)
            hits[policy] += found
            sizes[policy].append(replayed.cache.total_tokens)
            timings[policy] += replayed.turn_s
            timings["commit"] += replayed.commit_s
            if policy == "attention":
                timings["scoring"] += replayed.scoring_s
                timings["eviction"] += replayed.eviction_s
                timings["plain"] += replayed.plain_s
            line.append(f"{policy} {found}")
            if c < 3:
                line.append(repr(text[:60]))
        print(", ".join(line) + f" ({time.perf_counter() - began:.1f} s)", flush=True)
    return {"hits": hits, "count": count, "timings": timings, "sizes": sizes}


# -- 2. quality at equal cache size ----------------------------------------------------------------


def quality_messages(engine: Engine, index: int, turns: int) -> list[str]:
    from _common import user_message

    out = []
    for k in range(turns):
        question = QUESTIONS[(index + k) % len(QUESTIONS)]
        out.append(user_message(engine, (index * 3 + k) % len(PARAGRAPHS), 60, question))
    return out


def run_quality(engine: Engine, manager: Any, tenant: Any, count: int, turns: int, recent: int) -> dict[str, Any]:
    reply_tokens = 16
    points: dict[str, dict[float, dict[str, float]]] = {
        p: {f: {"size": 0.0, "top1": 0.0, "kl": 0.0, "n": 0.0} for f in FRACTIONS} for p in POLICIES
    }
    full_sizes = []
    refused = {p: dict.fromkeys(FRACTIONS, 0) for p in POLICIES}
    impossible = {p: dict.fromkeys(FRACTIONS, 0) for p in POLICIES}
    for c in range(count):
        began = time.perf_counter()
        conv = reference(manager, tenant, quality_messages(engine, c, turns), [reply_tokens] * turns)
        base = shared_base(engine, conv.base_ids)
        full = conv.full_tokens + reply_tokens
        full_sizes.append(conv.full_tokens)
        unbounded = replay(engine, base, conv, WindowPolicy(100_000), reply_tokens)
        ref_logp = forced_log_probs(engine, unbounded.fitted, conv.final_user, conv.final_reply)
        ref_top1 = ref_logp.argmax(dim=-1)
        line = [f"  quality {c}: {conv.full_tokens} tokens"]
        for policy in POLICIES:
            for fraction in FRACTIONS:
                window = WindowPolicy(int(full * fraction), policy=policy, recent_tokens=recent)
                try:
                    fitted = replay(engine, base, conv, window, reply_tokens, unbounded=unbounded).fitted
                except ContextTooLong:
                    # The recent window is never evicted: with it, the turn does not fit this budget
                    # (chatkv refuses such a turn). Measured again without a recent window, and counted;
                    # a budget below one turn's prompt fits no policy and is left out (counted too).
                    refused[policy][fraction] += 1
                    window = WindowPolicy(int(full * fraction), policy=policy, recent_tokens=0)
                    try:
                        fitted = replay(engine, base, conv, window, reply_tokens, unbounded=unbounded).fitted
                    except ContextTooLong:
                        impossible[policy][fraction] += 1
                        continue
                logp = forced_log_probs(engine, fitted, conv.final_user, conv.final_reply)
                cache = fitted.cache
                kl = (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1)
                point = points[policy][fraction]
                point["size"] += cache.total_tokens
                top1 = float((logp.argmax(dim=-1) == ref_top1).float().mean())
                point["top1"] += top1
                point["kl"] += float(kl.mean())
                point["n"] += 1
                if fraction in REPORTED:
                    line.append(f"{policy}@{fraction:.0%} {cache.total_tokens} tok top1 {top1:.2f}")
        print(", ".join(line) + f" ({time.perf_counter() - began:.1f} s)", flush=True)
    summary = {
        p: {f: {k: v / max(1.0, points[p][f]["n"]) for k, v in points[p][f].items() if k != "n"} for f in FRACTIONS}
        for p in POLICIES
    }
    return {
        "summary": summary,
        "mean_full_tokens": sum(full_sizes) / len(full_sizes),
        "refused": refused,
        "impossible": impossible,
        "measured": {p: {f: points[p][f]["n"] for f in FRACTIONS} for p in POLICIES},
    }


def size_for(curve: list[tuple[float, float]], target: float) -> float | None:
    """Smallest cache size at which the piecewise-linear (size, agreement) curve reaches `target`."""
    curve = sorted(curve)
    if curve[0][1] >= target:
        return curve[0][0]
    for (s0, a0), (s1, a1) in itertools.pairwise(curve):
        if a0 < target <= a1:
            return s0 + (target - a0) * (s1 - s0) / (a1 - a0)
    return None


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--recall", type=int, default=None, help="recall conversations (default 30)")
    parser.add_argument("--recall-budget", type=int, default=256, help="context budget of the recall part")
    parser.add_argument("--conversations", type=int, default=None, help="quality conversations (default 20)")
    parser.add_argument("--turns", type=int, default=5, help="turns per quality conversation, the last compared")
    parser.add_argument("--recent", type=int, default=32, help="window_recent_tokens of the attention policy")
    args = parser.parse_args()
    recall_count = args.recall or (6 if args.quick else 30)
    quality_count = args.conversations or (4 if args.quick else 20)
    engine = setup(args)
    print_header(
        "window_quality: window_policy turns vs attention (SnapKV-style) vs agnostic (commit-time scores)",
        engine,
        [
            f"recall: {recall_count} conversations, budget {args.recall_budget} tokens; quality: {quality_count} "
            f"conversations of {args.turns} turns; window_recent_tokens {args.recent}, "
            "window_observation_tokens 32 (the default)",
            "history teacher-forced from an unbounded chatkv run; each policy's window fitted by chatkv's "
            "TurnWindow before every turn",
        ],
    )
    started = time.perf_counter()
    home_settings = {"persist": "on_evict"}  # no background sealing beside the measured turns
    with (
        temp_dir("window") as root,
        open_manager(root / "home", engine, args.model_cache_dir, **home_settings) as manager,
    ):
        tenant = manager.create_tenant("bench")
        recall = run_recall(engine, manager, tenant, recall_count, args.recall_budget, args.recent)
        quality = run_quality(engine, manager, tenant, quality_count, args.turns, args.recent)
    hits, n = recall["hits"], recall["count"]
    print_table(
        f"Recall of a turn-1 fact after 10-14 filler turns (budget {args.recall_budget} tokens)",
        ["window", "replies with the fact", "share", "mean cache tokens at the question"],
        [
            ["unbounded (chatkv, exact)", f"{hits['unbounded']} of {n}", f"{hits['unbounded'] / n:.0%}", "-"],
            *[[p, f"{hits[p]} of {n}", f"{hits[p] / n:.0%}", f"{_mean(recall['sizes'][p]):.0f}"] for p in POLICIES],
        ],
    )
    print(
        f"check: the replay with an unbounded window finds the fact in {hits['replay_unbounded']} of the first "
        f"{hits['replay_checked']} conversations"
    )
    summary = quality["summary"]
    rows = []
    for fraction in FRACTIONS:
        row: list[object] = [f"{fraction:.1%}" + (" *" if fraction in REPORTED else "")]
        for policy in POLICIES:
            p = summary[policy][fraction]
            row += [f"{p['size']:.0f}", f"{p['top1']:.1%}", f"{p['kl']:.3f}"]
        row.append(", ".join(str(quality["refused"][p][fraction]) for p in POLICIES[1:]))
        row.append(", ".join(f"{quality['measured'][p][fraction]:.0f}" for p in POLICIES))
        rows.append(row)
    print_table(
        f"Next-reply quality against the unbounded cache ({quality_count} conversations, mean full length "
        f"{quality['mean_full_tokens']:.0f} tokens; * = the 25/50/75% budgets)",
        [
            "budget",
            *[h for p in POLICIES for h in (f"{p}: cache tok", "top-1", "KL")],
            "no recent window (" + ", ".join(POLICIES[1:]) + ")",
            "measured (" + ", ".join(POLICIES) + ")",
        ],
        rows,
    )
    print(
        "cache tok: mean tokens the cache holds when the compared turn starts; top-1 / KL: teacher-forced on the "
        "reference's reply, KL(reference || policy) in nats per position; no recent window: conversations in "
        "which the attention policy with its recent window cannot fit the budget (chatkv refuses that turn), "
        "measured with window_recent_tokens 0 instead"
    )
    full = quality["mean_full_tokens"]
    needed = {}
    for policy in POLICIES:
        measured = [f for f in FRACTIONS if quality["measured"][policy][f]]
        curve = [(summary[policy][f]["size"], summary[policy][f]["top1"]) for f in measured] + [(full, 1.0)]
        needed[policy] = size_for(curve, 0.95)
    cells = [f"{needed[p]:.0f} tokens" if needed[p] is not None else "not reached" for p in POLICIES]
    print_table(
        "Cache size for 95% top-1 agreement (interpolated on each policy's agreement vs actual size)",
        [*POLICIES, *(f"{p} saves" for p in POLICIES[1:])],
        [[*cells, *(_saving(needed["turns"], needed[p]) for p in POLICIES[1:])]],
    )
    t = recall["timings"]
    if t["scoring"]:
        plain = _mean(t["plain"]) if t["plain"] else None
        ratio = {p: _mean(t[p]) / _mean(t["turns"]) if t["turns"] else None for p in POLICIES}
        print_table(
            "Cost of an evicting turn (recall part; " + ", ".join(f"{len(t[p])} {p}" for p in POLICIES) + " turns)",
            ["policy", "evicting turn (window step + prefill)", "vs turns"],
            [[p, f"{_mean(t[p]) * 1000:.1f} ms", "-" if ratio[p] is None else f"{ratio[p]:.2f}x"] for p in POLICIES],
        )
        print(
            f"attention's observed prefill {_mean(t['scoring']) * 1000:.1f} ms, gather + carry "
            f"{_mean(t['eviction']) * 1000:.1f} ms; a plain prefill of the user ids on the full cache "
            + ("-" if plain is None else f"{plain * 1000:.1f} ms ({len(t['plain'])} turns)")
            + f"; agnostic's commit-time scores {_mean(t['commit']) * 1000:.1f} ms per turn (after the reply)"
        )
        print(
            "a turn here: the window step and the prefill of the turn's user ids and its (teacher-forced) reply; "
            "an attention turn prefills its ids once, on the full cache, then evicts (SnapKV-style); an agnostic "
            "turn only gathers by its stored scores"
        )
    print(f"total run time {time.perf_counter() - started:.0f} s")
    write_json_file(args.json, {"benchmark": "window_quality", "recall": recall, "quality": quality}, engine)


def _mean(values: list[float] | list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def _saving(turns: float | None, attention: float | None) -> str:
    if turns is None or attention is None:
        return "-"
    return f"{1 - attention / turns:.0%}"


if __name__ == "__main__":
    main()
