"""Each model layer's attention kind, read from the model, and the models chatkv refuses.

A model layer attends to the whole context (`full`) or to the last W tokens (`sliding`, a query
sees itself and the W - 1 before it, as transformers' `sliding_window_overlay`), either with or
without learned attention **sinks** (one logit per head in every softmax, gpt-oss). The kinds are
what transformers itself reads: `config.layer_types` (`full_attention` / `sliding_attention`) and
`config.sliding_window`, or for configs without layer types (Mistral, Phi-3) a `sliding_window`
that applies to every layer. `ModelRunner` then probes one packed step and checks that each
layer's attention call passes the same window (`confirm`), so a config read wrongly is refused,
never served.

Refused at load with `UnsupportedModel`, one line naming what is unsupported: encoder-decoder
models, latent-compressed KV (MLA: `kv_lora_rank`), KV shared across layers (`num_kv_shared_layers`),
and any layer type other than full or sliding attention (linear attention, recurrent or
state-space layers, chunked attention), whose caches chatkv cannot reuse exactly.

Memory per token and model layer: keys and values, `2 * kv_heads * head_dim * element_size`
bytes; a sliding layer keeps at most W - 1 tokens of a session at rest (plus the turn in flight).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sessions.errors import UnsupportedModel

SUPPORTED_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


class AttentionKind(enum.StrEnum):
    FULL = "full"
    SLIDING = "sliding"


@dataclass(frozen=True)
class LayerAttention:
    """One model layer's attention kind.

    Attributes:
        kind: `full` or `sliding`.
        window_tokens: W for a sliding layer (`None` for full): a query attends to its own token and
            the W - 1 before it.
        sinks: the layer has learned attention sinks (found by the load probe).

    Raises:
        ValueError: for a sliding layer without a window >= 1, or a full one with a window.
    """

    kind: AttentionKind
    window_tokens: int | None = None
    sinks: bool = False

    def __post_init__(self) -> None:
        sliding = self.kind is AttentionKind.SLIDING
        if sliding != (self.window_tokens is not None) or (sliding and (self.window_tokens or 0) < 1):
            raise ValueError(f"a {self.kind} layer cannot have window_tokens={self.window_tokens}")

    def describe(self) -> str:
        """`full`, `sliding 4096`, with `+ sinks` when it has them."""
        text = "full" if self.window_tokens is None else f"sliding {self.window_tokens}"
        return f"{text} + sinks" if self.sinks else text


def read_attention_kinds(config: Any) -> tuple[LayerAttention, ...]:
    """The attention kind of every model layer of a decoder `config` (its text config).

    Raises:
        UnsupportedModel: for a model whose cache chatkv cannot reuse exactly (see the module
            docstring).
    """
    _refuse_cache_shapes(config)
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window else "full_attention"] * layers
    unknown = sorted({str(t) for t in types} - set(SUPPORTED_LAYER_TYPES))
    if unknown:
        raise UnsupportedModel(
            f"model layers of type {', '.join(unknown)} are not supported "
            "(chatkv reuses full and sliding-window attention caches only)"
        )
    if len(types) != layers:
        raise UnsupportedModel(f"the config lists {len(types)} layer types for {layers} model layers")
    full = LayerAttention(AttentionKind.FULL)
    if "sliding_attention" not in types:
        return tuple(full for _ in types)
    if not (isinstance(window, int) and window >= 1):
        raise UnsupportedModel(f"sliding-window layers without a usable sliding_window ({window!r})")
    sliding = LayerAttention(AttentionKind.SLIDING, window)
    return tuple(sliding if t == "sliding_attention" else full for t in types)


def _refuse_cache_shapes(config: Any) -> None:
    if not getattr(config, "num_attention_heads", None):
        raise UnsupportedModel(
            f"{getattr(config, 'model_type', 'this model')} has no attention layers (a recurrent or state-space model)"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel("encoder-decoder models are not supported (chatkv caches decoder-only self-attention)")
    if getattr(config, "kv_lora_rank", None):
        raise UnsupportedModel("latent-compressed KV caches (MLA, kv_lora_rank) are not supported")
    if getattr(config, "num_kv_shared_layers", 0):
        raise UnsupportedModel("KV caches shared across model layers (num_kv_shared_layers) are not supported")


def confirm(kinds: Sequence[LayerAttention], observed: Mapping[int, Mapping[str, Any]]) -> tuple[LayerAttention, ...]:
    """`kinds` checked against the arguments each layer's attention passed in the load probe
    (`PackedBatch.observed`), with each layer's sinks filled in.

    Raises:
        UnsupportedModel: if a model layer's attention never received the packed step, or passed
            another sliding window than its config says.
    """
    missing = [index for index in range(len(kinds)) if index not in observed]
    if missing:
        raise UnsupportedModel(
            f"model layers {_ranges(missing)} did not run chatkv's packed attention "
            "(their attention does not go through transformers' attention interface)"
        )
    confirmed = []
    for index, kind in enumerate(kinds):
        seen = observed[index]
        if seen.get("sliding_window") != kind.window_tokens:
            raise UnsupportedModel(
                f"model layer {index} attends with sliding_window={seen.get('sliding_window')!r}, "
                f"its config says {kind.describe()}"
            )
        confirmed.append(LayerAttention(kind.kind, kind.window_tokens, sinks=seen.get("s_aux") is not None))
    return tuple(confirmed)


def summary(kinds: Sequence[LayerAttention]) -> str:
    """One line: e.g. `5 x sliding 512, 1 x full` in first-seen order."""
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[kind.describe()] = counts.get(kind.describe(), 0) + 1
    return ", ".join(f"{n} x {name}" for name, n in counts.items())


def _ranges(indices: Sequence[int]) -> str:
    return ", ".join(str(i) for i in indices[:8]) + (", ..." if len(indices) > 8 else "")
