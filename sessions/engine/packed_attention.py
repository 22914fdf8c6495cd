"""The attention function of a packed step: each request attends over its own KV buffer, by the
attention kind of the model layer (full, sliding window, with or without learned sinks).

transformers calls the registered attention function of every attention module with that module's
query, the keys and values the cache returned, and keyword arguments that describe the layer's
attention (`scaling`, `sliding_window`, `softcap`, `s_aux`, ...). In a packed step the query row
holds several requests; per request and model layer:

    query  [1, heads, n, head_dim]          one request's chunk (a decode: n = 1)
    keys   [1, kv_heads, L, head_dim]       its buffer after `StepCache.update` wrote the chunk
    full layer       every slot up to the query's own (causal inside the chunk)
    sliding layer W  the query's own slot and the W - 1 before it (the keys are sliced to what
                     the chunk can see, then masked as a band)
    sinks            one learned logit per query head joins the softmax and is dropped after it
                     (gpt-oss: `s_aux`); soft-capping `tanh(s / c) * c` (Gemma 2: `softcap`)

Slot distance equals RoPE-position distance in a sliding layer, whose tail is contiguous; a full
layer may have evicted slots (the `attention` window policy), for which only causality matters,
and, stored ragged (per-head budgets), holes: slots a KV head does not hold, masked out of its
query heads' softmax (`with_holes`).

Every keyword argument is accounted for: those implemented above, those that cannot change the
result (named in `INERT_ARGUMENTS` with the reason), or the call raises
`UnsupportedAttentionArgument`, never ignores it. The model runner probes the model once at load
(`ModelRunner`), so a model passing something else is refused there, before any turn.

Calls without a packed step (plain use of the same model object by tests and baselines) go to the
model's original implementation: the registered function for `sdpa`/`flash_attention_*`, or the
model's own module-level `eager_attention_forward` for `eager` (gpt-oss's has the sinks).

On CUDA a packed step runs with SDPA's cuDNN backend switched off (`without_cudnn_attention`):
cuDNN builds an execution graph per problem shape, and a packed step's key lengths change every step.
And a decode-only step of several requests attends in one call per plain full-attention layer over
every request's keys under a block-diagonal mask (`PackedBatch.block_diagonal`): a kernel launch per
request and layer costs more there than the gather.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cache.working_cache import PreallocatedLayer
from sessions.engine.batch import BLOCK_DIAGONAL_MAX_KEYS, STEP_KWARG, PackedBatch, Segment

INERT_ARGUMENTS: dict[str, str] = {
    "position_ids": "RoPE is applied before attention; only flash-attention's varlen path reads it",
    "output_attentions": "asks for the weights back, which callers of a packed step never read",
    "cache_position": "a cache-slot hint for static caches; the packed step writes its own slots",
    "use_cache": "the packed step always caches",
}
"""Keyword arguments a model may pass that cannot change a packed step's output, and why."""


class UnsupportedAttentionArgument(RuntimeError):
    """The model's attention call passes an argument the packed attention does not implement."""

    def __init__(self, name: str, value: object, layer: int, why: str = "which chatkv does not implement") -> None:
        shown = type(value).__name__ if isinstance(value, torch.Tensor) else repr(value)
        super().__init__(f"model layer {layer}'s attention passes {name}={shown}, {why}")
        self.name = name


def step_of(attention_mask: object, kwargs: dict[str, Any]) -> PackedBatch | None:
    """The packed step of this call: the keyword argument, or the placeholder mask it rides on
    (models whose decoder layers drop keyword arguments still pass the mask through)."""
    batch = kwargs.get(STEP_KWARG)
    if batch is None:
        batch = getattr(attention_mask, STEP_KWARG, None)
    return batch


def _check_arguments(layer_idx: int, dropout: float, kwargs: dict[str, Any]) -> None:
    if dropout:
        raise UnsupportedAttentionArgument("dropout", dropout, layer_idx)
    if kwargs.get("is_causal") is False:
        raise UnsupportedAttentionArgument("is_causal", False, layer_idx)
    for name, value in kwargs.items():
        off = value is None or value is False  # a feature the model leaves off
        if not (off or name in _IMPLEMENTED or name in INERT_ARGUMENTS):
            raise UnsupportedAttentionArgument(name, value, layer_idx)


_IMPLEMENTED = frozenset({STEP_KWARG, "scaling", "sliding_window", "softcap", "s_aux", "is_causal"})


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of `query [1, heads, n, d]` over `keys`/`values [1, kv_heads, m, d]` (grouped
    query heads share a KV head) with the bool `mask [n, m]`. Returns `[1, heads, n, d]`.

    Without sinks or soft-capping this is SDPA. With them it is the eager computation the models
    themselves run (scores, `tanh(s / softcap) * softcap`, the mask, the sink logit of each head
    `sinks [heads]` appended to every row's softmax and dropped after it), so the result agrees
    with the model's own implementation up to float rounding.
    """
    if sinks is None and softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
    groups = query.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(groups, dim=1)
    values = values.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, keys.transpose(2, 3)) * scale  # [1, heads, n, m]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        sink = sinks.reshape(1, -1, 1, 1).to(scores.dtype).expand(1, -1, scores.shape[2], 1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


def with_holes(
    mask: torch.Tensor | None, layer: PreallocatedLayer, queries: int, keys: int, heads: int
) -> torch.Tensor:
    """The `[1, heads, queries, keys]` bool mask of a chunk over a ragged layer's buffer: `mask`
    (`[queries, keys]`, or `None`: every slot) and, per KV head, its holes
    (`PreallocatedLayer.held_slots`), repeated over the query heads that share each KV head (GQA)."""
    valid = layer.held_slots(keys)
    kv_heads = valid.shape[0]
    out = valid[:, None, :].expand(kv_heads, queries, keys)
    if mask is not None:
        out = out & mask[None]
    return out.repeat_interleave(heads // kv_heads, dim=0)[None]


def _segment_attention(
    batch: PackedBatch, segment: Segment, layer_idx: int, q: torch.Tensor, kind: dict[str, Any]
) -> torch.Tensor:
    """Attention of one request's chunk `q [1, heads, n, head_dim]` over its own buffer of model
    layer `layer_idx`. Returns `[1, n, heads, head_dim]` (a view), the layout the model expects."""
    layer = segment.layers[layer_idx]
    window: int | None = kind["sliding_window"]
    if window != layer.window:
        raise UnsupportedAttentionArgument(
            "sliding_window", window, layer_idx, f"but its config gives it window {layer.window}"
        )
    if layer.query_observer is not None:
        layer.query_observer(q, kind["scaling"])
    keys, values = layer.filled_keys, layer.filled_values
    if window is not None:  # only the slots this chunk can see
        first = max(0, keys.shape[2] - segment.length - (window - 1))
        keys, values = keys[:, :, first:], values[:, :, first:]
    mask = batch.mask(segment.length, keys.shape[2], window)
    if layer.head_valid is not None:
        mask = with_holes(mask, layer, segment.length, keys.shape[2], q.shape[1])
    out = attend(q, keys, values, mask, kind["scaling"], kind["s_aux"], kind["softcap"])
    return out.transpose(1, 2)


def _block_diagonal_attention(
    batch: PackedBatch, layer_idx: int, query: torch.Tensor, kind: dict[str, Any]
) -> torch.Tensor | None:
    """Attention of a decode-only step's queries `[1, heads, N, head_dim]` (one per request) in one
    SDPA call over every request's keys of model layer `layer_idx` concatenated, masked
    block-diagonally (`PackedBatch.block_mask`). Returns `[1, N, heads, head_dim]`, or `None` for a
    layer this does not cover (sliding window, sinks, soft-capping, holes, a query observer, more
    than `BLOCK_DIAGONAL_MAX_KEYS` keys), which then attends per request."""
    if kind["sliding_window"] is not None or kind["s_aux"] is not None or kind["softcap"] is not None:
        return None
    layers = [segment.layers[layer_idx] for segment in batch.segments]
    if any(
        layer.window is not None or layer.head_valid is not None or layer.query_observer is not None for layer in layers
    ):
        return None
    lengths = tuple(layer.get_seq_length() for layer in layers)
    if sum(lengths) > BLOCK_DIAGONAL_MAX_KEYS:
        return None
    keys = torch.cat([layer.filled_keys for layer in layers], dim=2)  # [1, kv_heads, sum(lengths), d]
    values = torch.cat([layer.filled_values for layer in layers], dim=2)
    mask = batch.block_mask(lengths)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=kind["scaling"], enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def packed_attention_for(fallback: Callable[..., tuple[torch.Tensor, Any]]) -> Callable[..., tuple[torch.Tensor, Any]]:
    """The attention function: per request over its own buffer when the model is called with a
    packed step, else `fallback` (the model's original attention implementation).

    Raises:
        UnsupportedAttentionArgument: for an argument that is neither implemented nor inert.
    """

    def packed_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        batch = step_of(attention_mask, kwargs)
        if batch is None:
            return fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        layer_idx: int = getattr(module, "layer_idx", 0)
        _check_arguments(layer_idx, dropout, kwargs)
        kind = {
            "scaling": scaling,
            "sliding_window": kwargs.get("sliding_window"),
            "softcap": kwargs.get("softcap"),
            "s_aux": kwargs.get("s_aux"),
        }
        batch.observe(layer_idx, kind)
        if batch.block_diagonal:
            out = _block_diagonal_attention(batch, layer_idx, query, kind)
            if out is not None:
                return out, None
        queries = query.split(batch.lengths, dim=2)  # per request [1, heads, n, head_dim]
        outputs = [
            _segment_attention(batch, segment, layer_idx, q, kind)
            for segment, q in zip(batch.segments, queries, strict=True)
        ]
        # One copy into the `[1, T, heads, head_dim]` transformers expects.
        return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0].contiguous(), None

    return packed_attention


class _CudnnAttentionSwitch:
    """Reference-counted owner of torch's process-wide cuDNN-attention flag during packed steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0  # packed steps now running with the flag off by this switch
        self._was_enabled = False

    def acquire(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._was_enabled = torch.backends.cuda.cudnn_sdp_enabled()
                torch.backends.cuda.enable_cudnn_sdp(False)
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._was_enabled:
                torch.backends.cuda.enable_cudnn_sdp(True)


_CUDNN_SWITCH = _CudnnAttentionSwitch()


@contextmanager
def without_cudnn_attention(device: torch.device) -> Iterator[None]:
    """Run the block with SDPA's cuDNN backend off when `device` is a CUDA device (else a no-op).

    torch prefers cuDNN's attention on sm90/sm100 with a recent cuDNN (`check_prefer_cudnn_attention`
    in ATen's `native/transformers/cuda/sdp_utils.cpp`), and cuDNN builds and caches one execution
    graph per problem: batch, heads, query and key lengths, strides (`MHAParams` in ATen's
    `native/cudnn/MHA.cpp`), tens of milliseconds of host time per graph. A packed step calls SDPA
    per request over its whole buffer, whose length grows by one token every step, so nearly every
    call of a decode step builds a graph. Flash and memory-efficient attention (what SDPA picks
    next) have no per-shape set-up; the outputs agree up to float rounding.

    The switch is torch's process-wide flag (`torch.backends.cuda.enable_cudnn_sdp`): the first of
    overlapping packed steps (several engines, one loop thread each) turns it off, the last one
    turns it back on if it was on; a flag someone else turned off stays off. Another thread's SDPA
    calls during a step run without cuDNN too (the same results up to float rounding).
    """
    if device.type != "cuda":
        yield
        return
    _CUDNN_SWITCH.acquire()
    try:
        yield
    finally:
        _CUDNN_SWITCH.release()


def _model_eager(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, Any]:
    """The `eager` implementation of the model `module` belongs to: its modeling file's own
    `eager_attention_forward` (gpt-oss's applies the sinks, Gemma 2's the soft-capping)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"{type(module).__qualname__}'s module has no eager_attention_forward")
    result: tuple[torch.Tensor, Any] = eager(module, query, key, value, *args, **kwargs)
    return result


def register_packed_attention(original: str) -> str:
    """Register the packed attention for a model whose attention implementation is `original`, and
    return the name to set on the model (`model.set_attn_implementation(name)`)."""
    name = f"chatkv_packed_{original}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        if original == "eager":
            fallback: Callable[..., tuple[torch.Tensor, Any]] = _model_eager
        else:
            fallback = ALL_ATTENTION_FUNCTIONS.get(original, sdpa_attention_forward)
        mask = ALL_MASK_ATTENTION_FUNCTIONS.get(original, sdpa_mask)
        AttentionInterface.register(name, packed_attention_for(fallback))
        AttentionMaskInterface.register(name, mask)
    return name
