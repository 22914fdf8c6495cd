"""Quality of quantised offload (int8 / int4 KIVI) on real conversations (issue 4).

`--conversations` (20) fixed multi-turn conversations are run through chatkv with the real default
model (greedy, exact cache). Before the last user message, the session's device cache is snapshotted;
chatkv's exact reply to that message is the reference. For each `offload_precision` the snapshot is
then sealed and opened again with chatkv's own sealer (`sessions.offload.EncryptedCacheSealer`, the
code that `evict_session(..., "host")` and the restore run: quantise unpinned turn layers except the
most recent `quant_residual_tokens`, safetensors, AES-256-GCM; then decrypt, decode, dequantise),
and on that cache the same next turn is run with the engine:

- bytes/token: sealed blob bytes per cached own token (the shared base layer is stored separately,
  always exact, and not counted); `capacity` = exact bytes / this precision's bytes;
- greedy agreement: position-by-position agreement of the reply generated on the restored cache
  with the exact reply (matches / exact reply length), identical replies, mean common prefix;
- teacher-forced: the exact reply is fed after the restored cache; top-1 agreement of the next-token
  argmax and mean KL(exact || quantised) of the next-token distributions over the reply's positions.

Why the sealer and not the manager: a session can be evicted and restored only once per turn, the
KL needs logits that `chat` does not return, and one snapshot serves all precisions, so every
precision sees bit-identical history. The manager path is checked once per lossy precision on the
first conversation (a manager with `offload_precision` set: replay, `evict_session(host)`, `chat`)
and must give the same reply as the sealer path.

    .venv/bin/python benchmarks/quant_quality.py            # 20 conversations, 3 turns + next, 48-token replies
    .venv/bin/python benchmarks/quant_quality.py --quick    # 5 conversations, 2 turns + next, 32-token replies
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, cast

import torch
from _common import (
    PARAGRAPHS,
    QUESTIONS,
    SYSTEM_PROMPT,
    base_parser,
    open_manager,
    print_header,
    print_table,
    setup,
    temp_dir,
)
from _common import write_json as write_json_file

from cache.serialization import session_cache_to_tensors
from cache.session_cache import SessionCache
from cache.tiers import CacheKey
from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.offload import EncryptedCacheSealer
from sessions.sampling import SamplingParams
from sessions.settings import Settings

PRECISIONS = ("exact", "int8", "int4")
FOLLOW_UPS = (
    "Why does that matter?",
    "Can you give a concrete example?",
    "What would happen if it were done differently?",
    "Explain that to a ten-year-old.",
    "What is the most surprising detail here?",
    "How could someone see this for themselves?",
    "What are the risks or problems involved?",
    "Summarise our conversation so far.",
)


def conversation(index: int, turns: int) -> list[str]:
    """User messages of conversation `index`: a text with a question, then follow-ups; the last one
    is the message whose reply is compared."""
    first = f"{PARAGRAPHS[index % len(PARAGRAPHS)]}\n\n{QUESTIONS[index % len(QUESTIONS)]}"
    follow = [FOLLOW_UPS[(index + 3 * k) % len(FOLLOW_UPS)] for k in range(turns)]
    return [first, *follow]


@dataclass
class Reference:
    cache: SessionCache  # device cache before the last message (base attached)
    prefill: tuple[int, ...]  # ids the last turn prefills on top of it
    reply: tuple[int, ...]  # chatkv's exact greedy reply to the last message
    key: CacheKey


def build(manager: SessionManager, tenant: Any, messages: list[str], reply_tokens: int) -> Reference:
    sid = manager.open_session(tenant, system_prompt=SYSTEM_PROMPT)
    for message in messages[:-1]:
        manager.chat(tenant, sid, message, max_new_tokens=reply_tokens)
    key = CacheKey(tenant.id, sid)
    cache = manager.internals.tiers.peek(key)
    assert cache is not None, "the session cache should be on the device"
    reply = manager.chat(tenant, sid, messages[-1], max_new_tokens=reply_tokens)
    prefill = manager.history(tenant, sid)[-2].token_ids  # the user message's prefilled ids
    manager.internals.tiers.flush()
    return Reference(cache, tuple(prefill), reply.token_ids, key)


@torch.inference_mode()
def greedy_reply(engine: Engine, cache: SessionCache, prefill: tuple[int, ...], max_new: int) -> tuple[int, ...]:
    working = cache.to_working_cache(len(prefill) + max_new)
    return tuple(engine.generate(working, prefill, SamplingParams(max_new_tokens=max_new)))


@torch.inference_mode()
def forced_log_probs(
    engine: Engine, cache: SessionCache, prefill: tuple[int, ...], reply: tuple[int, ...]
) -> torch.Tensor:
    """`[len(reply), vocab]` float64 log-probabilities of each reply position, the exact reply fed."""
    ids = [*prefill, *reply[:-1]]
    working = cache.to_working_cache(len(ids))
    input_ids = torch.tensor([ids], dtype=torch.long, device=engine.device)
    out = engine.model(input_ids=input_ids, cache=working, use_cache=True)
    logits = out.logits[0, len(prefill) - 1 :].to(torch.float64)
    return torch.log_softmax(logits, dim=-1)


def _default_residual() -> int:
    """`Settings.quant_residual_tokens`'s default (what a manager uses unless configured)."""
    return int(cast(int, next(f.default for f in fields(Settings) if f.name == "quant_residual_tokens")))


def _margin(exact_logp: torch.Tensor, position: int) -> float | None:
    """Probability gap between the exact model's two most likely tokens at `position` (a small gap
    means a near-tie that any perturbation may flip)."""
    if position >= exact_logp.shape[0]:
        return None  # the quantised reply is longer or shorter, not different at a position
    top = exact_logp[position].exp().topk(2).values
    return float(top[0] - top[1])


def _brief(precision: str, result: dict[str, Any]) -> str:
    if result["identical"]:
        return f"{precision} same reply (KL {result['mean_kl']:.1e})"
    margin = result["exact_margin_there"]
    where = f"diverges at token {result['first_divergence']}" + (
        f" (exact top-2 gap {margin:.2f})" if margin is not None else ""
    )
    return f"{precision} {result['agreement']:.0%} agreement, {where} (KL {result['mean_kl']:.1e})"


def manager_path_reply(
    engine: Engine, args: Any, root: Any, precision: str, messages: list[str], reply_tokens: int
) -> tuple[tuple[int, ...], str]:
    """Replay a conversation on a manager with `offload_precision`, evict to host, run the last turn."""
    with open_manager(root / f"mgr-{precision}", engine, args.model_cache_dir, offload_precision=precision) as m:
        tenant = m.create_tenant("check")
        sid = m.open_session(tenant, system_prompt=SYSTEM_PROMPT)
        for message in messages[:-1]:
            m.chat(tenant, sid, message, max_new_tokens=reply_tokens)
        m.internals.tiers.flush()
        m.evict_session(tenant, sid, "host")
        reply = m.chat(tenant, sid, messages[-1], max_new_tokens=reply_tokens)
    return reply.token_ids, reply.stats.restored_from


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=None, help="conversations (default 20)")
    parser.add_argument("--turns", type=int, default=None, help="turns before the compared one (default 3)")
    parser.add_argument("--reply-tokens", type=int, default=None, help="max_new_tokens per reply (default 48)")
    parser.add_argument("--residual", type=int, default=None, help="quant_residual_tokens (default: Settings default)")
    args = parser.parse_args()
    count = args.conversations or (5 if args.quick else 20)
    turns = args.turns or (2 if args.quick else 3)
    reply_tokens = args.reply_tokens or (32 if args.quick else 48)
    residual = _default_residual() if args.residual is None else args.residual

    engine = setup(args)
    print_header(
        "quant_quality: int8 / int4 offload vs exact on real conversations",
        engine,
        [
            f"{count} conversations, {turns} turns then the compared turn; greedy replies <= {reply_tokens} tokens; "
            f"quant_residual_tokens = {residual}",
            "quantised cache = chatkv's sealer (the host/disk tier code) at each precision, opened again; "
            "replies and teacher-forced logits computed with the engine on that cache",
        ],
    )
    sums: dict[str, dict[str, float]] = {
        p: {
            "blob_bytes": 0,
            "own_tokens": 0,
            "lossy_tokens": 0,
            "matches": 0,
            "ref_tokens": 0,
            "identical": 0,
            "prefix_frac": 0.0,
            "forced_top1": 0,
            "kl_sum": 0.0,
            "kl_max": 0.0,
        }
        for p in PRECISIONS
    }
    per_conversation: list[dict[str, Any]] = []
    exact_reference_ok = 0
    with temp_dir("quant") as root:
        with open_manager(root / "home", engine, args.model_cache_dir) as manager:
            tenant = manager.create_tenant("bench")
            sealers = {
                p: EncryptedCacheSealer(
                    manager.internals.keys,
                    engine.fingerprint,
                    engine.device,
                    p,
                    residual,
                    max_payload_bytes=manager.internals.sealer.max_payload_bytes,
                )
                for p in PRECISIONS
            }
            for c in range(count):
                messages = conversation(c, turns)
                ref = build(manager, tenant, messages, reply_tokens)
                exact_logp = forced_log_probs(engine, ref.cache, ref.prefill, ref.reply)
                exact_top1 = exact_logp.argmax(dim=-1)
                row: dict[str, Any] = {"conversation": c, "cache_tokens": ref.cache.total_tokens}
                for p in PRECISIONS:
                    blob = sealers[p].seal_session(ref.key, ref.cache)
                    restored = sealers[p].open_session(ref.key, blob).with_base(ref.cache.base)
                    _, header = session_cache_to_tensors(ref.cache, p, residual)
                    lossy = sum(end - start for start, end in header["lossy_ranges"])
                    reply = greedy_reply(engine, restored, ref.prefill, reply_tokens)
                    logp = forced_log_probs(engine, restored, ref.prefill, ref.reply)
                    kl = (exact_logp.exp() * (exact_logp - logp)).sum(dim=-1)
                    matches = sum(1 for i, t in enumerate(ref.reply) if i < len(reply) and reply[i] == t)
                    prefix = next((i for i, (a, b) in enumerate(zip(ref.reply, reply, strict=False)) if a != b), None)
                    prefix = min(len(ref.reply), len(reply)) if prefix is None else prefix
                    s = sums[p]
                    s["blob_bytes"] += len(blob)
                    s["own_tokens"] += ref.cache.own_tokens
                    s["lossy_tokens"] += lossy
                    s["matches"] += matches
                    s["ref_tokens"] += len(ref.reply)
                    s["identical"] += int(reply == ref.reply)
                    s["prefix_frac"] += prefix / len(ref.reply)
                    s["forced_top1"] += int((logp.argmax(dim=-1) == exact_top1).sum())
                    s["kl_sum"] += float(kl.sum())
                    s["kl_max"] = max(s["kl_max"], float(kl.max()))
                    row[p] = {
                        "blob_bytes": len(blob),
                        "identical": reply == ref.reply,
                        "agreement": matches / len(ref.reply),
                        "mean_kl": float(kl.mean()),
                        "reply": list(reply),
                        "first_divergence": None if reply == ref.reply else prefix,
                        "exact_margin_there": _margin(exact_logp, prefix) if reply != ref.reply else None,
                    }
                    if p == "exact":
                        exact_reference_ok += int(reply == ref.reply)
                per_conversation.append(row)
                print(
                    f"  conversation {c}: {ref.cache.total_tokens} cached tokens, reply {len(ref.reply)} tokens; "
                    + ", ".join(_brief(p, row[p]) for p in PRECISIONS),
                    flush=True,
                )
        checks = {}
        first = conversation(0, turns)
        for p in ("int8", "int4"):
            checks[p] = manager_path_reply(engine, args, root, p, first, reply_tokens)

    exact_bpt = sums["exact"]["blob_bytes"] / sums["exact"]["own_tokens"]
    rows = []
    summary: dict[str, dict[str, Any]] = {}
    for p in PRECISIONS:
        s = sums[p]
        bpt = s["blob_bytes"] / s["own_tokens"]
        summary[p] = {
            "bytes_per_token": bpt,
            "capacity_vs_exact": exact_bpt / bpt,
            "lossy_fraction": s["lossy_tokens"] / s["own_tokens"],
            "greedy_agreement": s["matches"] / s["ref_tokens"],
            "identical_replies": int(s["identical"]),
            "mean_prefix_fraction": s["prefix_frac"] / count,
            "forced_top1_agreement": s["forced_top1"] / s["ref_tokens"],
            "mean_kl": s["kl_sum"] / s["ref_tokens"],
            "max_kl": s["kl_max"],
        }
        nonlossy_bytes = exact_bpt * (s["own_tokens"] - s["lossy_tokens"])
        per_lossy = (s["blob_bytes"] - nonlossy_bytes) / s["lossy_tokens"] if s["lossy_tokens"] else None
        summary[p]["bytes_per_quantised_token"] = per_lossy
        r = summary[p]
        rows.append(
            [
                p,
                f"{bpt:,.0f}",
                f"{r['capacity_vs_exact']:.2f}x",
                f"{r['lossy_fraction']:.0%}",
                f"{per_lossy:,.0f}" if per_lossy else "-",
                f"{r['greedy_agreement']:.1%}",
                f"{r['identical_replies']} of {count}",
                f"{r['mean_prefix_fraction']:.1%}",
                f"{r['forced_top1_agreement']:.1%}",
                f"{r['mean_kl']:.2e}",
                f"{r['max_kl']:.2e}",
            ]
        )
    print_table(
        f"Next-reply quality after a quantised round trip ({count} conversations, "
        f"{int(sums['exact']['ref_tokens'])} reference reply tokens)",
        [
            "precision",
            "bytes/token",
            "capacity",
            "quantised",
            "bytes/quantised token",
            "greedy agreement",
            "identical replies",
            "common prefix",
            "forced top-1",
            "mean KL",
            "max KL",
        ],
        rows,
    )
    print(
        "bytes/token: sealed blob bytes (codes, scales, exact residual window, header, AES-GCM tag) per cached "
        "own token; quantised: share of own tokens stored lossy (the rest: the residual window, pinned "
        "layers, int4's partial token group); bytes/quantised token: what a lossy token costs (codes plus "
        "scales and zero points), the exact tokens counted at the exact rate; KL(exact || quantised) in nats "
        "per reply position."
    )
    print(f"exact round trip reproduces chatkv's reply: {exact_reference_ok} of {count}")
    for p, (tokens, source) in checks.items():
        same = "yes" if list(tokens) == per_conversation[0][p]["reply"] else "NO"
        print(f"manager path ({p}: evict_session host, restored from {source}) gives the sealer path's reply: {same}")
    write_json_file(
        args.json,
        {"benchmark": "quant_quality", "residual": residual, "summary": summary, "conversations": per_conversation},
        engine,
    )


if __name__ == "__main__":
    main()
