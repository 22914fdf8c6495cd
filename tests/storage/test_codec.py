"""The cache codec: safetensors bytes plus the chatkv header, bit-identical in each dtype, and a
clear `CodecError` (never a crash or pickle) for anything else."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from storage.codec import CodecError, decode, encode

HEADER = {"format_version": 1, "model_fingerprint": "fp", "own_token_ids": [1, 2, 3], "layers": []}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_identical(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    keys = (torch.randn(1, 2, 7, 16, generator=generator) * 100).to(dtype)
    values = torch.randn(1, 2, 7, 16, generator=generator).to(dtype)
    # Values a lossy path would change: signed zero, subnormal-ish and extreme magnitudes, NaN, inf.
    keys[0, 0, 0, :5] = torch.tensor([-0.0, 1e-30, 6e4, float("nan"), float("-inf")]).to(dtype)
    tensors, header = decode(encode({"k.0": keys, "v.0": values}, HEADER))
    assert header == HEADER
    assert set(tensors) == {"k.0", "v.0"}
    for name, original in (("k.0", keys), ("v.0", values)):
        assert tensors[name].dtype == dtype
        assert tensors[name].shape == original.shape
        # Compare the raw bits: NaN != NaN and -0.0 == 0.0 would hide a difference.
        assert torch.equal(
            tensors[name].view(torch.int16 if dtype != torch.float32 else torch.int32),
            original.view(torch.int16 if dtype != torch.float32 else torch.int32),
        )


def test_integer_tensors_round_trip() -> None:
    codes = torch.randint(-128, 127, (1, 2, 5, 8), dtype=torch.int8)
    tensors, _ = decode(encode({"kq.0.codes": codes}, HEADER))
    assert torch.equal(tensors["kq.0.codes"], codes)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x00" * 7,
        b"garbage that is not safetensors at all",
        struct.pack("<Q", 2**40) + b"{}",
        struct.pack("<Q", 5) + b"notjs",
        struct.pack("<Q", 2) + b"{}",  # valid safetensors, no chatkv header
    ],
    ids=["empty", "short", "text", "huge-header-length", "bad-json", "no-chatkv-header"],
)
def test_garbage_is_rejected_with_codec_error(payload: bytes) -> None:
    with pytest.raises(CodecError):
        decode(payload)


def test_a_header_that_is_not_an_object_is_rejected() -> None:
    data = encode({"k.0": torch.zeros(1)}, {"x": 1})
    length = struct.unpack_from("<Q", data)[0]
    meta = json.loads(data[8 : 8 + length])
    meta["__metadata__"]["chatkv"] = json.dumps([1, 2, 3])
    raw = json.dumps(meta).encode()
    raw += b" " * (length - len(raw)) if len(raw) <= length else b""
    forged = struct.pack("<Q", len(raw)) + raw + data[8 + length :]
    with pytest.raises(CodecError, match="not an object"):
        decode(forged)


def test_truncated_tensor_bytes_are_rejected() -> None:
    data = encode({"k.0": torch.ones(1, 2, 9, 16)}, HEADER)
    with pytest.raises(CodecError):
        decode(data[:-10])


def test_a_bytearray_is_decoded_in_place_and_bytes_are_copied_once() -> None:
    keys, ids = torch.randn(1, 2, 5, 8).to(torch.bfloat16), torch.arange(10, dtype=torch.int32)
    data = encode({"k.0": keys, "idx.0": ids, "empty.0": torch.zeros(0, 3)}, HEADER)
    buffer = bytearray(data)
    tensors, _ = decode(buffer)
    assert torch.equal(tensors["k.0"], keys) and torch.equal(tensors["idx.0"], ids)
    assert tensors["empty.0"].shape == (0, 3)
    start = buffer.find(ids.numpy().tobytes())
    buffer[start : start + 4] = (99).to_bytes(4, "little")  # a view of the buffer: no copy was made
    assert int(tensors["idx.0"][0]) == 99
    copied, _ = decode(data)
    assert torch.equal(copied["idx.0"], ids)


def test_tensor_offsets_outside_the_payload_or_of_the_wrong_size_are_rejected() -> None:
    data = encode({"k.0": torch.ones(4)}, HEADER)
    length = struct.unpack_from("<Q", data)[0]
    table = json.loads(data[8 : 8 + length])
    for offsets in ([0, 12], [0, 1 << 40], [8, 4]):
        table["k.0"]["data_offsets"] = offsets
        raw = json.dumps(table).encode()
        with pytest.raises(CodecError):
            decode(struct.pack("<Q", len(raw)) + raw + data[8 + length :])
