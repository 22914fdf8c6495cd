"""`PreallocatedLayer`: in-place writes, and `keys`/`values` as views of the filled part."""

from __future__ import annotations

import pytest
import torch

from cache.working_cache import PreallocatedLayer


def layer_with(tokens: int, capacity: int) -> PreallocatedLayer:
    keys = torch.arange(2 * capacity * 4, dtype=torch.float32).reshape(1, 2, capacity, 4)
    return PreallocatedLayer(keys.clone(), -keys.clone(), tokens)


def test_append_writes_after_the_filled_part_and_keys_values_show_it() -> None:
    layer = layer_with(tokens=3, capacity=8)
    new_keys = torch.full((1, 2, 2, 4), 7.0)
    layer.append(new_keys, -new_keys)
    assert layer.get_seq_length() == 5
    assert layer.keys.shape == (1, 2, 5, 4)
    assert torch.equal(layer.keys[:, :, 3:], new_keys)
    assert torch.equal(layer.values[:, :, 3:], -new_keys)
    assert layer.keys.data_ptr() == layer.filled_keys.data_ptr()  # a view of the buffer, no copy


def test_update_returns_the_filled_keys_and_values_including_the_new_ones() -> None:
    layer = layer_with(tokens=2, capacity=4)
    new_keys = torch.ones(1, 2, 1, 4)
    keys, values = layer.update(new_keys, -new_keys, 0)
    assert keys.shape == values.shape == (1, 2, 3, 4)
    assert torch.equal(keys[:, :, 2:], new_keys)


def test_append_past_the_capacity_grows_the_buffer_and_keeps_the_filled_part() -> None:
    layer = layer_with(tokens=3, capacity=3)
    before = layer.keys.clone()
    layer.append(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    assert layer.get_seq_length() == 5
    assert torch.equal(layer.keys[:, :, :3], before)


def test_crop_shortens_the_views() -> None:
    layer = layer_with(tokens=5, capacity=8)
    layer.crop(-2)
    assert layer.keys.shape[2] == layer.values.shape[2] == 3


def test_assigning_keys_or_values_is_refused_since_they_are_views_of_the_buffer() -> None:
    layer = layer_with(tokens=2, capacity=4)
    with pytest.raises(AttributeError, match=r"PreallocatedLayer\.keys is a view"):
        layer.keys = torch.zeros(1, 2, 2, 4)
    with pytest.raises(AttributeError, match=r"PreallocatedLayer\.values is a view"):
        layer.values = torch.zeros(1, 2, 2, 4)
