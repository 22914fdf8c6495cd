"""Small builders for cache-level tests (no model, no I/O)."""

from __future__ import annotations

import torch

from cache.ids import PrefixKey
from cache.layer_table import LayerKind, LayerSpan
from cache.rope import RopeLayout
from cache.session_cache import BaseLayer, SessionCache

LAYERS, HEADS, HEAD_DIM = 2, 2, 16
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
LAYOUT = RopeLayout(INV_FREQ, HEAD_DIM)


def make_base(tokens: int, seed: int = 0) -> BaseLayer:
    generator = torch.Generator().manual_seed(seed)
    keys = tuple(torch.randn(1, HEADS, tokens, HEAD_DIM, generator=generator) for _ in range(LAYERS))
    values = tuple(torch.randn(1, HEADS, tokens, HEAD_DIM, generator=generator) for _ in range(LAYERS))
    return BaseLayer(PrefixKey(f"base{seed}"), tuple(range(1000, 1000 + tokens)), keys, values)


def make_cache(
    turn_tokens: list[int],
    base_tokens: int = 4,
    pinned: frozenset[int] = frozenset(),
    seed: int = 1,
    dtype: torch.dtype = torch.float32,
) -> SessionCache:
    """A cache with a base of `base_tokens` and one turn layer per entry of `turn_tokens`."""
    base = make_base(base_tokens) if base_tokens else None
    own = sum(turn_tokens)
    generator = torch.Generator().manual_seed(seed)
    keys = tuple(torch.randn(1, HEADS, own, HEAD_DIM, generator=generator).to(dtype) for _ in range(LAYERS))
    values = tuple(torch.randn(1, HEADS, own, HEAD_DIM, generator=generator).to(dtype) for _ in range(LAYERS))
    spans, position = [], base_tokens
    for index, count in enumerate(turn_tokens):
        kind = LayerKind.BASE if index in pinned else LayerKind.TURN
        spans.append(LayerSpan(kind, index, count, position, position))
        position += count
    return SessionCache(
        base_key=base.key if base else None,
        base_token_ids=base.token_ids if base else (),
        own_keys=keys,
        own_values=values,
        own_token_ids=tuple(range(own)),
        layers=tuple(spans),
        base=base,
    )
