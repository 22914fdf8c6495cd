"""Packing one step's requests into one forward pass, and the attention function that keeps them apart.

All new tokens of a step form one row, `input_ids [1, T]`; each request keeps its own RoPE
positions (`position_ids [1, T]`: its next position onwards, `PreallocatedLayer.next_position`) and its
own contiguous KV buffer (`PreallocatedLayer`, per model layer). In every attention layer:

    query  [1, heads, T, head_dim]    | req A: 1 token | req B: 1 token | req C: 40-token prefill chunk |
    StepCache.update   writes each request's new keys/values into that request's own buffer
    packed_attention   per request: SDPA(query slice, its buffer [0 .. len]) ; causal inside a chunk
    output [1, T, heads, head_dim]    the slices concatenated back in row order

So a request's logits do not depend on the other requests in the step, up to float rounding of the
batched projections. Measured on CPU (see docs/architecture.md): per-request SDPA calls over
contiguous buffers beat one SDPA over a block-diagonal mask, which must first gather every
request's KV into one tensor per model layer per step. transformers' own continuous batching
(`generate_batch`, `PagedAttentionCache`) takes token ids only and cannot continue chatkv's caches.

The function is registered with transformers' `AttentionInterface` under a name of its own; calls
without a packed step (plain use of the same model object, e.g. by tests and baselines) fall back
to the model's original implementation, so the model stays usable as an ordinary one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cache.session_cache import PreallocatedLayer

STEP_KWARG = "chatkv_step"
"""Keyword argument through which the model passes the step's `PackedBatch` to the attention."""

NO_MASK = torch.empty(1, 1, 0, 0)
"""A 4-D placeholder mask: transformers returns a prepared 4-D mask as it is, so passing this skips
building a causal mask that the packed attention would not use."""


@dataclass(frozen=True)
class Segment:
    """One request's tokens in the packed row: `[start, start + length)`.

    `layers[l]` is the request's KV buffer of model layer `l`; `mask` is `None` for one token, else
    a `[length, cached + length]` bool mask (causal inside the chunk, everything before it visible).
    """

    start: int
    length: int
    layers: Sequence[PreallocatedLayer]
    mask: torch.Tensor | None


@dataclass(frozen=True)
class PackedBatch:
    """The step's model input.

    Attributes:
        input_ids: `[1, T]` long.
        position_ids: `[1, T]` long, each request's own RoPE positions.
        segments: per request, in row order.
        logits_indices: `[R]` long: rows whose logits are needed (each sampling chunk's last token).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: tuple[Segment, ...]
    logits_indices: torch.Tensor


def pack(
    chunks: Sequence[tuple[Sequence[PreallocatedLayer], Sequence[int], bool]], device: torch.device
) -> PackedBatch:
    """Build the step's input from `(request KV layers, ids to feed, samples)` per request.

    Raises:
        ValueError: if there is no chunk or a chunk has no ids.
    """
    if not chunks:
        raise ValueError("a step needs at least one chunk")
    ids: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    sampled: list[int] = []
    for layers, token_ids, samples in chunks:
        if not token_ids:
            raise ValueError("a chunk needs at least one token")
        cached = layers[0].get_seq_length()
        first_position = layers[0].next_position  # past `cached` when tokens were evicted
        n = len(token_ids)
        mask = None
        if n > 1:
            mask = torch.ones(n, cached + n, dtype=torch.bool, device=device).tril(diagonal=cached)
        segments.append(Segment(len(ids), n, layers, mask))
        ids.extend(token_ids)
        positions.extend(range(first_position, first_position + n))
        if samples:
            sampled.append(len(ids) - 1)
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        segments=tuple(segments),
        logits_indices=torch.tensor(sampled, dtype=torch.long, device=device),
    )


class StepCache(DynamicCache):
    """The `transformers` cache object of one step: routes each request's new keys and values into
    that request's own buffer. It holds no tensors itself."""

    def __init__(self, batch: PackedBatch) -> None:
        super().__init__()
        self.layers = []
        self.batch = batch

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for segment in self.batch.segments:
            end = segment.start + segment.length
            segment.layers[layer_idx].update(
                key_states[:, :, segment.start : end], value_states[:, :, segment.start : end]
            )
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def packed_attention_for(fallback: Callable[..., tuple[torch.Tensor, Any]]) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The attention function: per request over its own buffer when the model is called with a
    packed step, else `fallback` (the model's original attention implementation)."""

    def packed_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        batch: PackedBatch | None = kwargs.get(STEP_KWARG)
        if batch is None:
            return fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        layer_idx: int = getattr(module, "layer_idx", 0)
        outputs = []
        for segment in batch.segments:
            layer = segment.layers[layer_idx]
            q = query[:, :, segment.start : segment.start + segment.length]  # [1, heads, n, head_dim]
            if layer.query_observer is not None:
                layer.query_observer(q, scaling)
            outputs.append(
                F.scaled_dot_product_attention(
                    q, layer.filled_keys, layer.filled_values, attn_mask=segment.mask, scale=scaling, enable_gqa=True
                )
            )
        out = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
        return out.transpose(1, 2).contiguous(), None  # [1, T, heads, head_dim], as transformers expects

    return packed_attention


def register_packed_attention(original: str) -> str:
    """Register the packed attention for a model whose attention implementation is `original`, and
    return the name to set on the model (`model.set_attn_implementation(name)`)."""
    name = f"chatkv_packed_{original}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        fallback = ALL_ATTENTION_FUNCTIONS.get(original, sdpa_attention_forward)
        mask = ALL_MASK_ATTENTION_FUNCTIONS.get(original, sdpa_mask)
        AttentionInterface.register(name, packed_attention_for(fallback))
        AttentionMaskInterface.register(name, mask)
    return name
