"""Tiny random-weight models of the families the suite checks chatkv against (the family matrix).

Each is two to six model layers of width 64 with SmolLM2's tokenizer and chat template, float32,
weights drawn with `initializer_range=0.2` so that greedy decoding has clear winners (the default
0.02 gives near-ties that float rounding could flip). Sliding-window families get a window of
`WINDOW` tokens, far shorter than the test conversations, so every turn crosses it.

The configs set only what makes each family itself (its attention kinds, sinks, soft-capping,
partial rotary, QK norms, parallel residuals); everything else is the family's default.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

WINDOW = 16
"""Sliding window of the sliding-window families, in tokens."""


def _common(tokenizer: Any) -> dict[str, Any]:
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "initializer_range": 0.2,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": True,
    }


def _without(values: dict[str, Any], *names: str) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k not in names}


FAMILIES: dict[str, Callable[[dict[str, Any]], tuple[Any, type]]] = {
    "llama": lambda c: (transformers.LlamaConfig(**c, head_dim=16), transformers.LlamaForCausalLM),
    "qwen2": lambda c: (transformers.Qwen2Config(**c), transformers.Qwen2ForCausalLM),
    "qwen3": lambda c: (transformers.Qwen3Config(**c, head_dim=16), transformers.Qwen3ForCausalLM),
    "mistral-window": lambda c: (
        transformers.MistralConfig(**c, head_dim=16, sliding_window=WINDOW),
        transformers.MistralForCausalLM,
    ),
    "gemma2": lambda c: (
        transformers.Gemma2Config(**c, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16),
        transformers.Gemma2ForCausalLM,
    ),
    "gemma3": lambda c: (
        transformers.Gemma3TextConfig(
            **{**c, "num_hidden_layers": 6}, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16
        ),
        transformers.Gemma3ForCausalLM,
    ),
    "gpt-oss": lambda c: (
        transformers.GptOssConfig(
            **_without(c, "intermediate_size"),
            intermediate_size=64,
            head_dim=16,
            sliding_window=WINDOW,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        transformers.GptOssForCausalLM,
    ),
    "phi3": lambda c: (transformers.Phi3Config(**c), transformers.Phi3ForCausalLM),
    "gpt-neox": lambda c: (
        transformers.GPTNeoXConfig(**_without(c, "num_key_value_heads")),
        transformers.GPTNeoXForCausalLM,
    ),
    "olmo2": lambda c: (transformers.Olmo2Config(**c), transformers.Olmo2ForCausalLM),
    "stablelm": lambda c: (transformers.StableLmConfig(**c), transformers.StableLmForCausalLM),
}
"""Family name -> (config, model class) from the common tiny settings."""

SLIDING_FAMILIES = ("mistral-window", "gemma2", "gemma3", "gpt-oss")


def save_family_model(family: str, tokenizer: Any, path: Path) -> Path:
    """Save a tiny random model of `family` with `tokenizer` under `path` (seeded: the same weights
    every run) and return `path`."""
    config, model_class = FAMILIES[family](_common(tokenizer))
    torch.manual_seed(0)
    model_class(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
