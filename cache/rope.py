"""Re-rotation of cached keys to new RoPE positions.

Rotary position embedding (Su et al., "RoFormer", 2021) rotates pairs of key channels by
`position * inv_freq`. Rotations compose, so a key cached at position `p` is moved to `p - shift`
by rotating it by `-shift * inv_freq`, without the model (the "shift" trick StreamingLLM relies on
when it evicts tokens: Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
2023). That holds when `inv_freq` does not depend on the sequence length and cos/sin carry no
extra scaling: the `default`, `linear` and `llama3` RoPE variants. Others (`dynamic`, `yarn`,
`longrope`, ...) must be re-prefilled instead; `rotation_supported` says which.

Models differ in which channels rotate and how they pair (`RopeLayout`), and a wrong guess
corrupts the keys silently, so `rope_layout` only describes model families whose attention code
was read (`transformers` 5.24) and is tested against the model's own keys; any other model gets
`None` and its window re-prefills, which is exact.

    head channels        0 ........................ rotary_dim ........ head_dim
    half (rotate_half)   pairs (i, i + rotary_dim/2)  | not rotated (partial rotary)
    interleaved          pairs (2i, 2i + 1)           | not rotated
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

COMPOSABLE_ROPE_TYPES = frozenset({"default", "linear", "llama3"})

# Attention classes whose forward rotates the first `rotary_dim` channels of every layer's keys
# with the model's one rotary embedding and caches the result as is, with the pairing that class's
# `apply_rotary_pos_emb` uses (True: interleaved). Read from the installed source; families not
# listed (per-layer-type frequencies as in Gemma 3, layers without RoPE as in SmolLM3 and Cohere 2,
# the rotated part stored last as in DeepSeek-V3, M-RoPE, remote code) re-prefill.
_ATTENTION_PAIRING: dict[str, bool] = {
    "transformers.models.llama.modeling_llama.LlamaAttention": False,
    "transformers.models.mistral.modeling_mistral.MistralAttention": False,
    "transformers.models.qwen2.modeling_qwen2.Qwen2Attention": False,
    "transformers.models.qwen3.modeling_qwen3.Qwen3Attention": False,
    "transformers.models.phi.modeling_phi.PhiAttention": False,
    "transformers.models.phi3.modeling_phi3.Phi3Attention": False,
    "transformers.models.stablelm.modeling_stablelm.StableLmAttention": False,
    "transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXAttention": False,
    # GLM: `cos[..., :rotary_dim // 2].repeat_interleave(2)` with a `0::2` / `1::2` rotate_half.
    "transformers.models.glm.modeling_glm.GlmAttention": True,
    # Cohere / Command-R: `repeat_interleave(freqs, 2)` with a `::2` / `1::2` rotate_half.
    "transformers.models.cohere.modeling_cohere.CohereAttention": True,
}


@dataclass(frozen=True, eq=False)
class RopeLayout:
    """How a model's RoPE rotates each cached key head.

    Attributes:
        inv_freq: `[rotary_dim // 2]` float RoPE inverse frequencies; pair `i` turns by
            `position * inv_freq[i]`.
        head_dim: channels per key head. Channels `rotary_dim..head_dim` carry no position
            (partial rotary: Phi-3 variants, StableLM, GPT-NeoX, GLM) and are never rotated.
        interleaved: pairs are channels `(2i, 2i + 1)` (GPT-J style: Cohere, GLM); otherwise
            `(i, i + rotary_dim // 2)` (`transformers`' `rotate_half`: Llama, GPT-NeoX).

    Raises:
        ValueError: if `inv_freq` is not a non-empty 1-D float tensor or `rotary_dim > head_dim`.
    """

    inv_freq: torch.Tensor
    head_dim: int
    interleaved: bool = False

    def __post_init__(self) -> None:
        if self.inv_freq.dim() != 1 or self.inv_freq.numel() == 0 or not self.inv_freq.is_floating_point():
            raise ValueError(
                f"inv_freq must be a non-empty 1-D float tensor, got shape {tuple(self.inv_freq.shape)} "
                f"of {self.inv_freq.dtype}"
            )
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"inv_freq has {self.inv_freq.shape[0]} frequencies, head_dim is {self.head_dim}")

    @property
    def rotary_dim(self) -> int:
        """Channels that rotate, at the start of each head."""
        return 2 * self.inv_freq.shape[0]


def rotation_supported(rope_type: str | None, attention_scaling: float = 1.0) -> bool:
    """Whether cached keys of this RoPE variant can be moved by rotation alone."""
    return rope_type in COMPOSABLE_ROPE_TYPES and attention_scaling == 1.0


def rope_layout(model: Any) -> RopeLayout | None:
    """The RoPE layout of a loaded `transformers` causal LM, or `None` when its cached keys must be
    re-prefilled instead of re-rotated.

    `None` unless: every attention module is of a class in `_ATTENTION_PAIRING`, the model has
    exactly one rotary embedding (one `inv_freq` buffer), its variant composes
    (`rotation_supported`), and `2 * len(inv_freq)` equals `int(head_dim * partial_rotary_factor)`
    from the config (the channel count the attention code splits off).
    """
    attention = {_qualified_name(type(m)) for m in model.modules() if type(m).__name__.endswith("Attention")}
    if len(attention) != 1 or (name := attention.pop()) not in _ATTENTION_PAIRING:
        return None
    rotaries = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if len(rotaries) != 1:
        return None
    config = model.config.get_text_config(decoder=True)
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):  # per-layer-type parameters, or none
        return None
    scaling = float(getattr(rotaries[0], "attention_scaling", 1.0))
    if not rotation_supported(params.get("rope_type", "default"), scaling):
        return None
    inv_freq = rotaries[0].inv_freq.detach().to(torch.float32).clone()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if 2 * inv_freq.shape[0] != int(head_dim * float(params.get("partial_rotary_factor", 1.0))):
        return None
    return RopeLayout(inv_freq=inv_freq, head_dim=head_dim, interleaved=_ATTENTION_PAIRING[name])


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def rotate_keys(keys: torch.Tensor, shift: int, layout: RopeLayout) -> torch.Tensor:
    """Keys cached at positions `p` as they would be at `p - shift`.

    Args:
        keys: `[batch, kv_heads, seq, head_dim]`, any float dtype; not modified.
        shift: positions to move back (positive moves towards 0).
        layout: the model's RoPE layout; only its `rotary_dim` leading channels change.

    Returns:
        A new tensor of the same shape and dtype (`keys` itself when `shift == 0`). The rotation
        is computed in float64 angles and float32 arithmetic, so the error against keys computed
        at the new positions is float32 rounding.

    Raises:
        ValueError: if the last dimension of `keys` is not `layout.head_dim`.
    """
    if shift == 0:
        return keys
    if keys.shape[-1] != layout.head_dim:
        raise ValueError(f"keys have {keys.shape[-1]} channels per head, the RoPE layout {layout.head_dim}")
    angles = -float(shift) * layout.inv_freq.to(device=keys.device, dtype=torch.float64)
    cos, sin = angles.cos().to(torch.float32), angles.sin().to(torch.float32)
    rotary = keys[..., : layout.rotary_dim].to(torch.float32)
    if layout.interleaved:
        x1, x2 = rotary[..., 0::2], rotary[..., 1::2]
        turned = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        x1, x2 = rotary.chunk(2, dim=-1)
        turned = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([turned.to(keys.dtype), keys[..., layout.rotary_dim :]], dim=-1)
