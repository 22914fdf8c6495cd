"""How an eviction's kept tokens are allocated across KV heads and model layers, as masks over the
unevicted cache, for `benchmarks/window_quality.py` (kept keys keep their RoPE positions under every
policy, so masking a slot out of attention equals evicting it).

- `uniform` and `per_head` are served (`cache.token_eviction.evict_by_scores`): every head of
  every layer keeps the same count of each turn layer, or (Ada-KV: Feng et al., "Ada-KV:
  Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference", 2024)
  a layer's heads share its total by score, stored ragged. Their masks are read back from the
  served eviction.
- `per_layer` (PyramidKV: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
  Information Funneling", 2024) is measured only (it lost to uniform in every run): lower model
  layers, whose attention is spread, keep more; higher ones, whose attention funnels onto few
  tokens, keep fewer; an arithmetic sequence from `2 * keep - keep / beta` down to `keep / beta`
  (beta = 20, PyramidKV's), summing to `full_layers * keep`; within a layer every head keeps its
  own top tokens.

The base layer, pinned turns and the recent window are kept by every allocation; only the evictable
slots (`cache.token_eviction.evictable_ranges`) are allocated, with the same total in every
allocation (the same bytes).

    one full model layer, own slots   | pinned | evictable ..................... | recent |
    uniform     head 0 / head 1       | all    | keep / keep                     | all    |
    per_head    head 0 / head 1       | all    | b0 / b1, b0 + b1 = 2 keep        | all    |
    per_layer   layer l               | all    | k_l per head, sum_l k_l = L keep | all    |
"""

from __future__ import annotations

import torch

from cache.session_cache import SessionCache
from cache.token_eviction import evict_by_scores, evictable_ranges, kept_slots

ALLOCATIONS = ("uniform", "per_head", "per_layer")
PYRAMID_BETA = 20.0
"""PyramidKV's beta: the top model layer keeps `keep / beta` tokens per head."""


def kept_own_mask(
    cache: SessionCache, scores: torch.Tensor, evict_tokens: int, recent_tokens: int, allocation: str
) -> torch.Tensor:
    """`[full_model_layers, kv_heads, own_tokens]` bool: True where a head keeps an own slot.

    Every allocation keeps all non-evictable own slots (pinned turns, the `recent_tokens` most
    recent) and `full_model_layers * kv_heads * (evictable - evict_tokens)` evictable ones in all;
    `uniform` keeps exactly the slots `cache.token_eviction.evict_by_scores` keeps.

    Args:
        cache: own tensors `[1, kv_heads, own_tokens, head_dim]` per model layer.
        scores: `[full_model_layers, kv_heads, cache.total_tokens]` float importance (base first),
            as for `evict_by_scores`.
        evict_tokens: tokens to drop per head on average, `0 <= evict_tokens <= evictable`.
        recent_tokens: most recent own tokens never evicted.
        allocation: `uniform`, `per_head` (Ada-KV) or `per_layer` (PyramidKV).

    Raises:
        ValueError: for an unknown `allocation`, a bad `evict_tokens` or `scores` of another shape.
    """
    if allocation not in ALLOCATIONS:
        raise ValueError(f"budget allocation must be one of {', '.join(ALLOCATIONS)}, got {allocation!r}")
    layers_n = len(cache.full_layers)
    kv_heads = cache.own_keys[0].shape[1] if cache.own_keys else 0
    if tuple(scores.shape) != (layers_n, kv_heads, cache.total_tokens):
        raise ValueError(
            f"scores have shape {tuple(scores.shape)}, expected {(layers_n, kv_heads, cache.total_tokens)}"
        )
    mask = torch.zeros(layers_n, kv_heads, cache.own_tokens, dtype=torch.bool)
    if allocation == "uniform":
        return mask.scatter_(-1, kept_slots(cache, scores, evict_tokens, recent_tokens), True)
    ranges = evictable_ranges(cache, recent_tokens)
    index = torch.cat([torch.arange(start, end) for _, start, end in ranges]) if ranges else torch.zeros(0).long()
    if not 0 <= evict_tokens <= index.numel():
        raise ValueError(f"cannot evict {evict_tokens} tokens per head, {index.numel()} are evictable")
    mask[:, :, :] = True
    mask[:, :, index] = False
    candidates = scores[:, :, cache.base_tokens :].float()[:, :, index]  # [L, kv, evictable]
    keep = index.numel() - evict_tokens
    if allocation == "per_head":  # the served eviction, read back as a mask
        evicted = evict_by_scores(cache, scores, evict_tokens, recent_tokens, "per_head")
        mask[:, :, :] = False
        for row, layer in enumerate(cache.full_layers):
            held = cache.head_stream_index(layer)
            for head, kept in enumerate(evicted.head_stream_index(layer)):
                mask[row, head, torch.searchsorted(held[head], kept)] = True
        return mask
    for row in range(layers_n):
        count = layer_budgets(layers_n, keep, index.numel())[row]
        chosen = torch.zeros_like(candidates[row], dtype=torch.bool)
        chosen.scatter_(-1, candidates[row].topk(count, dim=-1).indices, True)
        mask[row][:, index] = chosen
    return mask


def layer_budgets(layers: int, keep: int, cap: int, beta: float = PYRAMID_BETA) -> list[int]:
    """PyramidKV's per-layer counts: `layers` full model layers (lowest first) whose heads keep
    `keep` tokens each on average -> tokens per head of each layer, non-increasing with depth,
    each at most `cap` (the evictable tokens), summing to `layers * keep` exactly (largest
    remainder; a layer over `cap` gives the excess to the layers above it).

    Raises:
        ValueError: if `keep` is outside `[0, cap]` or `beta < 1`.
    """
    if not 0 <= keep <= cap or beta < 1:
        raise ValueError(f"cannot keep {keep} of {cap} tokens per head with beta {beta}")
    if layers <= 1:
        return [keep] * layers
    low, high = keep / beta, 2 * keep - keep / beta
    shares = [high - (high - low) * row / (layers - 1) for row in range(layers)]
    return _apportion(shares, layers * keep, cap)


def _apportion(shares: list[float], total: int, cap: int) -> list[int]:
    """Integers proportional to `shares`, each at most `cap`, summing to `total <= len * cap`."""
    counts = [0] * len(shares)
    free = list(range(len(shares)))
    remaining = total
    while True:
        mass = sum(shares[i] for i in free)
        target = {i: (shares[i] / mass if mass else 1 / len(free)) * remaining for i in free}
        over = [i for i in free if target[i] > cap]
        if not over:
            break
        for i in over:
            counts[i], remaining = cap, remaining - cap
            free.remove(i)
    for i in free:
        counts[i] = int(target[i])
    by_remainder = sorted(free, key=lambda i: (target[i] - counts[i], -i), reverse=True)
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts
