"""Eviction by attention scores (`cache.token_eviction`) and the scores themselves (`cache.attention_scores`)."""

from __future__ import annotations

import pytest
import torch

from cache.attention_scores import _layer_scores
from cache.serialization import FORMAT_VERSION, session_cache_from_tensors, session_cache_to_tensors
from cache.token_eviction import evict_by_scores, evictable_tokens
from cache.window_policy import WindowPolicy, demote_by_rotation
from tests.cache.helpers import HEADS, LAYERS, LAYOUT, make_cache


def scores_for(cache, favourite: dict[int, list[int]]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Scores with small noise, and a high score on the own slots `favourite[head]` of every model layer."""
    scores = torch.rand(LAYERS, HEADS, cache.total_tokens, generator=torch.Generator().manual_seed(3)) * 0.01
    for head, slots in favourite.items():
        for slot in slots:
            scores[:, head, cache.base_tokens + slot] = 1.0
    return scores


def test_eviction_keeps_the_base_pinned_turns_and_the_recent_window() -> None:
    cache = make_cache([6, 10, 10, 8], base_tokens=4, pinned=frozenset({0}))
    # Heavy scores on nothing the policy may keep: it must still keep base, pin and recent tokens.
    scores = torch.zeros(LAYERS, HEADS, cache.total_tokens)
    scores[:, :, : cache.base_tokens] = 100.0
    recent = 5
    assert evictable_tokens(cache, recent) == 10 + 10 + 3  # turns 1, 2 and the first 3 of turn 3
    out = evict_by_scores(cache, scores, 12, recent)
    assert out.own_tokens == cache.own_tokens - 12
    assert out.base_token_ids == cache.base_token_ids and out.own_token_ids == cache.own_token_ids
    assert next(s.evicted_tokens for s in out.layers) == 0
    assert sum(s.evicted_tokens for s in out.layers) == 12
    for layer in range(LAYERS):
        index = out.own_stream_index[layer]  # type: ignore[index]
        assert index.shape == (HEADS, cache.own_tokens - 12)
        for head in range(HEADS):
            held = index[head].tolist()
            assert held[:6] == list(range(4, 10))  # the pinned turn, whole
            assert held[-recent:] == list(range(4 + 34 - recent, 4 + 34))  # the most recent tokens
            assert held == sorted(held)
    # Every kept key is the key of the token its stream index names, in its own head.
    for layer in range(LAYERS):
        for head in range(HEADS):
            slots = out.own_stream_index[layer][head] - cache.base_tokens  # type: ignore[index]
            assert torch.equal(out.own_keys[layer][0, head], cache.own_keys[layer][0, head, slots])
            assert torch.equal(out.own_values[layer][0, head], cache.own_values[layer][0, head, slots])


def test_each_head_keeps_its_own_top_tokens_when_scores_differ() -> None:
    cache = make_cache([12, 12, 4], base_tokens=2)
    favourite = {0: [0, 1, 2, 3], 1: [12, 13, 14, 15]}  # head 0 likes turn 0, head 1 likes turn 1
    out = evict_by_scores(cache, scores_for(cache, favourite), evict_tokens=12, recent_tokens=4)
    index = out.own_stream_index
    assert index is not None
    kept = {head: set(index[0][head].tolist()) for head in range(HEADS)}
    assert kept[0] != kept[1]
    assert {2 + s for s in favourite[0]} <= kept[0]
    assert {2 + s for s in favourite[1]} <= kept[1]
    # Same count per head in every layer (rectangular), so the table stays contiguous runs.
    counts = [s.token_count for s in out.layers]
    assert sum(counts[:2]) == 12 and min(counts[:2]) >= 4 and counts[2] == 4
    assert [s.evicted_tokens for s in out.layers] == [12 - counts[0], 12 - counts[1], 0]


def test_layer_quota_follows_where_heads_put_their_attention() -> None:
    cache = make_cache([10, 10, 2], base_tokens=2)
    favourite = {0: list(range(10, 16)), 1: list(range(10, 16))}  # both heads: turn 1
    out = evict_by_scores(cache, scores_for(cache, favourite), evict_tokens=14, recent_tokens=2)
    assert [s.token_count for s in out.layers] == [0, 6, 2]
    assert out.layers[0].evicted_tokens == 10 and out.layers[0].original_tokens == 10


def test_kept_tokens_keep_their_positions_and_the_next_position_continues_the_stream() -> None:
    cache = make_cache([10, 10, 4], base_tokens=3)
    out = evict_by_scores(cache, scores_for(cache, {0: [1], 1: [2]}), evict_tokens=9, recent_tokens=4)
    assert out.total_tokens == cache.total_tokens - 9
    assert out.next_position == cache.next_position == 3 + 24
    assert [(s.position_start, s.original_start) for s in out.layers] == [
        (s.position_start, s.original_start) for s in cache.layers
    ]
    working = out.to_working_cache(5)
    assert working.prealloc_layers[0].next_position == 27
    assert working.prealloc_layers[0].get_seq_length() == out.total_tokens


def test_evicting_twice_composes_and_a_turn_appends_after_it() -> None:
    cache = make_cache([8, 8, 8], base_tokens=2)
    once = evict_by_scores(cache, scores_for(cache, {0: [0], 1: [9]}), evict_tokens=6, recent_tokens=4)
    twice = evict_by_scores(once, scores_for(once, {0: [0], 1: [5]}), evict_tokens=6, recent_tokens=4)
    assert twice.own_tokens == 24 - 12
    assert sum(s.evicted_tokens for s in twice.layers) == 12
    for layer in range(LAYERS):
        for head in range(HEADS):
            held = twice.own_stream_index[layer][head]  # type: ignore[index]
            assert set(held.tolist()) <= set(once.own_stream_index[layer][head].tolist())  # type: ignore[index]


def test_serialization_round_trips_an_evicted_cache_exactly() -> None:
    cache = make_cache([8, 8, 8], base_tokens=2)
    out = evict_by_scores(cache, scores_for(cache, {0: [0, 1], 1: [9, 10]}), evict_tokens=7, recent_tokens=4)
    tensors, header = session_cache_to_tensors(out)
    assert header["format_version"] == FORMAT_VERSION
    back = session_cache_from_tensors(tensors, header, "cpu")
    assert back.layers == out.layers and back.own_token_ids == out.own_token_ids
    assert back.next_position == out.next_position
    for a, b in zip((*back.own_keys, *back.own_values), (*out.own_keys, *out.own_values), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(back.own_stream_index or (), out.own_stream_index or (), strict=True):
        assert torch.equal(a, b)


def test_quantised_serialization_composes_with_eviction() -> None:
    cache = make_cache([40, 40, 8], base_tokens=2)
    out = evict_by_scores(cache, scores_for(cache, {0: [0], 1: [50]}), evict_tokens=30, recent_tokens=8)
    tensors, header = session_cache_to_tensors(out, "int8", residual_tokens=8)
    back = session_cache_from_tensors(tensors, header, "cpu")
    assert [s.precision for s in back.layers] == ["int8", "int8", "exact"]
    assert [s.evicted_tokens for s in back.layers] == [s.evicted_tokens for s in out.layers]
    for a, b in zip(back.own_keys, out.own_keys, strict=True):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=0.05)
        assert torch.equal(a[:, :, -8:], b[:, :, -8:])  # the recent tokens stay exact


def test_a_version_1_blob_still_decodes() -> None:
    cache = make_cache([5, 5], base_tokens=2)
    tensors, header = session_cache_to_tensors(cache)
    header = {**header, "format_version": 1, "layers": [{**s, "evicted_tokens": 0} for s in header["layers"]]}
    for layer in header["layers"]:
        del layer["evicted_tokens"]
    back = session_cache_from_tensors(tensors, header, "cpu")
    assert back.layers == cache.layers and back.own_stream_index is None


def test_turns_policy_demotes_an_evicted_layer_as_a_whole_and_keeps_its_gaps() -> None:
    cache = make_cache([8, 8, 8], base_tokens=2)
    out = evict_by_scores(cache, scores_for(cache, {0: [9], 1: [10]}), evict_tokens=8, recent_tokens=4)
    demoted = demote_by_rotation(out, [out.layers[0]], LAYOUT)
    assert [s.turn_index for s in demoted.layers] == [1, 2]
    assert demoted.layers[0].position_start == 2
    assert demoted.layers[1].position_start == 2 + demoted.layers[0].original_tokens
    assert demoted.own_tokens == out.own_tokens - out.layers[0].token_count
    assert len(demoted.own_token_ids) == 16
    assert demoted.own_stream_index is not None and demoted.own_stream_index[0].shape[-1] == demoted.own_tokens
    plan = WindowPolicy(100).plan(out.layers, out.base_tokens, 0, 1, 1)
    assert plan.demote == ()


@pytest.mark.parametrize(("evict", "recent"), [(-1, 0), (21, 4)])
def test_evicting_a_bad_count_is_a_value_error(evict: int, recent: int) -> None:
    cache = make_cache([10, 10, 4], base_tokens=2)
    with pytest.raises(ValueError, match="cannot evict"):
        evict_by_scores(cache, torch.zeros(LAYERS, HEADS, cache.total_tokens), evict, recent)


def test_window_policy_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="window policy"):
        WindowPolicy(100, policy="h2o")
    with pytest.raises(ValueError, match="window_recent_tokens"):
        WindowPolicy(100, policy="attention", recent_tokens=100)
    with pytest.raises(ValueError, match="window_recent_tokens"):
        WindowPolicy(100, recent_tokens=-1)
    with pytest.raises(ValueError, match="window_observation_tokens"):
        WindowPolicy(100, policy="attention", observation_tokens=0)
    with pytest.raises(ValueError, match="budget_tokens"):
        WindowPolicy(-5, policy="attention")


def test_scores_are_softmax_attention_of_the_window_summed_over_group_heads() -> None:
    generator = torch.Generator().manual_seed(0)
    kv_heads, groups, window, cached, head_dim = 2, 3, 4, 10, 8
    keys = torch.randn(1, kv_heads, cached + window, head_dim, generator=generator)
    query = torch.randn(1, kv_heads * groups, window, head_dim, generator=generator)
    got = _layer_scores(query, keys, 0.5, cached, pool_kernel=1)
    expected = torch.zeros(kv_heads, cached)
    for head in range(kv_heads * groups):
        k = keys[0, head // groups]
        for row in range(window):
            visible = cached + row + 1
            weights = torch.softmax(query[0, head, row] @ k[:visible].T * 0.5, dim=-1)
            expected[head // groups] += weights[:cached]
    assert torch.allclose(got, expected, atol=1e-5)
    pooled = _layer_scores(query, keys, 0.5, cached, pool_kernel=3)
    assert torch.allclose(pooled[:, 1], expected[:, :3].max(dim=-1).values, atol=1e-5)
