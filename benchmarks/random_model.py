"""Write a randomly initialised model directory for speed benchmarks (`--model DIR` of any benchmark).

Speed does not depend on the weights' values, so a random model of a real model's architecture times
the same as the real one, and a random model of another size needs no download: on a machine that
cannot fetch weights (a GPU machine whose image lacks the bundled package) this is how a benchmark
gets its model. The tokenizer, chat template, generation config and config come from `--like` (a
model directory; a copy without the weights is enough), the weights are drawn with the model
class's own initialisation (`--seed`); `--hidden-size` and the other size flags override the config
(for a bigger Llama-shaped model). Replies of such a model are noise: use the benchmarks'
fixed-length options (`concurrency.py --ignore-eos`) where a reply's length matters.

    .venv/bin/python benchmarks/random_model.py --like DIR --out DIR [--dtype bfloat16]
        [--hidden-size 2048 --layers 16 --heads 32 --kv-heads 8 --intermediate-size 8192] [--device cuda]

Exits with status 2 and one line when `--like` holds no `config.json`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import logging as hf_logging

# What travels with a model directory apart from its weights (whichever of these `--like` has).
NON_WEIGHT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
OVERRIDES = {
    "hidden_size": "hidden-size",
    "num_hidden_layers": "layers",
    "num_attention_heads": "heads",
    "num_key_value_heads": "kv-heads",
    "intermediate_size": "intermediate-size",
    "head_dim": "head-dim",
}


def write_random_model(
    like: Path, out: Path, dtype: torch.dtype, overrides: dict[str, int], seed: int, device: str
) -> int:
    """Write `like`'s config (with `overrides`) and non-weight files and fresh random weights in
    `dtype` to `out`; return the parameter count.

    Raises:
        FileNotFoundError: `like` has no config.json.
    """
    if not (like / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {like}")
    config = AutoConfig.from_pretrained(like)
    for key, value in overrides.items():
        setattr(config, key, value)
    if "hidden_size" in overrides or "num_attention_heads" in overrides:
        config.head_dim = overrides.get("head_dim", config.hidden_size // config.num_attention_heads)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    for name in NON_WEIGHT_FILES:
        if (like / name).is_file():
            shutil.copyfile(like / name, out / name)
    model.save_pretrained(out)  # rewrites config.json with the overrides and dtype
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--like", type=Path, required=True, help="model directory: config, tokenizer, template")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the weights are drawn (cuda is faster for big ones)")
    for flag in OVERRIDES.values():
        parser.add_argument(f"--{flag}", type=int, default=None)
    args = parser.parse_args()
    overrides = {key: getattr(args, flag.replace("-", "_")) for key, flag in OVERRIDES.items()}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    hf_logging.disable_progress_bar()
    began = time.perf_counter()
    try:
        params = write_random_model(args.like, args.out, getattr(torch, args.dtype), overrides, args.seed, args.device)
    except FileNotFoundError as exc:
        print(f"random_model: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    seconds = time.perf_counter() - began
    print(f"random model: {params / 1e6:.0f}M parameters, {args.dtype}, in {args.out} ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
