"""Per-head budgets served (Ada-KV): ragged full layers, their working buffer with holes, their
next eviction and their blobs (`cache.token_eviction`, `cache.session_cache`, `cache.serialization`)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cache.budget_allocation import kept_own_mask
from cache.ragged_heads import split_heads
from cache.serialization import MalformedCache, session_cache_from_tensors, session_cache_to_tensors
from cache.session_cache import SessionCache
from cache.token_eviction import committed_scores, evict_by_scores, evictable_tokens, stored_scores
from tests.cache.helpers import HEAD_DIM, HEADS, LAYERS, make_cache


def skewed_scores(cache: SessionCache, seed: int = 3) -> torch.Tensor:
    """Head 0 attends to few tokens, head 1 to many: Ada-KV moves budget from head 0 to head 1."""
    scores = torch.rand(LAYERS, HEADS, cache.score_width, generator=torch.Generator().manual_seed(seed))
    scores[:, 0] = scores[:, 0] ** 8
    return scores


def ragged(evict: int = 12, recent: int = 5) -> tuple[SessionCache, SessionCache]:
    cache = make_cache([6, 10, 10, 8], base_tokens=4, pinned=frozenset({0}))
    return cache, evict_by_scores(cache, skewed_scores(cache), evict, recent, "per_head")


def test_per_head_kept_sets_respect_the_total_budget_exactly_and_keep_pins_and_the_recent_window() -> None:
    cache, evicted = ragged(evict=12, recent=5)
    assert evicted.ragged and evicted.own_tokens == cache.own_tokens - 12
    for layer in evicted.full_layers:
        counts = evicted.head_tokens(layer)
        assert sum(counts) == HEADS * evicted.own_tokens  # the same bytes as uniform
        assert counts[0] < counts[1]  # the concentrated head gave budget to the spread one
        assert evicted.own_keys[layer].shape == (1, 1, sum(counts), HEAD_DIM)
        for stream in evicted.head_stream_index(layer):
            assert stream[:6].tolist() == list(range(4, 10))  # the pinned turn, whole
            assert stream[-5:].tolist() == list(range(cache.next_original_index - 5, cache.next_original_index))
    assert sum(span.token_count for span in evicted.layers) == evicted.own_tokens
    assert all(s.token_count + s.evicted_tokens == s.original_tokens for s in evicted.layers)


def test_ragged_heads_hold_the_keys_they_kept() -> None:
    cache, evicted = ragged()
    for layer in evicted.full_layers:
        heads = split_heads(evicted.own_keys[layer], evicted.head_tokens(layer))
        for head, (keys, stream) in enumerate(zip(heads, evicted.head_stream_index(layer), strict=True)):
            expected = cache.own_keys[layer][:, head : head + 1, stream - cache.base_tokens]
            assert torch.equal(keys, expected)


def test_the_served_per_head_eviction_is_the_per_head_mask() -> None:
    cache, evicted = ragged()
    mask = kept_own_mask(cache, skewed_scores(cache), 12, 5, "per_head")
    for row, layer in enumerate(evicted.full_layers):
        for head, stream in enumerate(evicted.head_stream_index(layer)):
            assert torch.equal(mask[row, head].nonzero()[:, 0], stream - cache.base_tokens)


def test_a_ragged_working_buffer_masks_each_heads_hole_and_the_turn_lands_after_it() -> None:
    cache, evicted = ragged()
    working = evicted.with_base(cache.base).to_working_cache(3)
    for layer, buffer in zip(evicted.full_layers, working.prealloc_layers, strict=True):
        counts = evicted.head_tokens(layer)
        longest = max(counts)
        assert buffer.get_seq_length() == cache.base_tokens + longest
        assert buffer.head_valid is not None
        assert buffer.head_valid.sum(dim=-1).tolist() == [cache.base_tokens + n for n in counts]
        new = torch.full((1, HEADS, 3, HEAD_DIM), 7.0)
        buffer.update(new, new)


def test_after_turn_appends_to_every_head_of_a_ragged_layer() -> None:
    cache, evicted = ragged()
    evicted = evicted.with_base(cache.base)
    working = evicted.to_working_cache(3)
    for buffer in working.prealloc_layers:
        new = torch.arange(3, dtype=torch.float32).view(1, 1, 3, 1).expand(1, HEADS, 3, HEAD_DIM) + 100
        buffer.update(new, new)
    last = evicted.layers[-1]
    span = replace(last, token_count=last.token_count + 3)
    after = evicted.after_turn(working, [90, 91, 92], [span])
    for layer in after.full_layers:
        counts = after.head_tokens(layer)
        assert counts == tuple(n + 3 for n in evicted.head_tokens(layer))
        old = split_heads(evicted.own_keys[layer], evicted.head_tokens(layer))
        for head, keys in enumerate(split_heads(after.own_keys[layer], counts)):
            assert torch.equal(keys[:, :, : old[head].shape[-2]], old[head])
            assert keys[0, 0, -3:, 0].tolist() == [100.0, 101.0, 102.0]
        end = evicted.next_original_index
        for stream in after.head_stream_index(layer):
            assert stream[-3:].tolist() == [end, end + 1, end + 2]


def test_a_ragged_cache_evicts_again_within_the_same_total() -> None:
    _, evicted = ragged(evict=8, recent=5)
    again = evict_by_scores(evicted, stored_scores(evicted), 6, 5, "uniform")  # a ragged cache stays per-head
    for layer in again.full_layers:
        assert sum(again.head_tokens(layer)) == HEADS * again.own_tokens
    assert again.own_tokens == evicted.own_tokens - 6
    with pytest.raises(ValueError, match="cannot evict"):
        evict_by_scores(again, stored_scores(again), evictable_tokens(again, 5) + 1, 5, "per_head")


def test_committed_scores_follow_each_heads_slots() -> None:
    cache, evicted = ragged()
    evicted = evicted.with_base(cache.base)
    working = evicted.to_working_cache(2)
    for buffer in working.prealloc_layers:
        new = torch.zeros(1, HEADS, 2, HEAD_DIM)
        buffer.update(new, new)
    last = evicted.layers[-1]
    after = evicted.after_turn(working, [90, 91], [replace(last, token_count=last.token_count + 2)])
    width = working.prealloc_layers[0].get_seq_length()
    fresh = tuple(torch.arange(width, dtype=torch.float32).expand(HEADS, -1).clone() for _ in after.full_layers)
    scores = committed_scores(evicted, after, fresh)
    for row, layer in enumerate(after.full_layers):
        longest = max(evicted.head_tokens(layer))
        for head, got in enumerate(after.head_rows(layer, scores[row])):
            n = evicted.head_tokens(layer)[head]
            base = cache.base_tokens
            expected = [*range(base, base + n), base + longest, base + longest + 1]
            assert got.tolist() == [float(x) for x in expected]


@pytest.mark.parametrize("precision", ["exact", "int8", "int4"])
def test_a_ragged_cache_round_trips_through_its_blob(precision: str) -> None:
    cache = make_cache([6, 40, 40, 8], base_tokens=4, pinned=frozenset({0}))
    evicted = evict_by_scores(cache, skewed_scores(cache), 30, 5, "per_head")
    tensors, header = session_cache_to_tensors(evicted, precision, residual_tokens=4)
    restored = session_cache_from_tensors(tensors, header, "cpu")
    assert restored.own_head_tokens == evicted.own_head_tokens
    assert restored.layers[1:] == evicted.layers[1:] or precision != "exact"
    for layer in evicted.full_layers:
        assert restored.own_keys[layer].shape == evicted.own_keys[layer].shape
        assert torch.equal(restored.own_stream_index[layer], evicted.own_stream_index[layer])  # type: ignore[index]
        if precision == "exact":
            assert torch.equal(restored.own_keys[layer], evicted.own_keys[layer])
        else:
            error = (restored.own_keys[layer] - evicted.own_keys[layer]).abs().max()
            assert 0 < float(error) < 2.0
    if precision == "exact":  # the tokens held, no padding
        stored = sum(t.numel() for name, t in tensors.items() if name.startswith("k."))
        assert stored == sum(k.numel() for k in evicted.own_keys) == LAYERS * HEADS * evicted.own_tokens * HEAD_DIM


def _corrupted(edit: str) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    _, evicted = ragged(evict=10, recent=4)
    tensors, header = session_cache_to_tensors(evicted, "int8", residual_tokens=4)
    head_tokens = header["head_tokens"]
    assert isinstance(head_tokens, list)
    first, second = head_tokens[0]
    if edit == "negative count":  # the same total, so the tensors' sizes alone do not tell
        head_tokens[0] = [-1, first + second + 1]
    elif edit == "swapped counts":
        head_tokens[0] = [second, first]
    elif edit == "count not a number":
        head_tokens[0] = ["x", second]
    elif edit == "lossy ranges not pairs":
        header["lossy_ranges_by_layer"] = {"0": "zz"}
    elif edit == "lossy ranges not a mapping":
        header["lossy_ranges_by_layer"] = None
    elif edit == "stream index out of range":
        tensors["idx.0"] = tensors["idx.0"] + 10_000
    elif edit == "stream index negative":
        tensors["idx.0"] = tensors["idx.0"] - 2
    return tensors, header


@pytest.mark.parametrize(
    "edit",
    [
        "negative count",
        "swapped counts",
        "count not a number",
        "lossy ranges not pairs",
        "lossy ranges not a mapping",
        "stream index out of range",
        "stream index negative",
    ],
)
def test_a_ragged_blob_whose_header_does_not_match_its_tensors_is_malformed(edit: str) -> None:
    tensors, header = _corrupted(edit)
    with pytest.raises(MalformedCache):
        session_cache_from_tensors(tensors, header, "cpu")
