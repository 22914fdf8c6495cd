"""Re-rotation of cached keys to new RoPE positions.

Rotary position embedding (Su et al., "RoFormer", 2021) rotates each pair of key channels by
`position * inv_freq`. Rotations compose, so a key cached at position `p` is moved to `p - shift`
by rotating it by `-shift * inv_freq`, without the model (the "shift" trick StreamingLLM relies on
when it evicts tokens: Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
2023). That holds when `inv_freq` does not depend on the sequence length and cos/sin carry no
extra scaling: the `default`, `linear` and `llama3` RoPE variants. Others (`dynamic`, `yarn`,
`longrope`, ...) must be re-prefilled instead; `rotation_supported` says which.

Channel layout follows `transformers`' `rotate_half` convention: the first and second halves of
`head_dim` form the pairs, `cos`/`sin` are `cat(freqs, freqs)`.
"""

from __future__ import annotations

import torch

COMPOSABLE_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


def rotation_supported(rope_type: str | None, attention_scaling: float = 1.0) -> bool:
    """Whether cached keys of this RoPE variant can be moved by rotation alone."""
    return rope_type in COMPOSABLE_ROPE_TYPES and attention_scaling == 1.0


def rotate_keys(keys: torch.Tensor, shift: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys cached at positions `p` as they would be at `p - shift`.

    Args:
        keys: `[batch, kv_heads, seq, head_dim]`, any float dtype; not modified.
        shift: positions to move back (positive moves towards 0).
        inv_freq: `[head_dim // 2]` RoPE inverse frequencies of the model.

    Returns:
        A new tensor of the same shape and dtype. The rotation is computed in float64 angles and
        float32 arithmetic, so the error against keys computed at the new positions is float32
        rounding.
    """
    if shift == 0:
        return keys
    if inv_freq.shape[-1] * 2 != keys.shape[-1]:
        raise ValueError(f"inv_freq has {inv_freq.shape[-1]} frequencies, head_dim is {keys.shape[-1]}")
    angles = -float(shift) * inv_freq.to(device=keys.device, dtype=torch.float64)
    cos = torch.cat([angles.cos(), angles.cos()]).to(torch.float32)
    sin = torch.cat([angles.sin(), angles.sin()]).to(torch.float32)
    work = keys.to(torch.float32)
    half = work.shape[-1] // 2
    rotated_half = torch.cat([-work[..., half:], work[..., :half]], dim=-1)
    return (work * cos + rotated_half * sin).to(keys.dtype)
