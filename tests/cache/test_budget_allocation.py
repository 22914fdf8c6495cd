"""Budgets per KV head (Ada-KV) and per model layer (PyramidKV) as kept masks (`cache.budget_allocation`)."""

from __future__ import annotations

import pytest
import torch

from cache.attention_scores import ObservationWindow, QueryLog
from cache.budget_allocation import ALLOCATIONS, kept_own_mask, layer_budgets
from cache.session_cache import SessionCache
from cache.token_eviction import evict_by_scores, evictable_tokens
from tests.cache.helpers import HEADS, LAYERS, make_cache
from tests.cache.test_sliding_layers import cache_after, marked


def random_scores(cache: SessionCache, seed: int = 5) -> torch.Tensor:
    return torch.rand(LAYERS, HEADS, cache.total_tokens, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("allocation", ALLOCATIONS)
@pytest.mark.parametrize("evict", [0, 1, 9, 23])
def test_every_allocation_keeps_the_same_total_and_never_the_base_pins_or_recent_window(
    allocation: str, evict: int
) -> None:
    cache = make_cache([6, 10, 10, 8], base_tokens=4, pinned=frozenset({0}))
    recent = 5
    evictable = evictable_tokens(cache, recent)
    assert evictable == 23
    scores = random_scores(cache)
    scores[:, :, : cache.base_tokens + 6] = -1.0  # the pinned turn scores lowest: kept all the same
    scores[:, :, -recent:] = -1.0
    mask = kept_own_mask(cache, scores, evict, recent, allocation)
    assert mask.shape == (LAYERS, HEADS, cache.own_tokens)
    assert int(mask.sum()) == LAYERS * HEADS * (cache.own_tokens - evict)  # same bytes as uniform
    assert mask[:, :, :6].all() and mask[:, :, -recent:].all()
    if evict == 0:  # eviction off: every slot kept, whatever the allocation
        assert mask.all()


def test_uniform_keeps_exactly_what_evict_by_scores_keeps() -> None:
    cache = make_cache([6, 10, 10, 8], base_tokens=4, pinned=frozenset({0}))
    scores = random_scores(cache, seed=11)
    mask = kept_own_mask(cache, scores, 12, 5, "uniform")
    evicted = evict_by_scores(cache, scores, 12, 5)
    for row in range(LAYERS):
        for head in range(HEADS):
            held = evicted.own_stream_index[row][head] - cache.base_tokens  # type: ignore[index]
            assert torch.equal(mask[row, head].nonzero()[:, 0], held)


def test_per_head_gives_a_spread_head_more_than_a_concentrated_one_within_the_layers_total() -> None:
    cache = make_cache([20, 20, 4], base_tokens=2)
    scores = torch.zeros(LAYERS, HEADS, cache.total_tokens)
    scores[:, 0, 2:6] = 1.0  # head 0: four tokens matter
    scores[:, 1, 2:42] = torch.linspace(0.9, 0.5, 40)  # head 1: attention spread over 40
    mask = kept_own_mask(cache, scores, 20, 4, "per_head")
    keep = evictable_tokens(cache, 4) - 20  # 20 per head on average
    for row in range(LAYERS):
        evictable = mask[row, :, :40].sum(dim=-1)
        assert int(evictable.sum()) == HEADS * keep
        assert int(evictable[1]) > keep > int(evictable[0]) >= int(0.2 * keep)  # Ada-KV's floor
        assert mask[row, 0, :4].all()  # head 0 still keeps what it attends to


@pytest.mark.parametrize(("layers", "keep", "cap"), [(30, 20, 100), (30, 20, 25), (7, 3, 3), (2, 0, 5), (1, 4, 9)])
def test_layer_budgets_fall_with_depth_stay_under_the_cap_and_sum_exactly(layers: int, keep: int, cap: int) -> None:
    budgets = layer_budgets(layers, keep, cap)
    assert len(budgets) == layers and sum(budgets) == layers * keep
    assert all(0 <= b <= cap for b in budgets)
    assert budgets == sorted(budgets, reverse=True)
    if layers > 1 and 0 < keep < cap:
        assert budgets[0] > budgets[-1]


def test_per_layer_keeps_the_same_count_in_every_head_of_a_layer_and_more_in_lower_layers() -> None:
    cache = make_cache([20, 20, 4], base_tokens=2)
    mask = kept_own_mask(cache, random_scores(cache), 20, 4, "per_layer")
    per_head = mask[:, :, :40].sum(dim=-1)  # [L, kv]
    assert (per_head == per_head[:, :1]).all()
    assert int(per_head[0, 0]) > int(per_head[1, 0])
    assert int(per_head.sum()) == LAYERS * HEADS * 20


def test_a_bad_allocation_or_count_is_a_value_error() -> None:
    cache = make_cache([6, 10], base_tokens=2)
    scores = random_scores(cache)
    with pytest.raises(ValueError, match="budget allocation must be one of"):
        kept_own_mask(cache, scores, 1, 2, "per_token")
    for allocation in ALLOCATIONS:
        with pytest.raises(ValueError, match="cannot evict"):
            kept_own_mask(cache, scores, 15, 2, allocation)
    with pytest.raises(ValueError, match="scores have shape"):
        kept_own_mask(cache, scores[:, :, 1:], 1, 2, "per_head")
    with pytest.raises(ValueError, match="beta"):
        layer_budgets(4, 2, 5, beta=0.5)


@pytest.mark.parametrize("observer", [ObservationWindow, QueryLog])
def test_a_sliding_layer_is_never_observed_or_scored_its_window_is_its_budget(observer: type) -> None:
    cache = cache_after([2, 5, 6])  # model layer 0 full, model layer 1 a sliding window of 4
    working = cache.to_working_cache(3)
    full, sliding = working.prealloc_layers
    with observer(working, 2) as watching:
        assert full.query_observer is not None and sliding.query_observer is None
        full.update(marked(15, 16), marked(15, 16))
        full.query_observer(marked(15, 16), None)
    assert full.query_observer is None
    scores = (
        watching.scores(cache.total_tokens) if observer is ObservationWindow else torch.stack(watching.turn_scores())
    )
    assert scores.shape[0] == 1  # one row: the full layer only


@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_allocations_cover_full_layers_only_and_leave_a_sliding_window_whole(allocation: str) -> None:
    cache = cache_after([2, 5, 6])
    scores = torch.rand(1, 1, cache.total_tokens, generator=torch.Generator().manual_seed(4))
    mask = kept_own_mask(cache, scores, 4, 2, allocation)
    assert mask.shape == (1, 1, cache.own_tokens) and int(mask.sum()) == cache.own_tokens - 4
    evicted = evict_by_scores(cache, scores, 4, 2)
    assert evicted.own_tokens == cache.own_tokens - 4
    assert torch.equal(evicted.own_keys[1], cache.own_keys[1])  # the window: never scored, never evicted
