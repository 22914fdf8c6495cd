"""Bytes, restore time and next-turn TTFT of sessions on a model with sliding-window layers (issue 29).

A Gemma-3-shaped random model (`--layers` model layers, every sixth full attention and the other
five sliding windows of `--window` tokens, SmolLM2's tokenizer and chat template, float32) is
served twice in the same run:

- windowed:   chatkv reads each model layer's kind; a sliding layer keeps its last W - 1 tokens
              on the device and in every tier;
- all-full:   the same weights with every layer declared full attention (what chatkv did before
              per-layer kinds: every layer keeps every token). Its replies differ (another
              attention), so it is a baseline for bytes and time only.

For conversations of about 1k, 4k and 8k tokens (one long first turn, then short turns): the
session's own KV bytes on the device, its sealed bytes in the host, disk and Redis tiers, the
restore time from host, disk and Redis (`TurnStats.restore_s`, cache moved there just before the
turn), and the next turn's TTFT from each. Replies of the windowed model are checked token for
token against transformers' `generate` on an untouched copy of the model.

    .venv/bin/python benchmarks/sliding_window_memory.py --threads 1
    .venv/bin/python benchmarks/sliding_window_memory.py --quick       # 1k and 2k tokens
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import redis
import torch
import transformers
from _common import (
    base_parser,
    fmt_mb,
    fmt_ratio,
    fmt_s,
    median,
    open_manager,
    print_header,
    print_table,
    temp_dir,
    user_message,
    write_json,
)

from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.model_source import converted_default_dir, load_model
from sessions.turn.chat_template import PastTurn

SYSTEM = "You are a helpful assistant. Answer questions about the texts the user shares."
FOLLOW_UPS = ("Thanks. What is the main point?", "And the second point?", "Anything else?", "Summarise.")
REPLY_TOKENS = 8


def gemma3_shaped(path: Path, tokenizer: Any, layers: int, window: int, all_full: bool) -> Path:
    """Save a random Gemma-3-shaped model (seeded: both variants get the same weights)."""
    types = ["full_attention" if (i + 1) % 6 == 0 or all_full else "sliding_attention" for i in range(layers)]
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=window,
        layer_types=types,
        max_position_embeddings=16384,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def redis_url_or_none(url: str) -> str | None:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1)
        client.ping()
        client.close()
        return url
    except redis.exceptions.RedisError:
        return None


def measure(manager: SessionManager, engine: Engine, tokens: int, reference: Any | None) -> dict[str, Any]:
    """One conversation of about `tokens` tokens; its bytes per tier and a turn restored from each."""
    tenant = manager.create_tenant(f"t{secrets.token_hex(3)}").id
    sid = manager.open_session(tenant, SYSTEM)
    key = manager.internals.tiers_key(tenant, sid)
    first = user_message(engine, 0, tokens)
    past = [
        PastTurn(first, (reply := manager.chat(tenant, sid, first, max_new_tokens=REPLY_TOKENS)).text, reply.token_ids)
    ]
    out: dict[str, Any] = {"tokens": manager.internals.tiers.peek(key).total_tokens}  # type: ignore[union-attr]
    cache = manager.internals.tiers.peek(key)
    assert cache is not None
    out["device_bytes"] = cache.own_nbytes
    exact = True
    for tier, message in zip(("device", "host", "disk", "redis"), FOLLOW_UPS, strict=True):
        if tier in ("host", "disk"):
            manager.internals.tiers.flush()
            manager.evict_session(tenant, sid, tier)
            out[f"{tier}_bytes"] = manager.internals.tiers.entry_bytes(key)
        elif tier == "redis":
            if manager.internals.shared_store is None:
                continue
            manager.internals.tiers.publish(key)
            out["redis_bytes"] = manager.internals.shared_store.nbytes(key)
            manager.evict_session(tenant, sid, "drop")
        reply = manager.chat(tenant, sid, message, max_new_tokens=REPLY_TOKENS)
        if reference is not None:
            exact &= list(reply.token_ids) == expected_reply(manager, reference, past, message)
        past.append(PastTurn(message, reply.text, reply.token_ids))
        out[f"{tier}_ttft_s"] = reply.stats.ttft_s
        out[f"{tier}_restore_s"] = reply.stats.restore_s if reply.stats.restored_from == tier else None
    # Regenerating the last reply: a fork at the turn before it. A sliding layer no longer holds
    # the window as it was there, so the windowed model rebuilds the fork by prefill; keeping a
    # window checkpoint per turn boundary would cost the bytes computed here instead.
    last = manager.internals.tiers.peek(key)
    assert last is not None
    fork = manager.fork(tenant, sid, at_turn=len(past) - 1)
    reply = manager.chat(tenant, fork, past[-1].user_text, max_new_tokens=REPLY_TOKENS)
    out["fork_ttft_s"], out["fork_source"] = reply.stats.ttft_s, reply.stats.restored_from
    sliding = sum(1 for w in engine.layout.windows if w is not None)
    out["checkpoint_bytes"] = sliding * last.layers[-1].token_count * engine.layout.layer_bytes_per_token
    out["exact"] = exact if reference is not None else None
    return out


@torch.inference_mode()
def expected_reply(manager: SessionManager, reference: Any, past: list[PastTurn], message: str) -> list[int]:
    ids = torch.tensor([list(manager.internals.template.conversation(SYSTEM, past, message).token_ids)])
    generated = reference.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=REPLY_TOKENS, do_sample=False
    )
    out: list[int] = generated[0, ids.shape[1] :].tolist()
    return out


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="model layers (every sixth is full attention)")
    parser.add_argument("--window", type=int, default=512, help="sliding window of the sliding layers")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--repeats", type=int, default=3, help="conversations per size and model (medians)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [1000, 2000] if args.quick else [1000, 4000, 8000]
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted_default_dir(args.model_cache_dir))
    redis_url = redis_url_or_none(args.redis_url)
    results: dict[str, dict[int, list[dict[str, Any]]]] = {}
    with temp_dir("sliding") as root:
        engines = {
            variant: Engine(
                load_model(
                    str(gemma3_shaped(root / variant, tokenizer, args.layers, args.window, variant == "all-full")),
                    args.model_cache_dir,
                    args.device,
                    args.dtype,
                )
            )
            for variant in ("windowed", "all-full")
        }
        reference = transformers.AutoModelForCausalLM.from_pretrained(root / "windowed", dtype=torch.float32).eval()
        print_header(
            "Sliding-window layers: bytes, restore and TTFT against every layer full",
            engines["windowed"],
            [
                f"model: random Gemma-3 shape, {args.layers} model layers "
                f"({args.layers // 6} full attention), window {args.window}",
                f"redis: {redis_url or 'none answered (no Redis rows)'}; repeats {args.repeats}",
            ],
        )
        for variant, engine in engines.items():
            with temp_dir("warm-up") as home, open_manager(home, engine, args.model_cache_dir) as manager:
                measure(manager, engine, 256, None)  # kernels, allocator, template caches
            results[variant] = {tokens: [] for tokens in sizes}
        # Interleaved (windowed, all-full, windowed, ...) so that load drift falls on both alike.
        for tokens in sizes:
            for _ in range(args.repeats):
                for variant, engine in engines.items():
                    extra = (
                        {"redis_url": redis_url, "redis_prefix": f"bench-{secrets.token_hex(4)}"} if redis_url else {}
                    )
                    with (
                        temp_dir(variant) as home,
                        open_manager(home, engine, args.model_cache_dir, **extra) as manager,
                    ):
                        started = time.perf_counter()
                        ref = reference if variant == "windowed" else None
                        results[variant][tokens].append(measure(manager, engine, tokens, ref))
                        print(f"  {variant} {tokens} tokens: {time.perf_counter() - started:.1f} s", flush=True)
    report(results, sizes)
    write_json(args.json, {"results": results}, engines["windowed"])


def _med(rows: list[dict[str, Any]], name: str) -> float | None:
    values = [row[name] for row in rows if row.get(name) is not None]
    return median(values) if values else None


def report(results: dict[str, dict[int, list[dict[str, Any]]]], sizes: list[int]) -> None:
    win, full = results["windowed"], results["all-full"]
    byte_rows, time_rows = [], []
    for tokens in sizes:
        for tier in ("device", "host", "disk", "redis"):
            w, f = _med(win[tokens], f"{tier}_bytes"), _med(full[tokens], f"{tier}_bytes")
            byte_rows.append([f"{tokens} {tier}", fmt_mb(w), fmt_mb(f), fmt_ratio(w / f if w and f else None)])
            if tier == "device":
                continue
            wr, fr = _med(win[tokens], f"{tier}_restore_s"), _med(full[tokens], f"{tier}_restore_s")
            wt, ft = _med(win[tokens], f"{tier}_ttft_s"), _med(full[tokens], f"{tier}_ttft_s")
            time_rows.append(
                [
                    f"{tokens} {tier}",
                    fmt_s(wr),
                    fmt_s(fr),
                    fmt_ratio(wr / fr if wr and fr else None),
                    fmt_s(wt),
                    fmt_s(ft),
                    fmt_ratio(wt / ft if wt and ft else None),
                ]
            )
        wt, ft = _med(win[tokens], "device_ttft_s"), _med(full[tokens], "device_ttft_s")
        time_rows.append(
            [f"{tokens} device", "-", "-", "-", fmt_s(wt), fmt_s(ft), fmt_ratio(wt / ft if wt and ft else None)]
        )
    print_table(
        "Session KV bytes (own tensors on the device; sealed blobs in the tiers)",
        ["size tier", "windowed", "all-full", "ratio"],
        byte_rows,
    )
    print_table(
        "Restore and next-turn TTFT by where the cache was",
        ["size tier", "restore win", "restore full", "ratio", "TTFT win", "TTFT full", "ratio"],
        time_rows,
    )
    fork_rows = []
    for tokens in sizes:
        wf, ff = _med(win[tokens], "fork_ttft_s"), _med(full[tokens], "fork_ttft_s")
        sources = f"{win[tokens][0]['fork_source']} / {full[tokens][0]['fork_source']}"
        checkpoint = _med(win[tokens], "checkpoint_bytes")
        fork_rows.append(
            [str(tokens), sources, fmt_s(wf), fmt_s(ff), fmt_ratio(wf / ff if wf and ff else None), fmt_mb(checkpoint)]
        )
    print_table(
        "Regenerate (a fork at the previous turn): rebuilt by prefill, or what a window checkpoint would cost",
        ["size", "fork from (win / full)", "TTFT win", "TTFT full", "ratio", "checkpoint bytes"],
        fork_rows,
    )
    exact = [row["exact"] for rows in win.values() for row in rows]
    print(f"\nwindowed replies equal transformers' generate: {sum(exact)}/{len(exact)} conversations (every turn)")


if __name__ == "__main__":
    main()
