"""Cache bytes at rest: safetensors (never pickle) with the cache header in its metadata.

safetensors stores tensors as raw little-endian bytes behind a JSON header, so decoding runs no
code and an exact tensor comes back bit-identical, in its own dtype. The chatkv header (format
version, model fingerprint, token ids, layer table) travels as one JSON string under the
metadata key `chatkv`.

Decoding reads the safetensors layout itself so that the tensors can be views of the payload
buffer: a chunked blob is decrypted into one buffer (`storage.chunked_blobs.payload_buffer`), and its
tensors are made without copying it again (safetensors' own loader copies every tensor: one more
pass over a 90 MB cache, which on a loaded machine costs as much as its decryption).
"""

from __future__ import annotations

import json
import math
import mmap
import struct
import sys
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from storage.errors import StorageError

METADATA_KEY = "chatkv"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CodecError(StorageError):
    """The bytes are not a chatkv safetensors payload."""


def encode(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> bytes:
    """safetensors bytes of `tensors` with `header` (JSON-able) in the metadata."""
    return save(tensors, metadata={METADATA_KEY: json.dumps(header, separators=(",", ":"))})


def decode(data: bytes | bytearray | mmap.mmap) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and header of a payload from `encode`. Raises `CodecError` on any malformation.

    A `bytearray` or writable `mmap` (`storage.chunked_blobs.payload_buffer`) is decoded in place:
    its tensors are views of it (they keep it alive, and writing to one writes to it). `bytes` are
    copied once into a `bytearray` first.
    """
    if sys.byteorder != "little":  # frombuffer reads native order; safetensors' loader swaps bytes
        return _decode_copying(bytes(data))
    buffer = data if isinstance(data, bytearray | mmap.mmap) else bytearray(data)
    try:
        (length,) = struct.unpack_from("<Q", buffer, 0)
        if length > len(buffer) - 8:
            raise CodecError(f"header length {length} exceeds the payload ({len(buffer)} bytes)")
        table = json.loads(bytes(buffer[8 : 8 + length]))
        header = json.loads((table.pop("__metadata__", None) or {})[METADATA_KEY])
        tensors = {name: _tensor(buffer, 8 + length, spec) for name, spec in table.items()}
    except (struct.error, ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CodecError(f"not a chatkv cache payload: {exc}") from exc
    if not isinstance(header, dict):
        raise CodecError("the chatkv header is not an object")
    return tensors, header


def _tensor(buffer: bytearray | mmap.mmap, data_start: int, spec: dict[str, Any]) -> torch.Tensor:
    """The tensor `spec` (safetensors: dtype, shape, data offsets from `data_start`) as a view of `buffer`."""
    dtype = _DTYPES[spec["dtype"]]
    shape = [int(size) for size in spec["shape"]]
    begin, end = (int(offset) for offset in spec["data_offsets"])
    count = math.prod(shape)
    if min(shape, default=0) < 0 or not 0 <= begin <= end <= len(buffer) - data_start:
        raise CodecError(f"tensor bytes {begin}..{end} outside the payload's {len(buffer) - data_start}")
    if end - begin != count * dtype.itemsize:
        raise CodecError(f"tensor of shape {shape} and {dtype} in {end - begin} bytes")
    if count == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses a count of 0
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=data_start + begin).view(shape)


def _decode_copying(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """`decode` by safetensors' own loader (copies every tensor; swaps bytes on big-endian hosts)."""
    try:
        (length,) = struct.unpack_from("<Q", data, 0)
        if length > len(data) - 8:
            raise CodecError(f"header length {length} exceeds the payload ({len(data)} bytes)")
        meta = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
        header = json.loads(meta[METADATA_KEY])
        tensors = load(data)
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, KeyError, SafetensorError) as exc:
        raise CodecError(f"not a chatkv cache payload: {exc}") from exc
    if not isinstance(header, dict):
        raise CodecError("the chatkv header is not an object")
    return tensors, header
