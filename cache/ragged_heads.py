"""Ragged model layers (per-head budgets): a full-attention layer whose KV heads hold different
numbers of tokens, stored head after head in one `[1, 1, n_0 + ... + n_{h-1}, head_dim]` tensor
(`SessionCache.own_head_tokens`), and the turn's working buffer built from it, rectangular with a
hole after each head's slots (see `cache.session_cache`'s module docstring).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cache.working_cache import PreallocatedLayer


def working_layer(
    own_keys: torch.Tensor,
    own_values: torch.Tensor,
    counts: Sequence[int],
    base: tuple[torch.Tensor, torch.Tensor] | None,
    next_position: int,
    extra_tokens: int,
) -> PreallocatedLayer:
    """The working layer of a ragged model layer: `base` (its keys and values `[1, kv_heads, b,
    head_dim]`, or `None`), then each head's own slots (`own_keys`/`own_values`, `[1, 1, sum(counts),
    head_dim]`) followed by its hole up to the longest head (`PreallocatedLayer.head_valid` masks it),
    with room for `extra_tokens`; the next token is at RoPE position `next_position`."""
    base_tokens = base[0].shape[-2] if base is not None else 0
    longest = max(counts)
    shape = (1, len(counts), base_tokens + longest + max(extra_tokens, 1), own_keys.shape[-1])
    # Zeros, not uninitialised memory: a masked hole's NaN or inf would still poison SDPA's output.
    key_buffer, value_buffer = own_keys.new_zeros(shape), own_values.new_zeros(shape)
    if base is not None:
        key_buffer[:, :, :base_tokens].copy_(base[0])
        value_buffer[:, :, :base_tokens].copy_(base[1])
    valid = torch.ones(len(counts), base_tokens + longest, dtype=torch.bool, device=own_keys.device)
    start = 0
    for head, count in enumerate(counts):
        key_buffer[0, head, base_tokens : base_tokens + count].copy_(own_keys[0, 0, start : start + count])
        value_buffer[0, head, base_tokens : base_tokens + count].copy_(own_values[0, 0, start : start + count])
        valid[head, base_tokens + count :] = False
        start += count
    layer = PreallocatedLayer(key_buffer, value_buffer, base_tokens + longest, next_position - (base_tokens + longest))
    layer.head_valid = valid
    return layer


def gather_heads(buffer: torch.Tensor, slots: Sequence[torch.Tensor]) -> torch.Tensor:
    """`buffer [1, kv_heads, T, d]`, per head the slots to take -> `[1, 1, sum, d]` (a copy), head by head."""
    parts = [buffer[0, head, index.to(buffer.device)] for head, index in enumerate(slots)]
    return torch.cat(parts)[None, None]


def split_heads(flat: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    """A ragged layer's `[..., n_0 + ... + n_{h-1}, ...]` tensor (slots on dim -2 for KV, -1 for
    `[1, N]` indices and scores) split per head: views, in head order."""
    dim = -2 if flat.dim() == 4 else -1
    return list(flat.split(list(counts), dim=dim))


def append_per_head(index: torch.Tensor, new: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """A ragged layer's stream index `[1, N]` with `new [a]` appended to every head's slots."""
    return torch.cat([torch.cat([part, new[None]], dim=-1) for part in split_heads(index, counts)], dim=-1)
