"""Streaming detokenisation of one long reply: the tokenizers library's incremental `DecodeStream`
(what `sessions/turn/detokenizer.py` uses for a fast tokenizer) against re-decoding the whole reply
for every token (its fallback, and what chatkv did before; issue 23).

The reply is a fixed text of English, accents, CJK and emoji encoded with the default model's
tokenizer and cut to `--tokens` ids (2,000 by default). Each path streams it token by token through
`IncrementalDetokenizer` and finishes it; the table gives the median time per reply over
`--repeats` runs, per token, and the ratio. A sanity line checks that both released the same
pieces and that they join to `tokenizer.decode` of all the ids. No model is loaded (the tokenizer
only). This work runs on the callers' threads, beside the engine loop.

    .venv/bin/python benchmarks/detokenize.py [--tokens 2000] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PASSAGE = (
    "Here is a summary of your order: two coffees (one café crème, one naïve latte), a croissant and "
    "a bowl of 拉面. 猫が好きです 🐱🎉 — the total comes to €12.40. If you would like to change anything, "
    "reply with the item's number; 한국어 and Ελληνικά replies are fine too 👩‍👩‍👧. "
)


class _DecodeOnly:
    """The tokenizer seen through `decode` only: `IncrementalDetokenizer` then re-decodes."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = tokenizer.decode


def _stream(tokenizer: Any, ids: list[int]) -> tuple[float, list[str]]:
    from sessions.turn.detokenizer import IncrementalDetokenizer

    began = time.perf_counter()
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(token) for token in ids]
    pieces.append(detokenizer.finish())
    return time.perf_counter() - began, pieces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000, help="reply length in tokens (default 2000)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per path; the median is shown (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (the decode is Rust)")
    parser.add_argument("--model-cache-dir", type=Path, default=REPO / ".cache" / "models")
    args = parser.parse_args()

    import tokenizers
    import torch
    from transformers import AutoTokenizer

    from sessions.model_source import converted_default_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(converted_default_dir(args.model_cache_dir))
    text = PASSAGE
    while len(tokenizer.encode(text, add_special_tokens=False)) < args.tokens:
        text += PASSAGE
    ids = tokenizer.encode(text, add_special_tokens=False)[: args.tokens]
    whole = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    print(f"# detokenize: one {len(ids)}-token reply streamed token by token")
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads "
        f"{torch.get_num_threads()}, Python {platform.python_version()}, tokenizers {tokenizers.__version__}"
    )
    results: dict[str, tuple[float, list[str]]] = {}
    for name, subject in (("re-decode (baseline)", _DecodeOnly(tokenizer)), ("DecodeStream", tokenizer)):
        runs = [_stream(subject, ids) for _ in range(args.repeats)]
        results[name] = (statistics.median(s for s, _ in runs), runs[0][1])
    rows = [(name, f"{s * 1e3:.1f}", f"{s / len(ids) * 1e6:.2f}") for name, (s, _) in results.items()]
    print(f"\n{'path':<22}{'ms/reply':>10}{'µs/token':>10}")
    for name, ms, us in rows:
        print(f"{name:<22}{ms:>10}{us:>10}")
    baseline, stream = results["re-decode (baseline)"], results["DecodeStream"]
    print(f"\nratio re-decode / DecodeStream: {baseline[0] / stream[0]:.0f}x")
    same = baseline[1] == stream[1] and "".join(stream[1]) == whole
    print(f"same pieces, joined equal tokenizer.decode: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
