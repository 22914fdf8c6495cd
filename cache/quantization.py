"""int8 and int4 quantisation of cached keys and values, for turn layers held in lower tiers.

- int8: symmetric, per token, in groups of `GROUP` channels: `code = round(x / scale)`,
  `scale = max|x| / 127` over the group.
- int4: KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", 2024):
  keys per channel, in groups of `GROUP` tokens, because key outliers sit in fixed channels; values
  per token, in groups of `GROUP` channels. Asymmetric min/max with a zero point; two codes a byte.
  The caller keeps the most recent tokens in full precision (KIVI's residual window) and quantises
  keys in whole token groups only (`int4_token_multiple`), so no group is padded.

Channel groups are `GROUP` channels when `head_dim` is a multiple of it, else the whole head.

Scales and zero points are stored as float16 when they fit (else float32), rounded before the
codes are computed so codes and scales agree exactly: at int4 a float32 scale and zero per 32
codes would cost half a byte per code again. All tensors are `[batch, kv_heads, seq, head_dim]`;
`seq` may be any length (a last partial group is fine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32


@dataclass(frozen=True)
class Quantized:
    """Codes plus what is needed to decode them. `codes`: uint8 (int4: two codes a byte, along
    the last axis); `scale`, `zero`: float16 (float32 if out of range), broadcastable per group."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    shape: tuple[int, ...]
    scheme: str

    @property
    def nbytes(self) -> int:
        tensors = [self.codes, self.scale] + ([self.zero] if self.zero is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def int4_token_multiple() -> int:
    """int4 keys are quantised in groups of this many tokens; a shorter tail stays exact."""
    return GROUP


def _channel_group(head_dim: int) -> int:
    return GROUP if head_dim % GROUP == 0 else head_dim


def _compact(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to float16 if every value fits comfortably, else float32 as it is."""
    return t.to(torch.float16) if bool(t.abs().max() < 6.0e4) else t


def _pad_tokens(x: torch.Tensor) -> torch.Tensor:
    """Pad the token axis (-2) to a whole number of `GROUP`s (only for callers that do not keep
    the tail exact; the serializer never needs it)."""
    pad = (-x.shape[-2]) % GROUP
    return torch.nn.functional.pad(x, [0, 0, 0, pad]) if pad else x


def quantize_int8(x: torch.Tensor) -> Quantized:
    """Symmetric int8 per token, groups of `GROUP` channels along `head_dim`."""
    group = _channel_group(x.shape[-1])
    grouped = x.to(torch.float32).unflatten(-1, (-1, group))  # [b, h, seq, groups, group]
    scale = _compact((grouped.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(1e-6))
    codes = torch.round(grouped / scale.float()).clamp(-127, 127).to(torch.int8)
    return Quantized(codes.view(torch.uint8), scale, None, tuple(x.shape), "int8")


def dequantize_int8(q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    values = q.codes.view(torch.int8).to(torch.float32) * q.scale.float()
    return values.flatten(-2)[..., : q.shape[-1]].to(dtype)


def _asymmetric_int4(grouped: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    low = grouped.amin(dim=dim, keepdim=True)
    high = grouped.amax(dim=dim, keepdim=True)
    low = _compact(low)
    scale = _compact(((high - low.float()) / 15.0).clamp_min(1e-6))
    codes = torch.round((grouped - low.float()) / scale.float()).clamp(0, 15).to(torch.uint8)
    return codes, scale, low


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    flat = codes.reshape(*codes.shape[:-1], -1, 2)
    return flat[..., 0] | (flat[..., 1] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def quantize_int4_keys(keys: torch.Tensor) -> Quantized:
    """KIVI keys: per channel, min/max over groups of `GROUP` tokens."""
    grouped = _pad_tokens(keys.to(torch.float32)).unflatten(-2, (-1, GROUP))  # [b, h, token_groups, GROUP, head_dim]
    codes, scale, zero = _asymmetric_int4(grouped, dim=-2)
    return Quantized(_pack_nibbles(codes), scale, zero, tuple(keys.shape), "int4_channel")


def quantize_int4_values(values: torch.Tensor) -> Quantized:
    """KIVI values: per token, min/max over groups of `GROUP` channels."""
    group = _channel_group(values.shape[-1])
    grouped = values.to(torch.float32).unflatten(-1, (-1, group))  # [b, h, seq, channel_groups, group]
    codes, scale, zero = _asymmetric_int4(grouped, dim=-1)
    return Quantized(_pack_nibbles(codes), scale, zero, tuple(values.shape), "int4_token")


def dequantize_int4(q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    if q.zero is None:
        raise ValueError("int4 codes need a zero point")
    codes = _unpack_nibbles(q.codes).to(torch.float32)
    values = codes * q.scale.float() + q.zero.float()
    seq, head_dim = q.shape[-2], q.shape[-1]
    if q.scheme == "int4_channel":
        return values.flatten(-3, -2)[..., :seq, :].to(dtype)
    return values.flatten(-2)[..., :head_dim].to(dtype)


def quantize(x: torch.Tensor, precision: str, is_key: bool) -> Quantized:
    """Quantise keys or values at `int8` or `int4`. Raises `ValueError` for another precision."""
    if precision == "int8":
        return quantize_int8(x)
    if precision == "int4":
        return quantize_int4_keys(x) if is_key else quantize_int4_values(x)
    raise ValueError(f"unknown precision {precision!r}; expected 'int8' or 'int4'")


def dequantize(q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_int8(q, dtype) if q.scheme == "int8" else dequantize_int4(q, dtype)
