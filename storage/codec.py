"""Cache bytes at rest: safetensors (never pickle) with the cache header in its metadata.

safetensors stores tensors as raw little-endian bytes behind a JSON header, so decoding runs no
code and an exact tensor comes back bit-identical, in its own dtype. The chatkv header (format
version, model fingerprint, token ids, layer table) travels as one JSON string under the
metadata key `chatkv`.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from storage.errors import StorageError

METADATA_KEY = "chatkv"


class CodecError(StorageError):
    """The bytes are not a chatkv safetensors payload."""


def encode(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> bytes:
    """safetensors bytes of `tensors` with `header` (JSON-able) in the metadata."""
    return save(tensors, metadata={METADATA_KEY: json.dumps(header, separators=(",", ":"))})


def decode(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and header of a payload from `encode`. Raises `CodecError` on any malformation."""
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
