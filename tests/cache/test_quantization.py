"""int8 and int4 (KIVI) quantisation, and which tokens a lossy offload quantises."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cache.quantization import dequantize, quantize
from cache.serialization import MalformedCache, session_cache_from_tensors, session_cache_to_tensors
from tests.cache.helpers import make_cache


@pytest.mark.parametrize("tokens", [1, 31, 32, 77])
@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("is_key", [True, False])
def test_round_trip_error_is_bounded_by_half_a_step(tokens: int, precision: str, is_key: bool) -> None:
    torch.manual_seed(tokens)
    x = torch.randn(1, 3, tokens, 64) * 4
    x[..., 5] += 20  # an outlier channel, as keys have
    q = quantize(x, precision, is_key=is_key)
    restored = dequantize(q, torch.float32)
    assert restored.shape == x.shape and restored.dtype == torch.float32
    # Each group's step is its range / levels; the error is at most half a step (plus rounding).
    levels = 254.0 if precision == "int8" else 15.0
    span = (x.amax() - x.amin()) if precision == "int4" else 2 * x.abs().amax()
    assert float((restored - x).abs().max()) <= float(span) / levels / 2 * 1.001
    padded_tokens = -(-tokens // 32) * 32 if precision == "int4" and is_key else tokens
    element = 1.0 if precision == "int8" else 0.5
    assert q.codes.numel() == x.numel() // tokens * padded_tokens * element


def test_int4_keys_are_grouped_per_channel_and_values_per_token() -> None:
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 64, 64)
    keys[..., 7] *= 50  # per-channel grouping isolates this outlier channel
    per_channel = dequantize(quantize(keys, "int4", is_key=True), torch.float32)
    per_token = dequantize(quantize(keys, "int4", is_key=False), torch.float32)
    calm = [c for c in range(64) if c != 7]
    assert (per_channel - keys)[..., calm].abs().mean() < (per_token - keys)[..., calm].abs().mean() / 4


def test_int4_offload_quantises_whole_token_groups_only() -> None:
    cache = make_cache([50, 40])
    tensors, header = session_cache_to_tensors(cache, "int4", residual_tokens=10)
    assert [tuple(r) for r in header["lossy_ranges"]] == [(0, 64)]  # 80 candidates -> 2 groups of 32
    restored = session_cache_from_tensors(tensors, header, "cpu")
    assert torch.equal(restored.own_values[0][:, :, 64:], cache.own_values[0][:, :, 64:])


def test_unknown_precision_is_rejected() -> None:
    with pytest.raises(ValueError, match="precision"):
        quantize(torch.zeros(1, 1, 1, 32), "int2", is_key=True)


def test_exact_serialization_is_bit_identical_in_every_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cache = make_cache([5, 6], dtype=dtype)
        tensors, header = session_cache_to_tensors(cache)
        restored = session_cache_from_tensors(tensors, header, "cpu")
        assert restored.layers == cache.layers and restored.own_token_ids == cache.own_token_ids
        assert restored.base is None and restored.base_key == cache.base_key
        for a, b in zip((*restored.own_keys, *restored.own_values), (*cache.own_keys, *cache.own_values), strict=True):
            assert a.dtype == dtype and torch.equal(a, b)
        # The base travels as a reference only.
        assert sum(t.numel() for t in tensors.values()) == sum(t.numel() for t in (*cache.own_keys, *cache.own_values))


@pytest.mark.parametrize("precision", ["exact", "int8"])
def test_serialization_keeps_the_digests_that_decide_reuse(precision: str) -> None:
    cache = replace(make_cache([40]), transcript_digest="t" * 64, rendering_digest="r" * 64)
    tensors, header = session_cache_to_tensors(cache, precision)
    restored = session_cache_from_tensors(tensors, header, "cpu")
    assert (restored.transcript_digest, restored.rendering_digest) == ("t" * 64, "r" * 64)
    # A blob written before the rendering digest existed: unknown, so the turn runner rebuilds.
    del header["rendering_digest"]
    assert session_cache_from_tensors(tensors, header, "cpu").rendering_digest == ""


def test_lossy_offload_keeps_pinned_turns_and_recent_tokens_exact() -> None:
    cache = make_cache([20, 30, 40], pinned=frozenset({0}))
    tensors, header = session_cache_to_tensors(cache, "int8", residual_tokens=10)
    assert header["lossy_ranges"] == [[20, 80]] or header["lossy_ranges"] == [(20, 80)]
    restored = session_cache_from_tensors(tensors, header, "cpu")
    for a, b in zip(restored.own_keys, cache.own_keys, strict=True):
        assert torch.equal(a[:, :, :20], b[:, :, :20])  # pinned turn 0 (base layer): exact
        assert torch.equal(a[:, :, 80:], b[:, :, 80:])  # the 10 most recent tokens: exact
        assert not torch.equal(a[:, :, 20:80], b[:, :, 20:80])
        torch.testing.assert_close(a[:, :, 20:80], b[:, :, 20:80], atol=0.05, rtol=0.02)
    assert [span.precision for span in restored.layers] == ["exact", "int8", "int8"]
    exact_bytes = sum(t.numel() * t.element_size() for t in session_cache_to_tensors(cache)[0].values())
    lossy_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert lossy_bytes < exact_bytes * 0.55


def test_malformed_payloads_are_rejected() -> None:
    cache = make_cache([5])
    tensors, header = session_cache_to_tensors(cache)
    with pytest.raises(MalformedCache):
        session_cache_from_tensors({}, header, "cpu")
    with pytest.raises(MalformedCache):
        session_cache_from_tensors(tensors, {**header, "format_version": 99}, "cpu")
    with pytest.raises(MalformedCache):
        session_cache_from_tensors(tensors, {**header, "own_token_ids": [1, 2]}, "cpu")


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_scales_are_float16_unless_values_are_too_large_for_it(precision: str) -> None:
    small = quantize(torch.randn(1, 2, 32, 64), precision, is_key=True)
    assert small.scale.dtype == torch.float16
    huge = torch.randn(1, 2, 32, 64) * 1e7
    q = quantize(huge, precision, is_key=True)
    assert q.scale.dtype == torch.float32
    restored = dequantize(q, torch.float32)
    assert torch.isfinite(restored).all()
    assert float((restored - huge).abs().max()) <= float(huge.abs().max()) / 7
