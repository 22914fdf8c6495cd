"""Which turn layers the window demotes, and demotion by re-rotation."""

from __future__ import annotations

import pytest
import torch

from cache.rope import rotate_keys
from cache.window_policy import ContextOverflow, WindowPolicy, demote_by_rotation
from tests.cache.helpers import LAYOUT, make_cache


def test_budget_exactly_full_demotes_nothing_and_one_more_token_demotes_exactly_one_turn() -> None:
    cache = make_cache([10, 10, 10], base_tokens=5)
    needed = 5 + 30 + 2 + 8 + 5  # base, turns, closing, new turn, max_new_tokens
    plan = WindowPolicy(needed).plan(cache.layers, 5, closing_tokens=2, turn_tokens=8, max_new_tokens=5)
    assert plan.demote == () and plan.needed_tokens == needed
    plan = WindowPolicy(needed - 1).plan(cache.layers, 5, closing_tokens=2, turn_tokens=8, max_new_tokens=5)
    assert [span.turn_index for span in plan.demote] == [0]
    assert plan.needed_tokens == needed - 10 and plan.demoted_tokens == 10


def test_pinned_turns_are_never_demoted_and_oldest_unpinned_go_first() -> None:
    cache = make_cache([10, 10, 10, 10], base_tokens=5, pinned=frozenset({0}))
    plan = WindowPolicy(5 + 40 + 8 + 5 - 15).plan(cache.layers, 5, 0, 8, 5)
    assert [span.turn_index for span in plan.demote] == [1, 2]


def test_demoting_the_last_turn_also_drops_its_closing_tokens() -> None:
    cache = make_cache([10], base_tokens=5)
    plan = WindowPolicy(5 + 8 + 5).plan(cache.layers, 5, closing_tokens=2, turn_tokens=8, max_new_tokens=5)
    assert [span.turn_index for span in plan.demote] == [0]
    assert plan.needed_tokens == 18


def test_turn_that_cannot_fit_raises_context_overflow_with_the_numbers() -> None:
    cache = make_cache([10, 10], base_tokens=5, pinned=frozenset({0}))
    with pytest.raises(ContextOverflow) as error:
        WindowPolicy(20).plan(cache.layers, 5, 0, 8, 5)
    assert (error.value.needed_tokens, error.value.budget_tokens) == (5 + 10 + 8 + 5, 20)
    with pytest.raises(ValueError):
        WindowPolicy(0)


def test_demotion_rotates_kept_keys_back_and_keeps_values() -> None:
    cache = make_cache([3, 4, 5], base_tokens=4)
    demote = [cache.layers[1]]
    after = demote_by_rotation(cache, demote, LAYOUT)
    assert [(s.turn_index, s.position_start, s.original_start) for s in after.layers] == [(0, 4, 4), (2, 7, 11)]
    assert after.own_token_ids == (0, 1, 2, 7, 8, 9, 10, 11)
    assert after.total_tokens == 4 + 3 + 5
    for index in range(len(cache.own_keys)):
        assert torch.equal(after.own_keys[index][:, :, :3], cache.own_keys[index][:, :, :3])
        torch.testing.assert_close(
            after.own_keys[index][:, :, 3:], rotate_keys(cache.own_keys[index][:, :, 7:], 4, LAYOUT)
        )
        assert torch.equal(after.own_values[index][:, :, 3:], cache.own_values[index][:, :, 7:])
    # The original cache is untouched (write-back may be sealing it concurrently).
    assert cache.own_keys[0].shape[-2] == 12
    assert demote_by_rotation(cache, [], LAYOUT) is cache


def test_demoting_every_turn_leaves_an_empty_own_part() -> None:
    cache = make_cache([3, 4], base_tokens=4)
    after = demote_by_rotation(cache, list(cache.layers), LAYOUT)
    assert after.own_tokens == 0 and after.layers == () and after.own_keys[0].shape == (1, 2, 0, 16)
