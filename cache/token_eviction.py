"""Eviction of cached tokens by importance, per KV head: the `attention` window policy.

Instead of demoting whole old turn layers (`cache.window_policy`), each KV head of each model layer
keeps the tokens its scores rank highest (`cache.attention_scores`, SnapKV's observation window:
Li et al., 2024; the heavy-hitter idea of H2O: Zhang et al., 2023). The base layer (system prompt
and pinned turns: StreamingLLM's attention sinks and more, Xiao et al., 2023) and the most recent
`recent_tokens` are never evicted.

Every full model layer then holds `kv_heads * (own_tokens - evicted)` own tokens in all, spent
over its heads by an allocation (`evict_by_scores`):

- `per_head` (Ada-KV, Feng et al., 2024; the default): a layer's heads share its kept tokens by
  score, so the counts differ per head and the layer is stored ragged (`SessionCache.own_head_tokens`);
  the layer table then counts each turn layer's tokens per head on average.
- `uniform`: every head keeps the same number of tokens of each turn layer, chosen from the
  scores too: each head's top tokens over the whole evictable span are counted per layer and the
  mean over heads and model layers becomes the layer's quota (largest remainder, so the quotas
  sum to what must be kept); then each head keeps its own top tokens within each layer's quota.
  The tensors stay rectangular and the layer table exact per head.

Either way the sets held differ per head (`SessionCache.own_stream_index`). PyramidKV's per-layer
counts (Cai et al., 2024) are measured as masks only (`cache.budget_allocation`).

    own slots, one head   | t0 (pinned) | t1 .......... | t2 .......... | t3 (recent) |
    evictable                           |<------------------------->|
    kept                  | t0          | t1: top k1    | t2: top k2    | t3          |

The `agnostic` policy evicts the same way by scores fixed when the earlier turns committed
(`committed_scores`, `stored_scores`): KVzip's question-agnostic scores (Kim et al., NeurIPS 2025),
the attention the model pays each token while it repeats each committed turn's ids
(`cache.attention_scores.ReconstructionScores`, run by the turn runner after the reply); a chunked
rebuild's chunks are scored by their own queries (`cache.attention_scores.QueryLog`).

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

from cache.layer_table import LayerSpan, pinned_stream_mask, span_offsets, stream_index_of, tokens_per_span
from cache.ragged_heads import split_heads
from cache.session_cache import SessionCache
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
    """How many own tokens per KV head may be evicted (see `evictable_ranges`); for a ragged
    cache, the fewest over the full model layers of their heads' evictable slots, on average."""
    if not cache.ragged:
        return sum(end - start for _, start, end in evictable_ranges(cache, recent_tokens))
    pinned = pinned_stream_mask(cache.layers, cache.next_original_index)
    return min(
        (
            sum(int(m.sum()) for m in evictable_per_head(cache.head_stream_index(layer), pinned, recent_tokens))
            // cache.kv_heads(layer)
            for layer in cache.full_layers
        ),
        default=0,
    )


def evictable_per_head(streams: Sequence[torch.Tensor], pinned: torch.Tensor, recent_tokens: int) -> list[torch.Tensor]:
    """Per KV head, `[n_h]` bool over its own slots (`streams`: each head's stream index,
    `SessionCache.head_stream_index`): not a pinned turn's token (`pinned`: `pinned_stream_mask`)
    and not among the head's last `recent_tokens`."""
    out = []
    for stream in streams:
        n = stream.numel()
        out.append(~pinned[stream] & (torch.arange(n) < n - recent_tokens))
    return out


BUDGET_ALLOCATIONS = ("uniform", "per_head")
"""How an eviction spends the kept tokens over KV heads (`evict_by_scores`)."""
ADA_KV_FLOOR_SHARE = 0.2
"""Ada-KV's safeguard alpha: each head first keeps this share of its layer's kept tokens per head."""


def evict_by_scores(
    cache: SessionCache, scores: torch.Tensor, evict_tokens: int, recent_tokens: int, allocation: str = "uniform"
) -> SessionCache:
    """Evict `evict_tokens` tokens per KV head, on average, from every full model layer, lowest
    scores first.

    Only full-attention model layers evict (`SessionCache.full_layers`); a sliding-window layer's
    tail is its window and stays whole. Either way every full model layer then holds
    `kv_heads * (own_tokens - evict_tokens)` own tokens (the same bytes):

    - `uniform`: every head of every layer keeps the same count of each turn layer (module
      docstring); the tensors stay rectangular.
    - `per_head` (Ada-KV: Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
      Allocation for Efficient LLM Inference", 2024): within each model layer, each head first
      keeps its own top `ADA_KV_FLOOR_SHARE` of the layer's kept tokens per head, then the
      highest remaining scores over all its heads together keep the rest, so a head whose
      attention is concentrated gives budget to one whose attention is spread; the layer is
      stored ragged (`SessionCache.own_head_tokens`). A cache already ragged always evicts so.

    Args:
        cache: the session cache (`SessionCache`: rectangular or ragged own tensors).
        scores: `[full_model_layers, kv_heads, w]` float importance, `w >= cache.score_width`:
            columns are the cache's working-buffer slots (base first; head `h`'s own slot `i` at
            `base_tokens + i`), e.g. `ObservationWindow.scores(cache.score_width)`.
        evict_tokens: tokens to drop per head on average, `0 <= evict_tokens <= evictable_tokens(...)`.
        recent_tokens: most recent own tokens of each head never evicted.
        allocation: one of `BUDGET_ALLOCATIONS`.

    Returns:
        A new cache (`cache` is not modified) with `own_tokens - evict_tokens` tokens per head on
        average, the layer table's `token_count` / `evicted_tokens` updated (per head on average
        over the heads and full model layers when ragged) and `own_stream_index` recording which
        token each head holds.

    Raises:
        ValueError: if `evict_tokens` is negative or more than may be evicted, `scores` has
            another shape, or `allocation` is unknown.
    """
    if allocation not in BUDGET_ALLOCATIONS:
        raise ValueError(f"budget allocation must be one of {', '.join(BUDGET_ALLOCATIONS)}, got {allocation!r}")
    evictable = evictable_tokens(cache, recent_tokens)
    if not 0 <= evict_tokens <= evictable:
        raise ValueError(f"cannot evict {evict_tokens} tokens per head, {evictable} are evictable")
    layers_n = len(cache.full_layers)
    kv_heads = cache.kv_heads(cache.full_layers[0]) if cache.full_layers else 0
    if scores.dim() != 3 or tuple(scores.shape[:2]) != (layers_n, kv_heads) or scores.shape[2] < cache.score_width:
        expected = (layers_n, kv_heads, cache.score_width)
        raise ValueError(f"scores have shape {tuple(scores.shape)}, expected {expected}")
    if evict_tokens == 0:
        return cache
    if allocation == "per_head" or cache.ragged:
        return _evict_per_head(cache, scores, evict_tokens, recent_tokens)
    ranges = evictable_ranges(cache, recent_tokens)
    slots, quotas = _kept(cache, scores[:, :, : cache.total_tokens], ranges, evictable - evict_tokens)
    return _gather(cache, slots, ranges, quotas)


def _evict_per_head(cache: SessionCache, scores: torch.Tensor, evict_tokens: int, recent_tokens: int) -> SessionCache:
    """`evict_by_scores` under `per_head` (Ada-KV): each full model layer stored ragged."""
    pinned = pinned_stream_mask(cache.layers, cache.next_original_index)
    keys, values = list(cache.own_keys), list(cache.own_values)
    stream_index: list[torch.Tensor] = [
        _as_rows(cache, layer, cache.head_stream_index(layer)) for layer in range(len(cache.own_keys))
    ]
    head_tokens: list[tuple[int, ...] | None] = list(cache.own_head_tokens or (None,) * len(cache.own_keys))
    own_scores = list(cache.own_scores) if cache.own_scores is not None else None
    kept_streams: list[torch.Tensor] = []
    for row, layer in enumerate(cache.full_layers):
        streams = cache.head_stream_index(layer)
        evictable = evictable_per_head(streams, pinned, recent_tokens)
        head_scores = [
            scores[row, head, cache.base_tokens : cache.base_tokens + m.numel()].float()
            for head, m in enumerate(evictable)
        ]
        keep = sum(int(m.sum()) for m in evictable) - len(evictable) * evict_tokens
        chosen = _ada_kv_choice(head_scores, evictable, keep)
        kept = [~m | c for m, c in zip(evictable, chosen, strict=True)]  # [n_h] bool per head
        counts = tuple(int(k.sum()) for k in kept)
        key_heads = split_heads(_flat(cache, layer, cache.own_keys[layer]), cache.head_tokens(layer))
        value_heads = split_heads(_flat(cache, layer, cache.own_values[layer]), cache.head_tokens(layer))
        keys[layer] = torch.cat([k[:, :, m.to(k.device)] for k, m in zip(key_heads, kept, strict=True)], dim=-2)
        values[layer] = torch.cat([v[:, :, m.to(v.device)] for v, m in zip(value_heads, kept, strict=True)], dim=-2)
        stream_index[layer] = torch.cat([s[m] for s, m in zip(streams, kept, strict=True)])[None]
        kept_streams.extend(s[m] for s, m in zip(streams, kept, strict=True))
        head_tokens[layer] = counts
        if own_scores is not None:
            old = cache.head_rows(layer, own_scores[row])
            own_scores[row] = torch.cat([o[m] for o, m in zip(old, kept, strict=True)])[None]
    spans = _average_spans(cache, kept_streams, cache.own_tokens - evict_tokens)
    return replace(
        cache,
        own_keys=tuple(keys),
        own_values=tuple(values),
        layers=spans,
        own_stream_index=tuple(stream_index),
        own_head_tokens=tuple(head_tokens),
        own_scores=None if own_scores is None else tuple(own_scores),
    )


def _flat(cache: SessionCache, layer: int, tensor: torch.Tensor) -> torch.Tensor:
    """Own keys or values of model layer `layer` as `[1, 1, sum n_h, d]`, head by head (a view when
    ragged; a rectangular layer's heads are contiguous, so a reshape)."""
    return tensor if cache.ragged_counts(layer) is not None else tensor.reshape(1, 1, -1, tensor.shape[-1])


def _as_rows(cache: SessionCache, layer: int, per_head: list[torch.Tensor]) -> torch.Tensor:
    """A layer's per-head stream index in the layer's stored form (`[kv, n]`, or `[1, sum]` ragged)."""
    if cache.ragged_counts(layer) is not None:
        return torch.cat(per_head)[None]
    return torch.stack(per_head) if per_head else torch.zeros(0, 0, dtype=torch.long)


def _ada_kv_choice(scores: list[torch.Tensor], evictable: list[torch.Tensor], keep: int) -> list[torch.Tensor]:
    """Per head, `[n_h]` bool: the evictable slots kept, `keep` over all heads: each head's top
    `ADA_KV_FLOOR_SHARE * keep / heads` (at most its evictable count), then the highest remaining
    scores over every head's evictable slots (Ada-KV, Feng et al., 2024)."""
    heads = len(scores)
    floor = int(ADA_KV_FLOOR_SHARE * keep / heads) if heads else 0
    chosen = [torch.zeros_like(m) for m in evictable]
    candidates = []
    for head, (score, mask) in enumerate(zip(scores, evictable, strict=True)):
        slots = mask.nonzero().flatten()
        own = score[slots]
        take = min(floor, slots.numel())
        if take:
            chosen[head][slots[own.topk(take).indices]] = True
        rest = slots[~chosen[head][slots]]
        candidates.append((head, rest, score[rest]))
    left = keep - sum(int(c.sum()) for c in chosen)
    if left > 0:
        pooled = torch.cat([s for _, _, s in candidates])
        owners = torch.cat([torch.full((r.numel(),), h, dtype=torch.long) for h, r, _ in candidates])
        slots = torch.cat([r for _, r, _ in candidates])
        best = pooled.topk(left).indices
        for head in range(heads):
            chosen[head][slots[best[owners[best] == head]]] = True
    return chosen


def _average_spans(cache: SessionCache, kept_streams: list[torch.Tensor], own_tokens: int) -> tuple[LayerSpan, ...]:
    """The layer table after a per-head eviction: each turn layer's held tokens per head, on
    average over every head of every full model layer (`kept_streams`: each head's kept stream
    indices), rounded by largest remainder so the rows sum to `own_tokens`."""
    kept = torch.cat(kept_streams) if kept_streams else torch.zeros(0, dtype=torch.long)
    heads = max(len(kept_streams), 1)
    shares = [inside / heads for inside in tokens_per_span(cache.layers, kept)]
    counts = [int(s) for s in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: shares[i] - counts[i], reverse=True)
    for i in by_remainder[: own_tokens - sum(counts)]:
        counts[i] += 1
    return tuple(
        replace(span, token_count=count, evicted_tokens=span.original_tokens - count)
        for span, count in zip(cache.layers, counts, strict=True)
    )


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
    """`[full_model_layers, kv_heads, cache.score_width]` float32 importance for `evict_by_scores`
    under the `agnostic` policy, fixed before the next question is known: the scores accumulated
    when the turns committed (`SessionCache.own_scores`), or, for a cache without them (restored
    from a blob, rebuilt, forked), each token's stream index, so the newest are kept (the recency
    of StreamingLLM, Xiao et al., 2023) until the next turns score them. The base part, and the
    columns past a ragged head's own slots, are zero (never read: the base is never evicted)."""
    width = cache.score_width
    rows = []
    for row, layer in enumerate(cache.full_layers):
        if cache.own_scores is not None:
            heads = cache.head_rows(layer, cache.own_scores[row].float())
        else:
            heads = [s.float() for s in cache.head_stream_index(layer)]
        out = torch.zeros(len(heads), width)
        for head, own in enumerate(heads):
            out[head, cache.base_tokens : cache.base_tokens + own.numel()] = own.cpu()
        rows.append(out)
    return torch.stack(rows) if rows else torch.zeros(0, 0, width)


def committed_scores(
    before: SessionCache, after: SessionCache, fresh: Sequence[torch.Tensor], built_from: SessionCache | None = None
) -> tuple[torch.Tensor, ...]:
    """`after.own_scores` once a turn turned `before` into `after`: per full layer, the most attention
    each held own token got from the turn's scoring queries, and, for `before`'s own tokens (the
    first ones of each head in `after`), the larger of that and their scores from earlier turns
    (KVzip's max over every query, taken one committed turn at a time).

    Args:
        before, after: the cache before and after the turn.
        fresh: per full layer `[kv_heads, slots]`: scores of the slots of the working buffer of
            `built_from` (`SessionCache.to_working_cache`) and of the tokens written after them:
            a buffer built from `after` (as served: KVzip's reconstruction of the turn's ids,
            `ReconstructionScores`), or the turn's own buffer (`built_from` is `before`, the
            default: a chunked rebuild's chunk scored by its own queries, `QueryLog.turn_scores`).
        built_from: see `fresh`.

    Raises:
        ValueError: if a `fresh` row does not cover the layer's held own tokens.
    """
    source = before if built_from is None else built_from
    appended = len(after.own_token_ids) - len(source.own_token_ids)
    out = []
    for row, layer in enumerate(after.full_layers):
        slots = source.buffer_own_slots(layer, appended)
        width = max((int(s[-1]) + 1 for s in slots if s.numel()), default=0)
        if fresh[row].shape[1] < width:
            raise ValueError(
                f"fresh scores cover {fresh[row].shape[1]} slots, the layer's own tokens reach slot {width}"
            )
        heads = [fresh[row][head, index].clone() for head, index in enumerate(slots)]
        if before.own_scores is not None:  # each head's first slots in `after` are its held ones in `before`
            for head, old in enumerate(before.head_rows(layer, before.own_scores[row])):
                heads[head][: old.numel()] = torch.maximum(heads[head][: old.numel()], old)
        out.append(torch.cat(heads)[None] if after.ragged_counts(layer) is not None else torch.stack(heads))
    return tuple(out)
