"""RoPE re-rotation: keys moved by rotation equal keys the model computes at the new positions."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from cache.rope import RopeLayout, rope_layout, rotate_keys, rotation_supported
from sessions.engine import Engine

THETA = 10000.0
# model_type, rope_parameters, extra config: one per attention family `rope_layout` knows, and
# the llama3 / linear variants. head_dim 16 everywhere.
ROTATED_FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "llama": ("llama", {"rope_type": "default"}, {}),
    "llama-linear": ("llama", {"rope_type": "linear", "factor": 2.0}, {}),
    "llama3": (
        "llama",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        {},
    ),
    "mistral": ("mistral", {"rope_type": "default"}, {}),
    "qwen2": ("qwen2", {"rope_type": "default"}, {}),
    "qwen3": ("qwen3", {"rope_type": "default"}, {"head_dim": 16}),
    "phi": ("phi", {"rope_type": "default", "partial_rotary_factor": 0.5}, {}),
    "phi3-partial": ("phi3", {"rope_type": "default", "partial_rotary_factor": 0.5}, {}),
    "stablelm": ("stablelm", {"rope_type": "default", "partial_rotary_factor": 0.25}, {}),
    "gpt_neox": ("gpt_neox", {"rope_type": "default", "partial_rotary_factor": 0.25}, {}),
    "glm": ("glm", {"rope_type": "default", "partial_rotary_factor": 0.5}, {"head_dim": 16}),
    "cohere": ("cohere", {"rope_type": "default"}, {}),
}
# (rotary_dim, interleaved) each family must get: what its attention code does.
EXPECTED_LAYOUT = {
    "phi": (8, False),
    "phi3-partial": (8, False),
    "stablelm": (4, False),
    "gpt_neox": (4, False),
    "glm": (8, True),
    "cohere": (16, True),
}


def tiny_model(model_type: str, rope_parameters: dict[str, Any], num_hidden_layers: int = 2, **extra: Any) -> Any:
    """A model of `model_type` with random weights: hidden 64, 4 heads of 16 channels."""
    config = AutoConfig.for_model(
        model_type,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters={"rope_theta": THETA, **rope_parameters},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@torch.inference_mode()
def keys_at(model: Any, token_ids: list[int], first_position: int) -> list[torch.Tensor]:
    """Per model layer `[1, kv_heads, len(token_ids), head_dim]`: the keys the model caches for
    `token_ids` at positions `first_position, first_position + 1, ...`."""
    cache = DynamicCache(config=model.config)
    positions = torch.arange(len(token_ids)).unsqueeze(0) + first_position
    model(input_ids=torch.tensor([token_ids]), position_ids=positions, cache=cache, use_cache=True)
    return [layer.keys.clone() for layer in cache.layers]


@pytest.mark.parametrize("family", list(ROTATED_FAMILIES))
def test_rotated_keys_equal_the_models_own_keys_at_the_new_positions(family: str) -> None:
    model_type, rope_parameters, extra = ROTATED_FAMILIES[family]
    model = tiny_model(model_type, rope_parameters, **extra)
    layout = rope_layout(model)
    assert layout is not None
    assert (layout.rotary_dim, layout.interleaved) == EXPECTED_LAYOUT.get(family, (16, False))
    ids = list(range(3, 15))
    far, near = keys_at(model, ids, 50), keys_at(model, ids, 10)
    for at_far, at_near in zip(far, near, strict=True):
        # float32 rounding only: measured max abs error 3e-8 .. 2.4e-6 (qwen3, keys up to 3.1).
        torch.testing.assert_close(rotate_keys(at_far, 40, layout), at_near, atol=1e-5, rtol=1e-5)
    # The test tells the layouts apart: unrotated keys, or the other channel pairing, are far off
    # (0.6 .. 5 on keys of magnitude 0.4 .. 3).
    scale = float(near[0].abs().max())
    assert float((far[0] - near[0]).abs().max()) > 0.5 * scale
    other_pairing = replace(layout, interleaved=not layout.interleaved)
    assert float((rotate_keys(far[0], 40, other_pairing) - near[0]).abs().max()) > 0.5 * scale
    # Partial rotary: the channels after rotary_dim carry no position.
    assert torch.equal(far[0][..., layout.rotary_dim :], near[0][..., layout.rotary_dim :])


@pytest.mark.parametrize(
    ("model_type", "rope_parameters", "extra"),
    [
        pytest.param("smollm3", {"rope_type": "default"}, {}, id="smollm3-layers-without-rope"),
        pytest.param("cohere2", {"rope_type": "default"}, {}, id="cohere2-layers-without-rope"),
        pytest.param("gemma3_text", {"rope_type": "default"}, {"head_dim": 16}, id="gemma3-rope-per-layer-type"),
        pytest.param("gpt2", {}, {}, id="gpt2-no-rope"),
        pytest.param("llama", {"rope_type": "dynamic", "factor": 2.0}, {}, id="llama-dynamic"),
        pytest.param("llama", {"rope_type": "yarn", "factor": 2.0}, {}, id="llama-yarn"),
    ],
)
def test_layouts_that_are_not_known_to_rotate_are_left_to_re_prefill(
    model_type: str, rope_parameters: dict[str, Any], extra: dict[str, Any]
) -> None:
    assert rope_layout(tiny_model(model_type, rope_parameters, num_hidden_layers=4, **extra)) is None


def test_a_partial_rotary_factor_the_rotary_embedding_ignores_is_left_to_re_prefill() -> None:
    # Cohere's default RoPE covers the whole head whatever the factor says: the config and the
    # frequencies disagree about which channels rotate, so nothing is assumed.
    model = tiny_model("cohere", {"rope_type": "default", "partial_rotary_factor": 0.5})
    assert rope_layout(model) is None


@pytest.mark.real_model
def test_rotated_keys_equal_keys_computed_at_the_new_positions(real_engine: Engine) -> None:
    layout = real_engine.rope_layout
    assert layout is not None and layout.rotary_dim == layout.head_dim  # SmolLM2: Llama, default RoPE
    ids = real_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2, add_special_tokens=False)
    shift = 64
    moved = keys_at(real_engine.model, ids, shift)
    direct = keys_at(real_engine.model, ids, 0)
    for at_shift, at_zero in zip(moved, direct, strict=True):
        rotated = rotate_keys(at_shift, shift, layout)
        # Every model layer matches because the whole sequence moved (attention only sees relative
        # positions). float32 rounding: the model's own RoPE angles and 30 model layers of attention
        # in another summation order; measured here: max abs error 1.7e-5 on keys of magnitude up
        # to 19. A window that drops a turn is different: see docs/architecture.md.
        torch.testing.assert_close(rotated, at_zero, atol=2e-5, rtol=1.3e-6)
    # Without the rotation the keys are far apart: the test is sensitive to the rotation itself.
    assert float((moved[-1] - direct[-1]).abs().max()) > 1.0


@pytest.mark.real_model
def test_large_shifts_are_exact_up_to_the_models_own_float32_angles(real_engine: Engine) -> None:
    """transformers computes RoPE angles `position * inv_freq` in float32, so its keys at position
    p carry an angle error of about one float32 ulp of p; the rotation (float64 angles) is within
    that of the keys computed directly, however far it moves them."""
    layout = real_engine.rope_layout
    assert layout is not None
    ids = real_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2, add_special_tokens=False)
    shift = 1500
    moved = keys_at(real_engine.model, ids, shift)
    direct = keys_at(real_engine.model, ids, 0)
    for at_shift, at_zero in zip(moved, direct, strict=True):
        rotated = rotate_keys(at_shift, shift, layout)
        angle_ulp = float(torch.finfo(torch.float32).eps) * (shift + len(ids))
        tolerance = 2 * angle_ulp * float(at_zero.abs().max())
        assert float((rotated - at_zero).abs().max()) <= tolerance


INV_FREQ = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))  # rotary_dim 8


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(RopeLayout(torch.cat([INV_FREQ, INV_FREQ / 7]), 16), id="half"),
        pytest.param(RopeLayout(INV_FREQ, 16), id="half-partial"),
        pytest.param(RopeLayout(INV_FREQ, 16, interleaved=True), id="interleaved-partial"),
    ],
)
def test_rotation_composes_and_zero_shift_is_identity(layout: RopeLayout) -> None:
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 5, 16)
    assert rotate_keys(keys, 0, layout) is keys
    torch.testing.assert_close(rotate_keys(rotate_keys(keys, 7, layout), 5, layout), rotate_keys(keys, 12, layout))
    torch.testing.assert_close(rotate_keys(rotate_keys(keys, 9, layout), -9, layout), keys)
    moved = rotate_keys(keys, 3, layout)
    assert torch.equal(moved[..., layout.rotary_dim :], keys[..., layout.rotary_dim :])
    # A rotation: each pair keeps its length.
    torch.testing.assert_close(moved.norm(dim=-1), keys.norm(dim=-1))
    assert rotate_keys(keys.to(torch.bfloat16), 3, layout).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="channels per head"):
        rotate_keys(keys[..., :8], 1, layout)


def test_layout_rejects_frequencies_that_do_not_fit_the_head() -> None:
    with pytest.raises(ValueError, match="head_dim is 4"):
        RopeLayout(INV_FREQ, 4)
    with pytest.raises(ValueError, match="1-D float"):
        RopeLayout(INV_FREQ[:0], 16)
    with pytest.raises(ValueError, match="1-D float"):
        RopeLayout(torch.arange(4), 16)


def test_only_composable_rope_variants_are_rotated() -> None:
    assert rotation_supported("default") and rotation_supported("linear") and rotation_supported("llama3")
    assert not rotation_supported("dynamic")
    assert not rotation_supported("yarn")
    assert not rotation_supported("longrope")
    assert not rotation_supported(None)
    assert not rotation_supported("default", attention_scaling=1.2)
