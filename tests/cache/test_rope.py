"""RoPE re-rotation: keys moved by rotation equal keys the model computes at the new positions."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from cache.rope import rotate_keys, rotation_supported
from sessions.engine import Engine


@torch.inference_mode()
def keys_at(engine: Engine, token_ids: list[int], first_position: int) -> list[torch.Tensor]:
    cache = DynamicCache(config=engine.model.config)
    positions = torch.arange(len(token_ids)).unsqueeze(0) + first_position
    engine.model(input_ids=torch.tensor([token_ids]), position_ids=positions, cache=cache, use_cache=True)
    return [layer.keys.clone() for layer in cache.layers]


@pytest.mark.real_model
def test_rotated_keys_equal_keys_computed_at_the_new_positions(real_engine: Engine) -> None:
    assert real_engine.rope_inv_freq is not None  # SmolLM2 uses the default RoPE
    ids = real_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2, add_special_tokens=False)
    shift = 64
    moved = keys_at(real_engine, ids, shift)
    direct = keys_at(real_engine, ids, 0)
    for at_shift, at_zero in zip(moved, direct, strict=True):
        rotated = rotate_keys(at_shift, shift, real_engine.rope_inv_freq)
        # float32 rounding: the model's own RoPE angles and 30 model layers of attention in another
        # summation order; measured here: max abs error 1.7e-5 on keys of magnitude up to 19.
        torch.testing.assert_close(rotated, at_zero, atol=2e-5, rtol=1.3e-6)
    # Without the rotation the keys are far apart: the test is sensitive to the rotation itself.
    assert float((moved[-1] - direct[-1]).abs().max()) > 1.0


@pytest.mark.real_model
def test_large_shifts_are_exact_up_to_the_models_own_float32_angles(real_engine: Engine) -> None:
    """transformers computes RoPE angles `position * inv_freq` in float32, so its keys at position
    p carry an angle error of about one float32 ulp of p; the rotation (float64 angles) is within
    that of the keys computed directly, however far it moves them."""
    assert real_engine.rope_inv_freq is not None
    ids = real_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2, add_special_tokens=False)
    shift = 1500
    moved = keys_at(real_engine, ids, shift)
    direct = keys_at(real_engine, ids, 0)
    for at_shift, at_zero in zip(moved, direct, strict=True):
        rotated = rotate_keys(at_shift, shift, real_engine.rope_inv_freq)
        angle_ulp = float(torch.finfo(torch.float32).eps) * (shift + len(ids))
        tolerance = 2 * angle_ulp * float(at_zero.abs().max())
        assert float((rotated - at_zero).abs().max()) <= tolerance


def test_rotation_composes_and_zero_shift_is_identity() -> None:
    torch.manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    keys = torch.randn(1, 2, 5, 16)
    assert rotate_keys(keys, 0, inv_freq) is keys
    torch.testing.assert_close(
        rotate_keys(rotate_keys(keys, 7, inv_freq), 5, inv_freq), rotate_keys(keys, 12, inv_freq)
    )
    torch.testing.assert_close(rotate_keys(rotate_keys(keys, 9, inv_freq), -9, inv_freq), keys)
    assert rotate_keys(keys.to(torch.bfloat16), 3, inv_freq).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="head_dim"):
        rotate_keys(keys, 1, inv_freq[:4])


def test_only_composable_rope_variants_are_rotated() -> None:
    assert rotation_supported("default") and rotation_supported("linear") and rotation_supported("llama3")
    assert not rotation_supported("dynamic")
    assert not rotation_supported("yarn")
    assert not rotation_supported("longrope")
    assert not rotation_supported(None)
    assert not rotation_supported("default", attention_scaling=1.2)
