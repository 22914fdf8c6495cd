"""Window policies compared (issues 13, 31): `turns` (whole oldest turns demoted) against `attention`
(tokens evicted per KV head by the attention of the new turn's last queries, SnapKV-style) and
`agnostic` (the same eviction by scores fixed when the earlier turns committed), on the real default
model, greedy. `agnostic` runs with two commit-time scores: `kvzip` (KVzip's reconstruction, Kim
et al., NeurIPS 2025, as chatkv's runner serves it: the model repeats the committed turn's ids
after a "Repeat the previous context exactly." prompt on a copy of the cache,
`TurnWindow.reconstruction_scores`) and `querylog` (the turn's own queries, `QueryLog`: the
pass-free approximation served before, measured here as the comparison).

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
2. Quality at equal cache size, split by where the asked content is (SCBench's axis: Li et al.,
   "SCBench: A KV Cache-Centric Analysis of Long-Context Methods", 2024, ask in later turns about
   the first turn's context as well as about later turns'): `--conversations` (6) conversations
   whose turn 1 is a document (`--doc-paragraphs` 4 paragraphs, ~420 tokens), followed by
   `--turns` (4) turns of one paragraph and a question each (16-token replies); the last turn asks
   either about a paragraph of the document (`first`) or about the paragraph of turn 2 (`later`,
   out of the recent window), same history for both. The reference's reply (24 tokens) is fed
   after each cache: top-1 agreement of the next-token argmax with the reference and mean
   KL(reference || policy) over the reply's positions, at budgets of 10/25/50/75% of the full
   length (~1,050 tokens), per question kind, two ways:
   a. final-turn compression (SCBench's setting: a long context cached once, compressed, then
      queried): the unbounded cache compressed to the budget when the last question arrives,
      `turns` by chatkv's window step, the lossy scores (`attention`: the question's observation
      window; `querylog` and `kvzip`: commit-time; `kvzip whole`: the whole context reconstructed
      once at the end, KVzip's own setting) with the kept total spent `uniform` (as served),
      `per_head` (Ada-KV) or `per_layer` (PyramidKV) (`cache.budget_allocation`), applied as a
      mask on attention: kept keys keep their positions, so masking a slot equals evicting it
      (checked against the served gather on the first conversation). The cache size each
      compression needs for 95% top-1 is interpolated on its own curve of agreement against
      actual size (linear between measured points; the unbounded cache is the 100% point).
   b. multi-turn: the history replayed under each policy with chatkv's window step before every
      turn. chatkv refuses a turn whose own prompt does not fit the budget, so budgets below the
      document's turn (10% and 25% here) cannot be replayed. Where the recent window (never
      evicted) leaves no room, the conversation is measured with `window_recent_tokens` 0 and
      counted. Per-turn TTFT: the window step plus the prefill of the turn's user ids (the first
      token's logits), on the turns where the window acted.
3. Cost: seconds per evicting turn (the window step, then the prefill of the turn's ids and its
   teacher-forced reply), `attention` against `turns` at the same budget; the `attention` turn
   prefills its ids once on the full cache with the observation window captured, then evicts and
   carries the prefill over (split out: the observed prefill, the gather and carry). Commit-time
   scores (after the reply): the query log's and the KVzip reconstruction's, against a turn.

    .venv/bin/python benchmarks/window_quality.py --threads 1
    .venv/bin/python benchmarks/window_quality.py --threads 1 --quick     # 6 recall + 3 quality conversations
    .venv/bin/python benchmarks/window_quality.py --threads 1 --recall 0  # the quality part only
    .venv/bin/python benchmarks/window_quality.py --threads 1 --recall 0 --skip-multi-turn  # compression only
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from _common import PARAGRAPHS, QUESTIONS, base_parser, open_manager, print_header, print_table, setup, temp_dir
from _common import write_json as write_json_file
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cache.attention_scores import QueryLog
from cache.budget_allocation import ALLOCATIONS, kept_own_mask
from cache.ids import PrefixKey
from cache.layer_table import LayerKind, LayerSpan
from cache.session_cache import BaseLayer, SessionCache
from cache.token_eviction import committed_scores, evict_by_scores, evictable_tokens, stored_scores
from cache.window_policy import WindowPolicy
from cache.working_cache import WorkingCache
from sessions.engine import Engine
from sessions.engine.batch import band_mask
from sessions.engine.packed_attention import step_of
from sessions.errors import ContextTooLong
from sessions.sampling import SamplingParams
from sessions.turn.window import RECONSTRUCTION_INSTRUCTION, FittedWindow, TurnWindow

SYSTEM = "You are a helpful assistant. Answer briefly."
POLICIES = ("turns", "attention", "querylog", "kvzip")
WINDOW_POLICY = {"turns": "turns", "attention": "attention", "querylog": "agnostic", "kvzip": "agnostic"}
"""chatkv's `window_policy` each row runs: `querylog` and `kvzip` are both `agnostic` (eviction by
scores fixed when turns commit), with the scores of the query log (the turn's own queries: chatkv's
`agnostic` before issue 31's second pass) or of KVzip's context reconstruction (served since)."""


@dataclass(frozen=True)
class Commit:
    """How a replay scores a committed turn: `querylog` (`QueryLog`, the turn's own queries) or
    `kvzip` (`TurnWindow.reconstruction_scores` of the turn's ids after `prompt_ids`, as the runner)."""

    scorer: str
    prompt_ids: tuple[int, ...]


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
    commit_s: list[float]  # every turn: the commit-time scores (query log, or the reconstruction)
    ttft_s: list[float]  # evicting turns: window step plus the prefill of the user ids (first token)
    snapshots: list[tuple[SessionCache, int]]  # (cache before turn i, its stream length), unbounded runs
    every_s: list[float]  # every turn: window step plus the prefill of the turn's ids and reply

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
    commit: Commit | None = None,
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
    timings: tuple[list[float], ...] = ([], [], [], [], [], [], [])
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
        plain = timings[2][-1] if time_plain and fitted.demoted_tokens else 0.0
        logged = commit is not None and commit.scorer == "querylog"
        with QueryLog(working) if logged else nullcontext() as log:
            engine.prefill(working, user[fitted.prefilled_tokens :])
            first_token = time.perf_counter()
            if len(reply) > 1:
                engine.prefill(working, reply[:-1])
        if fitted.demoted_tokens:
            timings[3].append(time.perf_counter() - started - plain)
            timings[5].append(first_token - started - plain)
        timings[6].append(time.perf_counter() - started - plain)
        cache = fitted.cache.after_turn(working, fed, [span])
        if commit is not None and cache.full_layers:
            committing = time.perf_counter()
            if isinstance(log, QueryLog):
                fresh, built_from = log.turn_scores(), fitted.cache
            else:  # the runner's commit: the turn's ids reconstructed on a copy of the cache after it
                fresh, built_from = tuple(fitting.reconstruction_scores(cache, fed, commit.prompt_ids)), cache
            cache = cache.with_scores(committed_scores(fitted.cache, cache, fresh, built_from=built_from))
            timings[4].append(time.perf_counter() - committing)
        stream += len(fed)
    snapshots.append((cache, stream))
    scoring_s, eviction_s, plain_s, turn_s, commit_s, ttft_s, every_s = timings
    final = fit(cache, conv.final_user)
    return Replayed(final, scoring_s, eviction_s, plain_s, turn_s, commit_s, ttft_s, snapshots, every_s)


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
    # A plain forward ignores a ragged layer's holes (only the packed attention reads them): mask them.
    holes = {i: layer.head_valid for i, layer in enumerate(working.prealloc_layers) if layer.head_valid is not None}
    with masked_slots(engine, holes) if holes else nullcontext():
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


def commits(manager: Any) -> dict[str, Commit]:
    """Each scored row's commit (`querylog`, `kvzip`), with the template's reconstruction prompt."""
    prompt = tuple(manager.internals.template.reconstruction_prompt_ids(RECONSTRUCTION_INSTRUCTION))
    return {"querylog": Commit("querylog", prompt), "kvzip": Commit("kvzip", prompt)}


def unbounded_replays(
    engine: Engine, base: BaseLayer, conv: Conversation, max_new: int, scoring: dict[str, Commit]
) -> dict[str, Replayed]:
    """The conversation replayed without a window, once per commit scorer (same KV, other scores)."""
    return {name: replay(engine, base, conv, WindowPolicy(100_000), max_new, commit=c) for name, c in scoring.items()}


def run_policy(
    engine: Engine,
    base: BaseLayer,
    conv: Conversation,
    policy: str,
    window: WindowPolicy,
    max_new: int,
    unbounded: dict[str, Replayed],
    scoring: dict[str, Commit],
    time_plain: bool = False,
) -> Replayed:
    """`replay` of the row `policy` (`WINDOW_POLICY`), from the unbounded replay of its own scorer."""
    start = unbounded.get(policy, unbounded["querylog"])
    return replay(engine, base, conv, window, max_new, time_plain, start, scoring.get(policy))


def run_recall(engine: Engine, manager: Any, tenant: Any, count: int, budget: int, recent: int) -> dict[str, Any]:
    hits = {"unbounded": 0, "replay_unbounded": 0, "replay_checked": 0, **dict.fromkeys(POLICIES, 0)}
    scoring = commits(manager)
    timings: dict[str, list[float]] = {
        "scoring": [],
        "eviction": [],
        "plain": [],
        **{f"commit {p}": [] for p in scoring},
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
        unbounded = unbounded_replays(engine, base, conv, max_new, scoring)
        for name, replayed in unbounded.items():
            timings[f"commit {name}"] += replayed.commit_s
        if c < 5:  # the replay is faithful: same answers as chatkv's own unbounded turns
            hits["replay_checked"] += 1
            hits["replay_unbounded"] += contains(final_reply(engine, unbounded["kvzip"].fitted, conv, max_new), fact)
        for policy in POLICIES:
            window = WindowPolicy(budget, policy=WINDOW_POLICY[policy], recent_tokens=recent)
            replayed = run_policy(engine, base, conv, policy, window, max_new, unbounded, scoring, c < 6)
            text = final_reply(engine, replayed.fitted, conv, max_new)
            found = contains(text, fact)
            hits[policy] += found
            sizes[policy].append(replayed.cache.total_tokens)
            timings[policy] += replayed.turn_s
            if policy == "attention":
                timings["scoring"] += replayed.scoring_s
                timings["eviction"] += replayed.eviction_s
                timings["plain"] += replayed.plain_s
            line.append(f"{policy} {found}")
            if c < 3:
                line.append(repr(text[:60]))
        print(", ".join(line) + f" ({time.perf_counter() - began:.1f} s)", flush=True)
    return {"hits": hits, "count": count, "timings": timings, "sizes": sizes}


# -- 2. quality at equal cache size, by where the asked content is (SCBench) -----------------------

TOPICS = (
    "the lighthouse",
    "sourdough bread",
    "river deltas",
    "the city library",
    "honeybees",
    "the mountain railway",
    "composting",
    "finding longitude at sea",
    "the community orchard",
    "glaciers",
    "the orchestra's new hall",
    "tidal pools",
)
"""What each of `PARAGRAPHS` is about, for the last turn's question."""
KINDS = ("first", "later")
"""The last question asks about the first turn's document, or about a later turn's paragraph."""
REPLY_TOKENS, FINAL_TOKENS = 16, 24


def scbench_messages(index: int, doc_paragraphs: int, turns: int) -> tuple[list[str], dict[str, str]]:
    """The history (a document, then `turns` one-paragraph turns) and the last question per kind."""
    count = len(PARAGRAPHS)
    start = (index * 5) % count
    document = "\n\n".join(PARAGRAPHS[(start + k) % count] for k in range(doc_paragraphs))
    later = [(start + doc_paragraphs + k) % count for k in range(turns)]
    history = [
        f"Here is a document; I will ask you about it later.\n\n{document}\n\n"
        "For now, say in one sentence what it covers.",
        *(f"{PARAGRAPHS[p]}\n\n{QUESTIONS[(index + k) % len(QUESTIONS)]}" for k, p in enumerate(later)),
    ]
    asked = (start + index % doc_paragraphs) % count
    finals = {
        "first": f"In the document I shared first, what did it say about {TOPICS[asked]}? Answer in two sentences.",
        "later": f"Earlier I sent a paragraph about {TOPICS[later[0]]}. What did it say? Answer in two sentences.",
    }
    return history, finals


def fit_final(engine: Engine, window: WindowPolicy, cache: SessionCache, user: tuple[int, ...]) -> FittedWindow:
    fitted: FittedWindow = TurnWindow(engine, window).fit(cache, (), user, FINAL_TOKENS)
    return fitted


def agreement(ref_logp: torch.Tensor, logp: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference || policy) in nats) over the reply's positions."""
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1)
    return float((logp.argmax(dim=-1) == ref_logp.argmax(dim=-1)).float().mean()), float(kl.mean())


def _cell() -> dict[str, float]:
    return {"size": 0.0, "top1": 0.0, "kl": 0.0, "n": 0.0}


def _add(cell: dict[str, float], size: int, top1: float, kl: float) -> None:
    cell["size"] += size
    cell["top1"] += top1
    cell["kl"] += kl
    cell["n"] += 1


@contextmanager
def masked_slots(engine: Engine, keep: dict[int, torch.Tensor]) -> Iterator[None]:
    """While the block runs, model layer `l`'s attention (outside packed steps) sees only the cached
    slots `keep[l]` (`[kv_heads, cached]` bool, base first) plus the tokens fed since, causally:
    eviction applied as a mask, for allocations the session cache cannot store (ragged)."""
    name = engine.model.config._attn_implementation
    original = ALL_ATTENTION_FUNCTIONS[name]
    local = name in ALL_ATTENTION_FUNCTIONS._local_mapping

    def attention(
        module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs: Any
    ) -> Any:
        cached = keep.get(getattr(module, "layer_idx", -1))
        if cached is None or step_of(mask, kwargs) is not None:
            return original(module, query, key, value, mask, **kwargs)
        n, m = query.shape[2], key.shape[2]
        visible = torch.cat([cached, cached.new_ones(cached.shape[0], m - cached.shape[1])], dim=1)  # [kv, m]
        causal = band_mask(n, m, None, query.device)
        allowed = visible.repeat_interleave(query.shape[1] // key.shape[1], dim=0)[:, None, :]  # [heads, 1, m]
        if causal is not None:
            allowed = allowed & causal[None]
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=allowed[None], scale=kwargs.get("scaling"), enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None

    ALL_ATTENTION_FUNCTIONS[name] = attention
    try:
        yield
    finally:
        if local:
            ALL_ATTENTION_FUNCTIONS[name] = original
        else:
            del ALL_ATTENTION_FUNCTIONS[name]


def masked_log_probs(
    engine: Engine, cache: SessionCache, own_mask: torch.Tensor, prefill: tuple[int, ...], reply: tuple[int, ...]
) -> torch.Tensor:
    """`forced_log_probs` on `cache` with only the own slots of `own_mask` (`kept_own_mask`) visible."""
    keep = {}
    for row, layer in enumerate(cache.full_layers):
        base = torch.ones(own_mask.shape[1], cache.base_tokens, dtype=torch.bool)
        keep[layer] = torch.cat([base, own_mask[row]], dim=1).to(engine.device)
    with masked_slots(engine, keep):
        return forced_log_probs(engine, FittedWindow(cache, 0, False), prefill, reply)


def run_quality(
    engine: Engine,
    manager: Any,
    tenant: Any,
    count: int,
    doc_paragraphs: int,
    turns: int,
    recent: int,
    multi_turn: bool = True,
) -> dict[str, Any]:
    scoring = commits(manager)
    costs: dict[str, list[float]] = {"commit querylog": [], "commit kvzip": [], "kvzip whole": [], "turn": []}
    points = {p: {f: {k: _cell() for k in KINDS} for f in FRACTIONS} for p in POLICIES}
    compressed = {r: {f: {k: _cell() for k in KINDS} for f in FRACTIONS} for r in COMPRESSED}
    ttft: dict[str, dict[float, list[float]]] = {p: {f: [] for f in FRACTIONS} for p in POLICIES}
    refused = {p: dict.fromkeys(FRACTIONS, 0) for p in POLICIES}
    impossible = {p: dict.fromkeys(FRACTIONS, 0) for p in POLICIES}
    full_sizes, checks = [], []
    padding: dict[str, dict[float, list[float]]] = {s: {f: [] for f in FRACTIONS} for s in SCORERS}
    for c in range(count):
        began = time.perf_counter()
        history, finals = scbench_messages(c, doc_paragraphs, turns)
        reply_lengths = [REPLY_TOKENS] * len(history) + [FINAL_TOKENS]
        convs = {k: reference(manager, tenant, [*history, finals[k]], reply_lengths) for k in KINDS}
        conv = convs["first"]
        if convs["later"].turns != conv.turns:
            print(f"  warning: conversation {c}'s two reference histories differ", flush=True)
        base = shared_base(engine, conv.base_ids)
        full = conv.full_tokens + FINAL_TOKENS
        full_sizes.append(conv.full_tokens)
        unbounded = unbounded_replays(engine, base, conv, FINAL_TOKENS, scoring)
        for name, replayed in unbounded.items():
            costs[f"commit {name}"] += replayed.commit_s
        costs["turn"] += unbounded["kvzip"].every_s
        whole = unbounded["querylog"].snapshots[-1][0]
        unbounded_window = WindowPolicy(100_000)
        reconstructing = time.perf_counter()
        whole_kvzip = TurnWindow(engine, unbounded_window).reconstruction_scores(
            whole, whole.own_token_ids, scoring["kvzip"].prompt_ids
        )
        costs["kvzip whole"].append(time.perf_counter() - reconstructing)
        refs = {
            k: forced_log_probs(engine, fit_final(engine, unbounded_window, whole, convs[k].final_user), *_qa(convs[k]))
            for k in KINDS
        }
        line = [f"  quality {c}: {conv.full_tokens} tokens (document {len(conv.turns[0][0])})"]
        # (a) multi-turn: the history replayed under each policy, every turn fitted (chatkv refuses a
        # turn whose own prompt does not fit the budget, so budgets below the document are skipped)
        for policy in POLICIES if multi_turn else ():
            for fraction in FRACTIONS:
                budget = int(full * fraction)
                if len(conv.base_ids) + len(conv.turns[0][0]) + REPLY_TOKENS > budget:
                    impossible[policy][fraction] += 1
                    continue
                args = (engine, base, conv, convs, unbounded, scoring, policy, budget)
                measured = _measure_policy(*args, recent)
                if measured is None:
                    refused[policy][fraction] += 1
                    measured = _measure_policy(*args, 0)
                    if measured is None:
                        impossible[policy][fraction] += 1
                        continue
                replayed, logps = measured
                ttft[policy][fraction] += replayed.ttft_s
                shown = []
                for k in KINDS:
                    top1, kl = agreement(refs[k], logps[k][1])
                    _add(points[policy][fraction][k], logps[k][0], top1, kl)
                    shown.append(f"{top1:.2f}")
                line.append(f"{policy}@{fraction:.0%} {logps['first'][0]} tok {'/'.join(shown)}")
        # (b) final-turn compression (SCBench's setting): the unbounded cache compressed once to the
        # budget when the last question arrives; `turns` by chatkv's own window step, the lossy
        # scores by each allocation, as a mask (checked against the served gather once)
        for k in KINDS:
            user, reply = _qa(convs[k])
            scores = {
                "attention": TurnWindow(engine, unbounded_window).score(whole, user),
                "querylog": stored_scores(whole),
                "kvzip": stored_scores(unbounded["kvzip"].snapshots[-1][0]),
                "kvzip whole": whole_kvzip,
            }
            for fraction in FRACTIONS:
                budget = int(full * fraction)
                try:
                    fitted = fit_final(engine, WindowPolicy(budget), whole, user)
                    top1, kl = agreement(refs[k], forced_log_probs(engine, fitted, user, reply))
                    _add(compressed["turns"][fraction][k], fitted.cache.total_tokens, top1, kl)
                except ContextTooLong:
                    pass
                excess = max(0, whole.total_tokens + len(user) + FINAL_TOKENS - budget)
                kept_recent = recent if excess <= evictable_tokens(whole, recent) else 0
                if excess > evictable_tokens(whole, kept_recent):
                    continue
                for scorer in SCORERS:
                    for allocation in ALLOCATIONS:
                        mask = kept_own_mask(whole, scores[scorer], excess, kept_recent, allocation)
                        if allocation == "per_head":
                            padding[scorer][fraction].append(_padded_share(mask))
                        logp = masked_log_probs(engine, whole, mask, user, reply)
                        top1, kl = agreement(refs[k], logp)
                        _add(compressed[f"{scorer} {allocation}"][fraction][k], whole.total_tokens - excess, top1, kl)
                        if c == 0 and allocation == "uniform" and fraction == 0.25:
                            served = evict_by_scores(whole, scores[scorer], excess, kept_recent)
                            exact = forced_log_probs(engine, FittedWindow(served, excess, False), user, reply)
                            checks.append(float((exact - logp).abs().max()))
        shown = [
            f"{compressed[r][0.1]['first']['top1'] / max(1.0, compressed[r][0.1]['first']['n']):.2f}"
            for r in COMPRESSED
        ]
        line.append("mean first-turn top-1 at 10% so far " + "/".join(shown))
        print(", ".join(line) + f" ({time.perf_counter() - began:.1f} s)", flush=True)
    return {
        "summary": {p: {f: {k: _mean_cell(points[p][f][k]) for k in KINDS} for f in FRACTIONS} for p in POLICIES},
        "compressed": {
            r: {f: {k: _mean_cell(compressed[r][f][k]) for k in KINDS} for f in FRACTIONS} for r in COMPRESSED
        },
        "ttft": ttft,
        "costs": costs,
        "mask_check_max_abs_logp": checks,
        "per_head_padding": padding,
        "mean_full_tokens": sum(full_sizes) / len(full_sizes),
        "refused": refused,
        "impossible": impossible,
    }


def _padded_share(mask: torch.Tensor) -> float:
    """Own tokens a rectangular cache would hold for a per-head kept mask `[layers, kv_heads, own]`
    (each model layer's heads padded to its longest), over the tokens kept: what serving Ada-KV's
    ragged counts in `[1, kv_heads, n, head_dim]` tensors would cost (1.0: no padding)."""
    counts = mask.sum(dim=-1)  # [layers, kv_heads]
    return float(counts.max(dim=1).values.sum() * counts.shape[1] / counts.sum().clamp(min=1))


SCORERS = ("attention", "querylog", "kvzip", "kvzip whole")
COMPRESSED = ("turns", *(f"{s} {a}" for s in SCORERS for a in ALLOCATIONS))
"""Rows of the final-turn compression: `turns`' window step, each lossy score by each allocation."""


def _qa(conv: Conversation) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return conv.final_user, conv.final_reply


def _mean_cell(cell: dict[str, float]) -> dict[str, float]:
    return {k: v / max(1.0, cell["n"]) for k, v in cell.items() if k != "n"} | {"n": cell["n"]}


def _measure_policy(
    engine: Engine,
    base: BaseLayer,
    conv: Conversation,
    convs: dict[str, Conversation],
    unbounded: dict[str, Replayed],
    scoring: dict[str, Commit],
    policy: str,
    budget: int,
    recent: int,
) -> tuple[Replayed, dict[str, tuple[int, torch.Tensor]]] | None:
    """The history replayed under `policy`, then each kind's last turn fitted and teacher-forced:
    (replay, {kind: (cache tokens at the question, log-probs)}), or `None` if chatkv refuses a turn."""
    window = WindowPolicy(budget, policy=WINDOW_POLICY[policy], recent_tokens=recent)
    try:
        replayed = run_policy(engine, base, conv, policy, window, FINAL_TOKENS, unbounded, scoring)
        out = {}
        for k in KINDS:
            fitted = (
                replayed.fitted
                if k == "first"
                else fit_final(engine, window, replayed.snapshots[-1][0], convs[k].final_user)
            )
            out[k] = (fitted.cache.total_tokens, forced_log_probs(engine, fitted, *_qa(convs[k])))
    except ContextTooLong:
        return None
    return replayed, out


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
    parser.add_argument("--recall", type=int, default=None, help="recall conversations (default 30; 0 skips)")
    parser.add_argument("--recall-budget", type=int, default=256, help="context budget of the recall part")
    parser.add_argument("--conversations", type=int, default=None, help="quality conversations (default 6)")
    parser.add_argument("--doc-paragraphs", type=int, default=4, help="paragraphs of the first turn's document")
    parser.add_argument("--turns", type=int, default=4, help="one-paragraph turns after the document")
    parser.add_argument("--recent", type=int, default=32, help="window_recent_tokens of the lossy policies")
    parser.add_argument(
        "--skip-multi-turn", action="store_true", help="quality: only the final-turn compression (no replay per budget)"
    )
    args = parser.parse_args()
    recall_count = args.recall if args.recall is not None else (6 if args.quick else 30)
    quality_count = args.conversations or (3 if args.quick else 6)
    if not 1 <= args.doc_paragraphs <= len(PARAGRAPHS) - args.turns or args.turns < 1:
        parser.error(f"--doc-paragraphs plus --turns must be at most {len(PARAGRAPHS)}, each at least 1")
    engine = setup(args)
    print_header(
        "window_quality: window_policy turns vs attention (SnapKV-style) vs agnostic (commit-time scores: "
        "query log or KVzip reconstruction)",
        engine,
        [
            f"recall: {recall_count} conversations, budget {args.recall_budget} tokens; quality: {quality_count} "
            f"conversations (a {args.doc_paragraphs}-paragraph document, then {args.turns} turns, then a question "
            f"about the document or about turn 2); window_recent_tokens {args.recent}, "
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
        quality = run_quality(
            engine,
            manager,
            tenant,
            quality_count,
            args.doc_paragraphs,
            args.turns,
            args.recent,
            not args.skip_multi_turn,
        )
    if recall_count:
        print_recall(recall, args.recall_budget)
    print_quality(quality, quality_count)
    if recall_count:
        print_cost(recall)
    print(f"total run time {time.perf_counter() - started:.0f} s")
    write_json_file(args.json, {"benchmark": "window_quality", "recall": recall, "quality": quality}, engine)


def print_recall(recall: dict[str, Any], budget: int) -> None:
    hits, n = recall["hits"], recall["count"]
    print_table(
        f"Recall of a turn-1 fact after 10-14 filler turns (budget {budget} tokens)",
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


def print_quality(quality: dict[str, Any], count: int) -> None:
    full, comp = quality["mean_full_tokens"], quality["compressed"]

    def cell(c: dict[str, float]) -> str:
        return f"{c['top1']:.1%} / {c['kl']:.3f}" if c["n"] else "-"

    rows = []
    for fraction in FRACTIONS:
        for kind in KINDS:
            turns, lossy = comp["turns"][fraction][kind], comp["attention uniform"][fraction][kind]
            rows.append(
                [
                    f"{fraction:.0%}",
                    kind,
                    f"{turns['size']:.0f}" if turns["n"] else "-",
                    cell(turns),
                    f"{lossy['size']:.0f}" if lossy["n"] else "-",
                    *(cell(comp[r][fraction][kind]) for r in COMPRESSED[1:]),
                ]
            )
    print_table(
        f"Final-turn compression, top-1 / KL against the unbounded cache ({count} conversations, mean full length "
        f"{full:.0f} tokens; first: asked about turn 1's document, later: about turn 2's paragraph)",
        ["budget", "asked", "turns tok", "turns", "lossy tok", *COMPRESSED[1:]],
        rows,
    )
    print(
        "the unbounded cache compressed once when the last question arrives (SCBench's setting): turns by chatkv's "
        "window step; attention (the question's observation window), querylog (commit-time, the turns' own queries), "
        "kvzip (commit-time, each turn's ids reconstructed when it commits: as served) and kvzip whole (one "
        "reconstruction of the whole context at the end, KVzip's own setting) scores with the kept "
        "total spent uniform (as served), per_head (Ada-KV) or per_layer (PyramidKV), as masks; tok: mean tokens "
        "held when the question starts; KL(reference || policy) in nats per position of the 24-token reply"
    )
    needed_rows = []
    turns_both = _size_for_95(comp["turns"], KINDS, full)
    for name in COMPRESSED:
        sizes = [_size_for_95(comp[name], kinds, full) for kinds in ((KINDS[0],), (KINDS[1],), KINDS)]
        cells = [f"{n:.0f}" if n is not None else "not reached" for n in sizes]
        needed_rows.append([name, *cells, _saving(turns_both, sizes[-1])])
    print_table(
        "Cache tokens for 95% top-1 agreement, final-turn compression (interpolated on agreement vs actual size)",
        ["compression", "first", "later", "both", "saves vs turns (both)"],
        needed_rows,
    )
    summary = quality["summary"]
    rows = []
    for fraction in FRACTIONS:
        for kind in KINDS:
            line: list[str] = [f"{fraction:.0%}", kind]
            for policy in POLICIES:
                p = summary[policy][fraction][kind]
                line += [f"{p['size']:.0f}", cell(p)] if p["n"] else ["-", "-"]
            line.append(", ".join(f"{summary[p][fraction][kind]['n']:.0f}" for p in POLICIES))
            rows.append(line)
    print_table(
        "Multi-turn: the history replayed under each policy, every turn fitted (top-1 / KL)",
        ["budget", "asked", *[h for p in POLICIES for h in (f"{p} tok", p)], "measured"],
        rows,
    )
    print(
        "a budget below the document's own turn cannot be replayed (chatkv refuses a turn that does not fit the "
        "window); refused with the recent window, measured without it: "
        + "; ".join(f"{p} " + ", ".join(str(quality["refused"][p][f]) for f in FRACTIONS) for p in POLICIES)
    )
    ttft = quality["ttft"]
    rows = []
    for fraction in FRACTIONS:
        base = _median(ttft["turns"][fraction])
        timed = [f"{fraction:.0%}"]
        for policy in POLICIES:
            times = ttft[policy][fraction]
            ratio = f" ({_median(times) / base:.2f}x)" if times and base else ""
            timed.append(f"{_median(times) * 1000:.0f} ms{ratio}, n={len(times)}" if times else "-")
        rows.append(timed)
    print_table(
        "Multi-turn TTFT of the turns where the window acted (median; window step + prefill of the user ids; x turns)",
        ["budget", *POLICIES],
        rows,
    )
    costs = quality["costs"]
    if costs["turn"]:
        turn = _mean(costs["turn"])
        print(
            f"commit-time scoring, unbounded replays: a turn (prefill of its user ids and reply) {turn * 1000:.1f} ms; "
            f"KVzip reconstruction of the turn {_mean(costs['commit kvzip']) * 1000:.1f} ms "
            f"({_mean(costs['commit kvzip']) / turn:.2f}x), query log {_mean(costs['commit querylog']) * 1000:.1f} ms "
            f"({_mean(costs['commit querylog']) / turn:.2f}x); one reconstruction of the whole context "
            f"{_mean(costs['kvzip whole']) * 1000:.0f} ms "
            f"({len(costs['turn'])} turns, {len(costs['kvzip whole'])} contexts)"
        )
    padding = quality["per_head_padding"]
    print_table(
        "Per-head (Ada-KV) counts padded to each model layer's longest head: own tokens held over tokens kept "
        "(mean; what rectangular tensors would spend)",
        ["scores", *(f"{f:.0%}" for f in FRACTIONS)],
        [[s, *(f"{_mean(padding[s][f]):.2f}x" if padding[s][f] else "-" for f in FRACTIONS)] for s in SCORERS],
    )
    checks = quality["mask_check_max_abs_logp"]
    if checks:
        print(
            "check: uniform as a mask against the served eviction (evict_by_scores, gathered), 25% budget, "
            f"conversation 0: max |log-prob difference| {max(checks):.2e} over {len(checks)} cases"
        )


def _size_for_95(cells: dict[float, dict[str, dict[str, float]]], kinds: tuple[str, ...], full: float) -> float | None:
    curve = [(full, 1.0)]
    for fraction in FRACTIONS:
        measured = [cells[fraction][k] for k in kinds]
        if all(c["n"] for c in measured):
            size = sum(c["size"] for c in measured) / len(measured)
            curve.append((size, sum(c["top1"] for c in measured) / len(measured)))
    return size_for(curve, 0.95)


def print_cost(recall: dict[str, Any]) -> None:
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
            + "; commit-time scores per turn (after the reply): query log "
            f"{_mean(t['commit querylog']) * 1000:.1f} ms, "
            f"KVzip reconstruction {_mean(t['commit kvzip']) * 1000:.1f} ms"
        )
        print(
            "a turn here: the window step and the prefill of the turn's user ids and its (teacher-forced) reply; "
            "an attention turn prefills its ids once, on the full cache, then evicts (SnapKV-style); a querylog "
            "or kvzip turn (window_policy agnostic) only gathers by its stored scores"
        )


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def _mean(values: list[float] | list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def _saving(turns: float | None, attention: float | None) -> str:
    if turns is None or attention is None:
        return "-"
    return f"{1 - attention / turns:.0%}"


if __name__ == "__main__":
    main()
