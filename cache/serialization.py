"""Session caches and base layers as flat tensor dicts plus a JSON-able header.

The storage codec turns these into safetensors bytes; nothing here does I/O. Exact tensors keep the
model's dtype, so an exact round trip is bit-identical. With a lossy `precision`, the tokens of
unpinned turn layers are quantised (`cache.quantization`) except the most recent
`residual_tokens`; pinned turns (the base layer) always stay exact.

Tensor names, per model layer `l`:
    k.{l} / v.{l}                      exact tokens `[1, kv_heads, n_exact, head_dim]`
    kq.{l}.codes|scale|zero / vq.{l}.* quantised tokens (see `Quantized`)
    idx.{l}                            int32 `[kv_heads, own_tokens]`: the stream index each head
                                       holds, once tokens were evicted (`own_stream_index`)

A ragged model layer (per-head budgets, `SessionCache.own_head_tokens`) stores its heads' slots one
after another, `k.{l}` `[1, 1, n_0 + ... + n_{h-1}, head_dim]` and `idx.{l}` `[1, n_0 + ...]`, with
the counts in the header (`head_tokens`): the bytes of the tokens it holds, no padding. A lossy
precision applies to its unpinned slots older than each head's last `residual_tokens`
(`lossy_ranges_by_layer`, over its flat slots).

A sliding-window model layer (`SessionCache.windows`) stores its tail, `[1, kv_heads, n_l,
head_dim]` with its own `n_l <= W - 1`, always exact (a lossy precision applies to the full layers'
unpinned turn tokens only; a tail is at most W - 1 tokens).

Format versions: 2 added `idx.{l}` and each layer's `evicted_tokens`; 3 added `windows` (each model
layer's sliding window or null) and per-layer lengths; 4 added ragged layers (`head_tokens`).
Version-1 and -2 blobs still decode for a model whose every layer is full attention; for a model
with sliding layers they are rejected (their KV was computed by an attention that saw past the
windows) and the session rebuilds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from cache.errors import CacheError
from cache.ids import PrefixKey
from cache.layer_table import LayerSpan, pinned_stream_mask, tokens_per_span
from cache.quantization import Quantized, dequantize, int4_token_multiple, quantize
from cache.session_cache import BaseLayer, SessionCache
from cache.token_eviction import evictable_per_head

FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
_LAYER_WINDOW_VERSIONS = (3, 4)
"""Versions that record each model layer's attention kind (needed for a model with sliding layers)."""
_DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16)}


class MalformedCache(CacheError):
    """Tensors and header do not describe a valid cache (wrong names, shapes or version)."""


PIN_MIN_BYTES = 1 << 20
"""Host tensors at least this large are copied to a CUDA device through pinned memory."""


def pins_for_copy(device_type: str, nbytes: int) -> bool:
    """Whether a decoded host tensor of `nbytes` goes to a `device_type` device through pinned
    (page-locked) memory: only to CUDA, and only for tensors of a MiB or more, where an
    asynchronous DMA copy beats the driver's staged copy of pageable memory and the pinning copy's
    own cost is amortised; small tensors are copied directly."""
    return device_type == "cuda" and nbytes >= PIN_MIN_BYTES


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` (on the host, decoded from a tier's bytes) on `device`. To CUDA, large tensors are
    pinned and copied asynchronously on the current stream (kernels that read them later on that
    stream are ordered after the copy; torch's pinned allocator keeps the source until it is done)."""
    target = torch.device(device)
    if tensor.device.type == "cpu" and pins_for_copy(target.type, tensor.numel() * tensor.element_size()):
        return tensor.pin_memory().to(target, non_blocking=True)
    return tensor.to(target)


def _lossy_mask(cache: SessionCache, precision: str, residual_tokens: int) -> list[bool]:
    mask: list[bool] = []
    for span in cache.layers:
        mask.extend([precision != "exact" and not span.pinned] * span.token_count)
    for index in range(max(0, len(mask) - residual_tokens), len(mask)):
        mask[index] = False
    if precision == "int4":
        # KIVI quantises keys per channel over whole token groups; the partial tail stays exact.
        tail = sum(mask) % int4_token_multiple()
        for index in range(len(mask) - 1, -1, -1):
            if tail == 0:
                break
            if mask[index]:
                mask[index] = False
                tail -= 1
    return mask


def _ranges(mask: Sequence[bool]) -> list[tuple[int, int]]:
    """Maximal runs of True as [start, end) pairs."""
    runs: list[tuple[int, int]] = []
    start = None
    for index, flag in enumerate([*mask, False]):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            runs.append((start, index))
            start = None
    return runs


def session_cache_to_tensors(
    cache: SessionCache, precision: str = "exact", residual_tokens: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flatten a session cache (its own tokens and the base reference, never the base tensors)."""
    # A ragged cache's full layers are all ragged (`_ragged_lossy_mask`); its table counts are averages.
    mask = [False] * cache.own_tokens if cache.ragged else _lossy_mask(cache, precision, residual_tokens)
    lossy = torch.tensor(mask, dtype=torch.bool)
    tensors: dict[str, torch.Tensor] = {}
    ragged_ranges: dict[str, list[tuple[int, int]]] = {}
    lossy_streams: list[torch.Tensor] = []
    for index, (keys, values) in enumerate(zip(cache.own_keys, cache.own_values, strict=True)):
        layer_lossy = lossy
        if cache.ragged_counts(index) is not None:
            layer_lossy = _ragged_lossy_mask(cache, index, precision, residual_tokens)
            ragged_ranges[str(index)] = _ranges(layer_lossy.tolist())
            lossy_streams.append(torch.cat(cache.head_stream_index(index))[layer_lossy])
        for name, tensor in (("k", keys), ("v", values)):
            cpu = tensor.detach().to("cpu")
            if not bool(layer_lossy.any()) or cache.window_of(index) is not None:
                tensors[f"{name}.{index}"] = cpu.contiguous()  # no copy for an exact cache
                continue
            tensors[f"{name}.{index}"] = cpu[:, :, ~layer_lossy].contiguous()
            if layer_lossy.any():
                q = quantize(cpu[:, :, layer_lossy], precision, is_key=name == "k")
                tensors[f"{name}q.{index}.codes"] = q.codes.contiguous()
                tensors[f"{name}q.{index}.scale"] = q.scale.contiguous()
                if q.zero is not None:
                    tensors[f"{name}q.{index}.zero"] = q.zero.contiguous()
    for index, stream in enumerate(cache.own_stream_index or ()):
        tensors[f"idx.{index}"] = stream.to("cpu", torch.int32).contiguous()
    lossy_ranges = _ranges(mask)
    layers = [_mark_precision(span, lossy_ranges, precision) for span in _own_spans_with_offsets(cache.layers)]
    if lossy_streams:  # a ragged layer's lossy slots, by the turn layer their tokens belong to
        touched = tokens_per_span(layers, torch.cat(lossy_streams))
        layers = [replace(span, precision=precision) if n else span for span, n in zip(layers, touched, strict=True)]
    header = {
        "format_version": FORMAT_VERSION,
        "kind": "session",
        "dtype": str(cache.own_keys[0].dtype) if cache.own_keys else "torch.float32",
        "num_model_layers": len(cache.own_keys),
        "base_key": cache.base_key,
        "base_token_ids": list(cache.base_token_ids),
        "own_token_ids": list(cache.own_token_ids),
        "layers": [span.to_json() for span in layers],
        "precision": precision,
        "lossy_ranges": lossy_ranges,
        "transcript_digest": cache.transcript_digest,
        "rendering_digest": cache.rendering_digest,
        "windows": list(cache.windows),
        "head_tokens": None
        if not cache.ragged
        else [None if c is None else list(c) for c in cache.own_head_tokens or ()],
        "lossy_ranges_by_layer": ragged_ranges,
    }
    return tensors, header


def _ragged_lossy_mask(cache: SessionCache, layer: int, precision: str, residual_tokens: int) -> torch.Tensor:
    """`[n_0 + ... + n_{h-1}]` bool over a ragged layer's slots: quantised under `precision` (an
    unpinned turn's token, older than the head's last `residual_tokens`; for int4 a whole number of
    KIVI token groups, the newest of the rest exact)."""
    if precision == "exact":
        return torch.zeros(sum(cache.head_tokens(layer)), dtype=torch.bool)
    pinned = pinned_stream_mask(cache.layers, cache.next_original_index)
    # What an eviction could drop is what may be quantised, with the residual as the recent window.
    mask = torch.cat(evictable_per_head(cache.head_stream_index(layer), pinned, residual_tokens))
    if precision == "int4":
        tail = int(mask.sum()) % int4_token_multiple()
        if tail:
            mask[mask.nonzero().flatten()[-tail:]] = False
    return mask


def _own_spans_with_offsets(layers: Sequence[LayerSpan]) -> list[tuple[LayerSpan, int]]:
    offset, out = 0, []
    for span in layers:
        out.append((span, offset))
        offset += span.token_count
    return out


def _mark_precision(item: tuple[LayerSpan, int], lossy_ranges: list[tuple[int, int]], precision: str) -> LayerSpan:
    span, offset = item
    end = offset + span.token_count
    touched = any(start < end and stop > offset for start, stop in lossy_ranges)
    return replace(span, precision=precision) if touched else span


def session_cache_from_tensors(
    tensors: dict[str, torch.Tensor],
    header: dict[str, Any],
    device: torch.device | str,
    windows: Sequence[int | None] = (),
) -> SessionCache:
    """Rebuild a session cache on `device` (base not attached; see `SessionCache.with_base`).
    `windows`: the model's sliding window per model layer (`None`: full), which the blob must
    have been written for.

    Raises:
        MalformedCache: if names, shapes, windows or the format version do not match the header.
    """
    expected = list(windows) if any(w is not None for w in windows) else []
    version = header.get("format_version")
    if version not in _LAYER_WINDOW_VERSIONS and expected:
        raise MalformedCache(f"format {version!r} predates per-layer attention kinds; this model has sliding layers")
    if list(header.get("windows", [])) != expected:
        raise MalformedCache(f"the blob's layer windows {header.get('windows')} are not the model's {expected}")
    try:
        cache = _session_cache_from_tensors(tensors, header, torch.device(device), tuple(expected))
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise MalformedCache(f"session cache does not decode: {exc}") from exc
    _check_held_streams(cache)
    return cache


def _check_held_streams(cache: SessionCache) -> None:
    """Raise `MalformedCache` unless every KV head's stream index (`own_stream_index`, split by the
    header's `head_tokens` when ragged) is ascending and within the own tokens' stream indices
    (from `base_tokens`), as the cache that wrote it kept it: counts that sum right but split the
    slots wrongly (negative, swapped), or indices out of range, would otherwise decode and fail,
    or read the wrong pins, in a later turn."""
    for layer in range(len(cache.own_keys)):
        counts = cache.ragged_counts(layer)
        if counts is not None and any(n < 0 for n in counts):
            raise MalformedCache(f"model layer {layer}'s head token counts {list(counts)} are negative")
        if cache.own_stream_index is None:
            continue
        for stream in cache.head_stream_index(layer):
            if stream.numel() and (
                int(stream[0]) < cache.base_tokens
                or int(stream[-1]) >= cache.next_original_index
                or not bool((stream[1:] > stream[:-1]).all())
            ):
                raise MalformedCache(f"model layer {layer}'s stream index is not ascending within the stream")


def _session_cache_from_tensors(
    tensors: dict[str, torch.Tensor], header: dict[str, Any], device: torch.device, windows: tuple[int | None, ...]
) -> SessionCache:
    if header.get("format_version") not in READABLE_VERSIONS or header.get("kind") != "session":
        raise MalformedCache(f"unsupported cache format {header.get('format_version')!r}/{header.get('kind')!r}")
    dtype = _DTYPES[header["dtype"]]
    own_ids = tuple(int(i) for i in header["own_token_ids"])
    layers = tuple(LayerSpan.from_json(span) for span in header["layers"])
    held = sum(span.token_count for span in layers)
    mask = torch.zeros(held, dtype=torch.bool)
    for start, end in header["lossy_ranges"]:
        mask[start:end] = True
    any_lossy = bool(mask.any())
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    head_tokens = header.get("head_tokens")
    by_layer = header.get("lossy_ranges_by_layer", {})
    for index in range(int(header["num_model_layers"])):
        layer_mask, layer_lossy, slots = mask, any_lossy, held
        if head_tokens is not None and head_tokens[index] is not None:
            slots = sum(int(n) for n in head_tokens[index])
            layer_mask = torch.zeros(slots, dtype=torch.bool)
            for start, end in by_layer.get(str(index), []):
                layer_mask[start:end] = True
            layer_lossy = bool(layer_mask.any())
        for name, out in (("k", keys), ("v", values)):
            exact = tensors[f"{name}.{index}"]
            full = exact  # an exact cache (or a sliding layer's tail) is used as is
            if layer_lossy and not (windows and windows[index] is not None):
                full = exact.new_empty((*exact.shape[:2], slots, exact.shape[3]))
                full[:, :, ~layer_mask] = exact
                shape = (*exact.shape[:2], int(layer_mask.sum()), exact.shape[3])
                zero = tensors.get(f"{name}q.{index}.zero")
                scheme = "int8" if zero is None else ("int4_channel" if name == "k" else "int4_token")
                q = Quantized(tensors[f"{name}q.{index}.codes"], tensors[f"{name}q.{index}.scale"], zero, shape, scheme)
                full[:, :, layer_mask] = dequantize(q, dtype)
            if full.dtype != dtype:
                raise MalformedCache(f"tensor {name}.{index} is {full.dtype}, header says {dtype}")
            out.append(to_device(full, device))
    stream_index = None
    if "idx.0" in tensors:
        stream_index = tuple(tensors[f"idx.{i}"].to(torch.long) for i in range(len(keys)))
    base_key = header.get("base_key")
    return SessionCache(
        base_key=PrefixKey(base_key) if base_key else None,
        base_token_ids=tuple(int(i) for i in header["base_token_ids"]),
        own_keys=tuple(keys),
        own_values=tuple(values),
        own_token_ids=own_ids,
        layers=layers,
        transcript_digest=str(header.get("transcript_digest", "")),
        rendering_digest=str(header.get("rendering_digest", "")),
        own_stream_index=stream_index,
        windows=windows,
        own_head_tokens=None
        if head_tokens is None
        else tuple(None if c is None else tuple(int(n) for n in c) for c in head_tokens),
    )


def base_layer_to_tensors(base: BaseLayer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    for index, (keys, values) in enumerate(zip(base.keys, base.values, strict=True)):
        tensors[f"k.{index}"] = keys.detach().to("cpu").contiguous()
        tensors[f"v.{index}"] = values.detach().to("cpu").contiguous()
    header = {
        "format_version": FORMAT_VERSION,
        "kind": "base",
        "dtype": str(base.keys[0].dtype),
        "num_model_layers": len(base.keys),
        "base_key": base.key,
        "base_token_ids": list(base.token_ids),
    }
    return tensors, header


def base_layer_from_tensors(
    tensors: dict[str, torch.Tensor], header: dict[str, Any], device: torch.device | str
) -> BaseLayer:
    """Raises `MalformedCache` if the tensors do not match the header."""
    try:
        if header.get("format_version") not in READABLE_VERSIONS or header.get("kind") != "base":
            raise MalformedCache(f"unsupported base format {header.get('format_version')!r}")
        count = int(header["num_model_layers"])
        ids = tuple(int(i) for i in header["base_token_ids"])
        keys = tuple(to_device(tensors[f"k.{i}"], device) for i in range(count))
        values = tuple(to_device(tensors[f"v.{i}"], device) for i in range(count))
        if any(k.shape[-2] != len(ids) for k in keys):
            raise MalformedCache("base tensors do not match the base token ids")
        return BaseLayer(PrefixKey(str(header["base_key"])), ids, keys, values)
    except (KeyError, TypeError) as exc:
        raise MalformedCache(f"base layer does not decode: {exc}") from exc
