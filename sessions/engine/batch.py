"""Packing one step's requests into one forward pass.

All new tokens of a step form one row, `input_ids [1, T]`; each request keeps its own RoPE
positions (`position_ids [1, T]`: its next position onwards, `PreallocatedLayer.next_position`) and its
own contiguous KV buffer (`PreallocatedLayer`, per model layer). In every attention layer:

    query  [1, heads, T, head_dim]    | req A: 1 token | req B: 1 token | req C: 40-token prefill chunk |
    StepCache.update   writes each request's new keys/values into that request's own buffer
    packed attention   per request: attention of its query slice over its buffer, by the model
                       layer's attention kind (`sessions.engine.packed_attention`)
    output [1, T, heads, head_dim]    the slices concatenated back in row order

So a request's logits do not depend on the other requests in the step, up to float rounding of the
batched projections. Measured on CPU (see docs/architecture.md): per-request SDPA calls over
contiguous buffers beat one SDPA over a block-diagonal mask, which must first gather every
request's KV into one tensor per model layer per step. On CUDA, where each call is a kernel launch
of fixed host cost, a decode-only step of several requests (`PackedBatch.block_diagonal`) does the
opposite in its plain full-attention layers: one SDPA per model layer over every request's keys
concatenated, masked block-diagonally (`PackedBatch.block_mask`); a request's output then agrees
with its own call up to float rounding. transformers' own continuous batching
(`generate_batch`, `PagedAttentionCache`) takes token ids only and cannot continue chatkv's caches.

The step reaches the attention function two ways: as the model keyword argument `STEP_KWARG`, and
on the 4-D placeholder mask (`PackedBatch.placeholder_mask`), which transformers hands to every
layer as it is. The second serves models whose decoder layers do not forward keyword arguments
to their attention (StableLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from transformers import DynamicCache

from cache.working_cache import PreallocatedLayer

STEP_KWARG = "chatkv_step"
"""Keyword argument through which the model passes the step's `PackedBatch` to the attention."""

BLOCK_DIAGONAL_MAX_KEYS = 65536
"""The most keys (every request's, one model layer) a block-diagonal call gathers, else the layer
attends per request: the gathered copy and the `N x keys` scores grow with the keys while the
launches saved do not. A bound, not a measured crossover (the H200 run had 16 x 300 keys)."""


def band_mask(queries: int, keys: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """`[queries, keys]` bool mask of the last `queries` slots of `keys` (True: attended): causal,
    and within `window` slots of the query (its own included) when `window` is set. `None` when
    every key is visible (one query over at most `window` keys)."""
    if queries == 1 and (window is None or keys <= window):
        return None
    rows = torch.arange(keys - queries, keys, device=device)[:, None]
    cols = torch.arange(keys, device=device)[None, :]
    visible = cols <= rows
    if window is not None:
        visible &= rows - cols < window
    return visible


@dataclass(frozen=True)
class Segment:
    """One request's tokens in the packed row: `[start, start + length)`.

    `layers[l]` is the request's KV buffer of model layer `l` (its length and window differ per
    model layer; the attention masks per layer, `PackedBatch.mask`).
    """

    start: int
    length: int
    layers: Sequence[PreallocatedLayer]


@dataclass(frozen=True)
class PackedBatch:
    """The step's model input.

    Attributes:
        input_ids: `[1, T]` long.
        position_ids: `[1, T]` long, each request's own RoPE positions.
        segments: per request, in row order.
        logits_indices: `[R]` long: rows whose logits are needed (each sampling chunk's last token).
        observed: when not `None` (a probe), each model layer's attention arguments as the packed
            attention saw them, by layer index (`ModelRunner` checks them at load).
        block_diagonal: every segment is one token (a decode-only step) of several requests, and
            plain full-attention layers attend in one call over a block-diagonal mask (`pack`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: tuple[Segment, ...]
    logits_indices: torch.Tensor
    observed: dict[int, dict[str, Any]] | None = None
    block_diagonal: bool = False
    _masks: dict[tuple[int, int, int | None], torch.Tensor | None] = field(default_factory=dict, repr=False)
    _block_masks: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict, repr=False)

    @cached_property
    def lengths(self) -> list[int]:
        """Each segment's token count, in row order (the sizes to `split` the step's row by)."""
        return [segment.length for segment in self.segments]

    def mask(self, queries: int, keys: int, window: int | None) -> torch.Tensor | None:
        """The `[queries, keys]` bool mask of a chunk of `queries` tokens over its (sliced) buffer
        of `keys` slots in a model layer of sliding `window` (or full, `None`): `band_mask`,
        built once per step and shape."""
        key = (queries, keys, window)
        if key not in self._masks:
            self._masks[key] = band_mask(queries, keys, window, self.input_ids.device)
        return self._masks[key]

    def block_mask(self, lengths: tuple[int, ...]) -> torch.Tensor:
        """The `[N, sum(lengths)]` bool mask of a decode-only step's N queries over every request's
        keys concatenated in row order (request `i` holds `lengths[i]` of them): row `i` sees its
        own request's keys, all of them (a decode's query is its buffer's last slot). Built once
        per step and lengths; on CUDA from pinned memory without waiting for the device."""
        if lengths not in self._block_masks:
            device = self.input_ids.device
            mask = torch.zeros(len(lengths), sum(lengths), dtype=torch.bool, pin_memory=device.type == "cuda")
            start = 0
            for row, length in enumerate(lengths):
                mask[row, start : start + length] = True
                start += length
            self._block_masks[lengths] = mask.to(device, non_blocking=True)
        return self._block_masks[lengths]

    def observe(self, layer_idx: int, arguments: dict[str, Any]) -> None:
        if self.observed is not None:
            self.observed[layer_idx] = arguments

    def placeholder_mask(self) -> torch.Tensor:
        """A 4-D placeholder attention mask carrying this step: transformers returns a prepared
        4-D mask as it is, so passing it skips building a causal mask the packed attention would
        not use, and every layer receives it."""
        mask = torch.empty(1, 1, 0, 0, device=self.input_ids.device)
        setattr(mask, STEP_KWARG, self)
        return mask


def pack(
    chunks: Sequence[tuple[Sequence[PreallocatedLayer], Sequence[int], bool]],
    device: torch.device,
    *,
    probe: bool = False,
    block_diagonal: bool | None = None,
) -> PackedBatch:
    """Build the step's input from `(request KV layers, ids to feed, samples)` per request.
    `probe`: record each model layer's attention arguments (`PackedBatch.observed`).
    `block_diagonal`: allow one attention call per model layer when the step is decode-only with
    several requests (`PackedBatch.block_diagonal`); `None`: on a CUDA `device` only.

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
        first_position = layers[0].next_position  # the same in every model layer
        n = len(token_ids)
        segments.append(Segment(len(ids), n, layers))
        ids.extend(token_ids)
        positions.extend(range(first_position, first_position + n))
        if samples:
            sampled.append(len(ids) - 1)
    if block_diagonal is None:
        block_diagonal = device.type == "cuda"
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        segments=tuple(segments),
        logits_indices=torch.tensor(sampled, dtype=torch.long, device=device),
        observed={} if probe else None,
        block_diagonal=block_diagonal and len(segments) > 1 and len(ids) == len(segments),
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
        lengths = self.batch.lengths
        keys, values = key_states.split(lengths, dim=2), value_states.split(lengths, dim=2)
        for segment, segment_keys, segment_values in zip(self.batch.segments, keys, values, strict=True):
            segment.layers[layer_idx].append(segment_keys, segment_values)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0
