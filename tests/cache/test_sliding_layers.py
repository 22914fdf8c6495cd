"""A session cache whose model layers differ by attention kind: a sliding layer of window W holds the
tail of its last W - 1 positions, takes the base's last tokens while the tail starts at the base,
is trimmed after a turn, forks only while it still holds the fork point's window, and round-trips
through the codec's tensors with its own length. Every key's value is its RoPE position, so each
assertion names the exact tokens held."""

from __future__ import annotations

import pytest
import torch

from cache.ids import PrefixKey
from cache.layer_table import LayerKind, LayerSpan
from cache.serialization import MalformedCache, session_cache_from_tensors, session_cache_to_tensors
from cache.session_cache import BaseLayer, SessionCache

WINDOWS = (None, 4)
"""Model layer 0 full attention, model layer 1 a sliding window of 4 (a tail of 3)."""


def positions(tensor: torch.Tensor) -> list[int]:
    return [int(v) for v in tensor[0, 0, :, 0]]


def marked(start: int, end: int) -> torch.Tensor:
    """`[1, 1, end - start, 2]` keys whose value is their position."""
    return torch.arange(start, end, dtype=torch.float32)[None, None, :, None].expand(1, 1, -1, 2).clone()


def base_layer(tokens: int) -> BaseLayer:
    keys = (marked(0, tokens), marked(0, tokens))
    return BaseLayer(PrefixKey("base"), tuple(range(tokens)), keys, keys)


def turn(working_cache: object, start: int, count: int) -> None:
    for layer in working_cache.prealloc_layers:  # type: ignore[attr-defined]
        layer.update(marked(start, start + count), marked(start, start + count))


def cache_after(turn_lengths: list[int], base_tokens: int = 2) -> SessionCache:
    """A cache built turn by turn through working caches, as the engine does."""
    base = base_layer(base_tokens)
    cache = SessionCache.empty(base, 2, torch.empty(1, 1, 0, 2), WINDOWS)
    for index, count in enumerate(turn_lengths):
        working = cache.to_working_cache(count)
        start = cache.next_position
        turn(working, start, count)
        span = LayerSpan(LayerKind.TURN, index, count, start, start)
        cache = cache.after_turn(working, list(range(start, start + count)), [span])
    return cache


def test_a_sliding_layer_keeps_the_last_window_minus_one_positions_after_each_turn() -> None:
    cache = cache_after([2])
    assert positions(cache.own_keys[0]) == [2, 3]
    assert positions(cache.own_keys[1]) == [2, 3]  # shorter than the window: every own token
    cache = cache_after([2, 5])
    assert positions(cache.own_keys[0]) == [2, 3, 4, 5, 6, 7, 8]
    assert positions(cache.own_keys[1]) == [6, 7, 8]
    assert cache.own_nbytes == (7 + 3) * 2 * 2 * 4


def test_a_tail_that_starts_at_the_base_takes_the_bases_last_tokens_into_the_working_cache() -> None:
    short = cache_after([1], base_tokens=5)
    working = short.to_working_cache(1)
    full, sliding = working.prealloc_layers
    assert positions(full.filled_keys) == [0, 1, 2, 3, 4, 5]
    assert positions(sliding.filled_keys) == [3, 4, 5]  # W - 1 = 3 positions before the next
    assert sliding.next_position == full.next_position == 6
    assert short.working_nbytes(1) == (6 + 1 + 3 + 1) * 2 * 2 * 4
    longer = cache_after([1, 4], base_tokens=5)
    assert positions(longer.to_working_cache(1).prealloc_layers[1].filled_keys) == [7, 8, 9]


def test_a_fork_reuses_the_tail_only_while_it_holds_the_fork_points_window() -> None:
    cache = cache_after([2, 1])  # positions: base 0-1, turn 0 at 2-3, turn 1 at 4
    prefix = cache.prefix(4, transcript_digest="t", rendering_digest="r")
    assert prefix is not None
    assert positions(prefix.own_keys[0]) == [2, 3] and positions(prefix.own_keys[1]) == [2, 3]
    moved_on = cache_after([2, 6])  # the tail holds 5..7 now; the window at 4 was 1..3
    assert moved_on.prefix(4, transcript_digest="t", rendering_digest="r") is None


def test_a_short_last_turn_keeps_the_window_of_its_start_so_regenerating_it_forks_warm() -> None:
    cache = cache_after([2, 5, 2])  # turn 1 at 4..8, turn 2 (2 tokens, at most W - 1) at 9..10
    assert positions(cache.own_keys[1]) == [6, 7, 8, 9, 10]  # the window at 9 (6..8) and after
    prefix = cache.prefix(9, transcript_digest="t", rendering_digest="r")
    assert prefix is not None and positions(prefix.own_keys[1]) == [6, 7, 8]
    assert cache.prefix(4, transcript_digest="t", rendering_digest="r") is None
    working = cache.to_working_cache(1)
    assert positions(working.prealloc_layers[1].filled_keys) == [6, 7, 8, 9, 10]  # the attention slices


def test_the_tensors_round_trip_with_each_layers_own_length_and_the_models_windows_only() -> None:
    cache = cache_after([2, 5])
    tensors, header = session_cache_to_tensors(cache)
    assert header["windows"] == [None, 4]
    back = session_cache_from_tensors(tensors, header, "cpu", WINDOWS)
    assert [positions(k) for k in back.own_keys] == [positions(k) for k in cache.own_keys]
    assert back.windows == WINDOWS
    with pytest.raises(MalformedCache, match=r"layer windows \[None, 4\] are not the model's \[None, 8\]"):
        session_cache_from_tensors(tensors, header, "cpu", (None, 8))
    with pytest.raises(MalformedCache, match="predates per-layer attention kinds"):
        session_cache_from_tensors(tensors, {**header, "format_version": 2}, "cpu", WINDOWS)


@pytest.mark.parametrize(
    ("keys", "values", "what"),
    [
        (3, 3, "holds 3 own keys and 3 values"),  # more than its 2 own positions
        (1, 1, "holds 1 own keys and 1 values"),  # less than its window (or its positions): attends to less
        (2, 1, "holds 2 own keys and 1 values"),
    ],
)
def test_a_cache_whose_sliding_layer_has_the_wrong_length_is_refused(keys: int, values: int, what: str) -> None:
    cache = cache_after([2])  # two own positions, a window of 4: the tail must hold exactly 2
    with pytest.raises(RuntimeError, match=f"model layer 1 {what}"):
        SessionCache(
            base_key=cache.base_key,
            base_token_ids=cache.base_token_ids,
            own_keys=(cache.own_keys[0], marked(2, 2 + keys)),
            own_values=(cache.own_values[0], marked(2, 2 + values)),
            own_token_ids=cache.own_token_ids,
            layers=cache.layers,
            windows=WINDOWS,
        )
