"""Eviction of cached tokens by importance, per KV head: the `attention` window policy.

Instead of demoting whole old turn layers (`cache.window_policy`), each KV head of each model layer
keeps the tokens its scores rank highest (`cache.attention_scores`, SnapKV's observation window:
Li et al., 2024; the heavy-hitter idea of H2O: Zhang et al., 2023). The base layer (system prompt
and pinned turns: StreamingLLM's attention sinks and more, Xiao et al., 2023) and the most recent
`recent_tokens` are never evicted.

Tensors stay rectangular: every head keeps the same number of tokens of each turn layer. That
count is chosen from the scores too: each head's top tokens over the whole evictable span are
counted per layer and the mean over heads and model layers becomes the layer's quota (largest
remainder, so the quotas sum to what must be kept); then each head keeps its own top tokens within
each layer's quota. So the layer table stays a list of contiguous runs (`LayerSpan.token_count`
held, `evicted_tokens` gone) while the sets held differ per head (`SessionCache.own_stream_index`).
Ada-KV (Feng et al., 2024) lets the count differ per head and PyramidKV (Cai et al., 2024) per
model layer; both need ragged tensors, so they are measured as masks over the full cache
(`cache.budget_allocation`, `benchmarks/window_quality.py`), not served.

    own slots, one head   | t0 (pinned) | t1 .......... | t2 .......... | t3 (recent) |
    evictable                           |<------------------------->|
    kept                  | t0          | t1: top k1    | t2: top k2    | t3          |

The `agnostic` policy evicts the same way by scores fixed when the earlier turns committed
(`committed_scores`, `stored_scores`; KVzip's question-agnostic scoring, Kim et al., NeurIPS 2025,
approximated from the conversation's own queries: `cache.attention_scores.QueryLog`).

Kept keys keep their RoPE positions (no re-rotation): they were rotated at the position they had
when computed, so each one's distance to a new query, whose position continues from
`SessionCache.next_position`, is the true distance in the conversation, exactly as when the keys
were computed; moving them closer would change the relative positions the model reads. This is
what SnapKV and H2O do. The price is that positions keep growing with the conversation while the
cache does not; when they would pass the model's position limit the turn rebuilds the window from
the transcript (`sessions.turn.window`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from cache.session_cache import LayerSpan, SessionCache, span_offsets, stream_index_of
from cache.working_cache import WorkingCache


def evictable_ranges(cache: SessionCache, recent_tokens: int) -> list[tuple[int, int, int]]:
    """`(layer position in cache.layers, first slot, end slot)` of the evictable own slots: unpinned
    turn layers, minus the last `recent_tokens` own tokens (per KV head)."""
    boundary = max(0, cache.own_tokens - recent_tokens)
    out = []
    for position, (span, held, _) in enumerate(span_offsets(cache.layers)):
        end = min(held + span.token_count, boundary)
        if not span.pinned and end > held:
            out.append((position, held, end))
    return out


def evictable_tokens(cache: SessionCache, recent_tokens: int) -> int:
    """How many own tokens per KV head may be evicted (see `evictable_ranges`)."""
    return sum(end - start for _, start, end in evictable_ranges(cache, recent_tokens))


def evict_by_scores(cache: SessionCache, scores: torch.Tensor, evict_tokens: int, recent_tokens: int) -> SessionCache:
    """Evict `evict_tokens` tokens from every KV head of every model layer, lowest scores first.

    Only full-attention model layers evict (`SessionCache.full_layers`); a sliding-window layer's
    tail is its window and stays whole.

    Args:
        cache: own tensors `[1, kv_heads, own_tokens, head_dim]` per model layer.
        scores: `[full_model_layers, kv_heads, cache.total_tokens]` float importance of every cached
            token (base first) in each full-attention layer, e.g. `ObservationWindow.scores`.
        evict_tokens: tokens to drop per head, `0 <= evict_tokens <= evictable_tokens(...)`.
        recent_tokens: most recent own tokens never evicted.

    Returns:
        A new cache (`cache` is not modified) with `own_tokens - evict_tokens` tokens per head, the
        layer table's `token_count` / `evicted_tokens` updated and `own_stream_index` recording
        which token each head holds.

    Raises:
        ValueError: if `evict_tokens` is negative or more than may be evicted, or `scores` has
            another shape.
    """
    ranges = evictable_ranges(cache, recent_tokens)
    evictable = sum(end - start for _, start, end in ranges)
    if not 0 <= evict_tokens <= evictable:
        raise ValueError(f"cannot evict {evict_tokens} tokens per head, {evictable} are evictable")
    layers_n = len(cache.full_layers)
    kv_heads = cache.own_keys[0].shape[1] if cache.own_keys else 0
    expected = (layers_n, kv_heads, cache.total_tokens)
    if tuple(scores.shape) != expected:
        raise ValueError(f"scores have shape {tuple(scores.shape)}, expected {expected}")
    if evict_tokens == 0:
        return cache
    slots, quotas = _kept(cache, scores, ranges, evictable - evict_tokens)
    return _gather(cache, slots, ranges, quotas)


def kept_slots(cache: SessionCache, scores: torch.Tensor, evict_tokens: int, recent_tokens: int) -> torch.Tensor:
    """`[full_model_layers, kv_heads, own_tokens - evict_tokens]` int64: the own slots each KV head of
    each full model layer keeps under `evict_by_scores` (same arguments, same checks), ascending;
    for callers that mask instead of gathering (`cache.budget_allocation`)."""
    ranges = evictable_ranges(cache, recent_tokens)
    evictable = sum(end - start for _, start, end in ranges)
    if not 0 <= evict_tokens <= evictable:
        raise ValueError(f"cannot evict {evict_tokens} tokens per head, {evictable} are evictable")
    return _kept(cache, scores, ranges, evictable - evict_tokens)[0]


def _kept(
    cache: SessionCache, scores: torch.Tensor, ranges: list[tuple[int, int, int]], keep: int
) -> tuple[torch.Tensor, list[int]]:
    own = scores[:, :, cache.base_tokens :].float()  # [L, kv, own]
    quotas = _quotas(own, ranges, keep)
    return _kept_slots(cache, own, ranges, quotas), quotas  # [L, kv, kept]


def _quotas(own: torch.Tensor, ranges: list[tuple[int, int, int]], keep: int) -> list[int]:
    """Tokens kept per evictable range: the mean over heads of how many of each head's top `keep`
    fall in it, rounded by largest remainder so they sum to `keep`."""
    index = torch.cat([torch.arange(start, end) for _, start, end in ranges])
    candidates = own[:, :, index]  # [L, kv, evictable]
    member = torch.zeros_like(candidates, dtype=torch.bool)
    if keep:
        member.scatter_(-1, candidates.topk(keep, dim=-1).indices, True)
    counts, offset = [], 0
    for _, start, end in ranges:
        counts.append(float(member[:, :, offset : offset + end - start].float().sum(dim=-1).mean()))
        offset += end - start
    total = sum(counts)
    share = [c * keep / total if total else 0.0 for c in counts]
    quotas = [int(s) for s in share]
    by_remainder = sorted(range(len(share)), key=lambda i: share[i] - quotas[i], reverse=True)
    for i in by_remainder[: keep - sum(quotas)]:
        quotas[i] += 1
    return quotas


def _kept_slots(
    cache: SessionCache, own: torch.Tensor, ranges: list[tuple[int, int, int]], quotas: list[int]
) -> torch.Tensor:
    """`[L, kv, kept]` own slot index each head keeps, ascending."""
    layers_n, kv_heads = own.shape[0], own.shape[1]
    pieces, cursor = [], 0
    for (_, start, end), quota in zip(ranges, quotas, strict=True):
        if start > cursor:  # a non-evictable run: kept whole
            pieces.append(torch.arange(cursor, start).expand(layers_n, kv_heads, -1))
        top = own[:, :, start:end].topk(quota, dim=-1).indices.sort(dim=-1).values + start
        pieces.append(top)
        cursor = end
    if cursor < cache.own_tokens:
        pieces.append(torch.arange(cursor, cache.own_tokens).expand(layers_n, kv_heads, -1))
    return torch.cat(pieces, dim=-1)


def _tail_stream_index(cache: SessionCache, held: int) -> torch.Tensor:
    """`[held]` stream index of a model layer's own slots before any eviction: every held token of
    a full layer, the last `held` of a sliding layer's tail."""
    return stream_index_of(cache.layers)[-held:] if held else torch.zeros(0, dtype=torch.long)


def _gather(
    cache: SessionCache, slots: torch.Tensor, ranges: list[tuple[int, int, int]], quotas: list[int]
) -> SessionCache:
    old_index = cache.own_stream_index
    if old_index is None:
        old_index = tuple(_tail_stream_index(cache, k.shape[-2]).expand(k.shape[1], -1) for k in cache.own_keys)
    keys, values, stream_index = list(cache.own_keys), list(cache.own_values), list(old_index)
    for row, layer in enumerate(cache.full_layers):
        k, v = cache.own_keys[layer], cache.own_values[layer]
        index = slots[row].to(k.device)  # [kv, kept]
        expanded = index[None, :, :, None].expand(1, k.shape[1], index.shape[1], k.shape[3])
        keys[layer] = torch.gather(k, 2, expanded)
        values[layer] = torch.gather(v, 2, expanded)
        stream_index[layer] = torch.gather(old_index[layer], 1, slots[row])
    spans: list[LayerSpan] = list(cache.layers)
    for (position, start, end), quota in zip(ranges, quotas, strict=True):
        dropped = end - start - quota
        span = spans[position]
        spans[position] = replace(
            span, token_count=span.token_count - dropped, evicted_tokens=span.evicted_tokens + dropped
        )
    scores = None
    if cache.own_scores is not None:
        scores = tuple(torch.gather(s, 1, slots[row]) for row, s in enumerate(cache.own_scores))
    return replace(
        cache,
        own_keys=tuple(keys),
        own_values=tuple(values),
        layers=tuple(spans),
        own_stream_index=tuple(stream_index),
        own_scores=scores,
    )


def carry_prefill(evicted: SessionCache, working: WorkingCache, carried_tokens: int, extra_tokens: int) -> WorkingCache:
    """The working cache of `evicted` continued by the last `carried_tokens` slots of `working`.

    One prefill per evicting turn (SnapKV, Li et al., 2024): the turn's ids were prefilled on the
    full cache (`working`, built from the cache before eviction), so their KV saw every cached
    token; after eviction the same KV follows the kept tokens. Each model layer's new buffer is
    `evicted`'s working layer (base part, kept own slots; a sliding layer's tail unchanged) plus
    those slots, so its positions continue from `evicted.next_position + carried_tokens`.

    Args:
        evicted: the cache after `evict_by_scores` on the cache `working` was built from.
        working: that cache's working buffer after the prefill of `carried_tokens` ids.
        carried_tokens: ids prefilled on `working`, copied over.
        extra_tokens: room to leave after them (the rest of the prefill and the reply).

    Raises:
        ValueError: if `working` holds fewer than `carried_tokens` slots in some model layer.
    """
    out = evicted.to_working_cache(carried_tokens + extra_tokens)
    for index, (old, new) in enumerate(zip(working.prealloc_layers, out.prealloc_layers, strict=True)):
        if old.get_seq_length() < carried_tokens:
            raise ValueError(f"model layer {index} holds {old.get_seq_length()} slots, fewer than {carried_tokens}")
        if carried_tokens:
            new.update(old.filled_keys[:, :, -carried_tokens:], old.filled_values[:, :, -carried_tokens:])
    return out


def stored_scores(cache: SessionCache) -> torch.Tensor:
    """`[full_model_layers, kv_heads, cache.total_tokens]` float32 importance for `evict_by_scores`
    under the `agnostic` policy, fixed before the next question is known: the scores accumulated
    when the turns committed (`SessionCache.own_scores`), or, for a cache without them (restored
    from a blob, rebuilt, forked), each token's stream index, so the newest are kept (the recency
    of StreamingLLM, Xiao et al., 2023) until the next turns score them. The base part is zero (the
    base is never evicted)."""
    rows = []
    for row, layer in enumerate(cache.full_layers):
        kv_heads = cache.own_keys[layer].shape[1]
        if cache.own_scores is not None:
            own = cache.own_scores[row].float()
        elif cache.own_stream_index is not None:
            own = cache.own_stream_index[layer].float()
        else:
            own = stream_index_of(cache.layers).float().expand(kv_heads, -1)
        rows.append(torch.cat([torch.zeros(kv_heads, cache.base_tokens), own.cpu()], dim=1))
    return torch.stack(rows)


def committed_scores(
    before: SessionCache, after: SessionCache, fresh: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """`after.own_scores` once a turn turned `before` into `after`: per full layer, the most attention
    each held own token got from the turn's scoring queries (`fresh[row]`, `[kv_heads, buffer
    slots]`, the own tokens last: the turn's own queries, `QueryLog.turn_scores`, or, measured in
    `benchmarks/window_quality.py`, the reconstruction of the turn's ids, `ReconstructionScores`),
    and, for `before`'s own tokens (the first ones of `after`), the larger of that and their scores
    from earlier turns (KVzip's max over every query, taken one committed turn at a time).

    Raises:
        ValueError: if a `fresh` row is shorter than the layer's held own tokens.
    """
    out = []
    for row, layer in enumerate(after.full_layers):
        held = after.own_keys[layer].shape[-2]
        if fresh[row].shape[1] < held:
            raise ValueError(f"fresh scores cover {fresh[row].shape[1]} slots, the layer holds {held} own tokens")
        new = fresh[row][:, fresh[row].shape[1] - held :].clone()
        if before.own_scores is not None:
            old = before.own_scores[row]
            new[:, : old.shape[1]] = torch.maximum(new[:, : old.shape[1]], old)
        out.append(new)
    return tuple(out)
