"""The `transformers` cache objects of one turn: a preallocated buffer per model layer.

`SessionCache.to_working_cache` builds a `WorkingCache` (one `PreallocatedLayer` per model layer)
for a turn; the engine writes the turn's keys and values into it, and `SessionCache.after_turn`
copies what the session keeps back out. Shapes: `[1, kv_heads, capacity, head_dim]` per buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A `transformers` cache layer over a preallocated buffer `[1, kv_heads, capacity, head_dim]`.

    `DynamicLayer` concatenates on every decode step (a copy of the whole cache per token); this
    layer writes the new keys and values into the buffer and returns views of the filled part,
    like gpt-fast's preallocated KV cache. It grows by doubling if a turn runs past `capacity`.
    """

    def __init__(
        self,
        key_buffer: torch.Tensor,
        value_buffer: torch.Tensor,
        length: int,
        position_offset: int = 0,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self._key_buffer = key_buffer
        self._value_buffer = value_buffer
        self._length = length
        self.position_offset = position_offset
        """RoPE position of the next token minus the filled length (tokens evicted with their
        positions kept, or a sliding layer's tokens before its tail, see `SessionCache`)."""
        self.window = window
        """The sliding window W of this model layer (the packed attention lets a query see the
        W - 1 slots before its own), or `None` for full attention."""
        self.query_observer: Callable[[torch.Tensor, float | None], None] | None = None
        """Called by the packed attention with each chunk's query states `[1, heads, n, head_dim]`
        (after RoPE) and the attention scaling; the window policy's scoring sets it
        (`cache.attention_scores`)."""
        self.head_valid: torch.Tensor | None = None
        """A ragged layer's holes (`SessionCache` module docstring): bool `[kv_heads, n]`, False
        where slot `s < n` of a KV head holds no token of that head (the packed attention and the
        scores mask it out); every slot from `n` on is valid in every head. `None`: no holes."""
        self.device = key_buffer.device
        self.is_initialized = True

    @classmethod
    def from_parts(
        cls,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        extra_tokens: int,
        position_offset: int = 0,
        window: int | None = None,
    ) -> PreallocatedLayer:
        length = sum(k.shape[-2] for k in keys)
        first = keys[0]
        shape = (first.shape[0], first.shape[1], length + max(extra_tokens, 1), first.shape[3])
        key_buffer = first.new_empty(shape)
        value_buffer = values[0].new_empty(shape)
        offset = 0
        for k, v in zip(keys, values, strict=True):
            n = k.shape[-2]
            key_buffer[:, :, offset : offset + n].copy_(k)
            value_buffer[:, :, offset : offset + n].copy_(v)
            offset += n
        return cls(key_buffer, value_buffer, length, position_offset, window)

    # `keys` and `values` are views made when read, not attributes refreshed at every write: the
    # engine writes each request's keys once per model layer per step, and most of those views
    # would never be read.
    def held_slots(self, slots: int) -> torch.Tensor:
        """`[kv_heads, slots]` bool over the first `slots` slots of a ragged layer's buffer: False in
        a head's hole (`head_valid`), True everywhere else (slots past the holes are every head's).

        Raises:
            RuntimeError: if the layer has no holes (`head_valid` is `None`).
        """
        if self.head_valid is None:
            raise RuntimeError("bug: held_slots of a layer without holes")
        held = torch.ones(self.head_valid.shape[0], slots, dtype=torch.bool, device=self.head_valid.device)
        held[:, : min(slots, self.head_valid.shape[1])] = self.head_valid[:, :slots]
        return held

    @property
    def keys(self) -> torch.Tensor:
        """View of the filled part of the key buffer, `[1, kv_heads, length, head_dim]`."""
        return self._key_buffer[:, :, : self._length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        _refuse_assignment("keys", value)

    @property
    def values(self) -> torch.Tensor:
        """View of the filled part of the value buffer, `[1, kv_heads, length, head_dim]`."""
        return self._value_buffer[:, :, : self._length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        _refuse_assignment("values", value)

    @property
    def filled_keys(self) -> torch.Tensor:
        """View of the filled part of the key buffer, `[1, kv_heads, length, head_dim]`."""
        return self._key_buffer[:, :, : self._length]

    @property
    def filled_values(self) -> torch.Tensor:
        return self._value_buffer[:, :, : self._length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("bug: PreallocatedLayer is initialised at construction")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.append(key_states, value_states)
        return self.filled_keys, self.filled_values

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write `[1, kv_heads, n, head_dim]` keys and values after the filled part (the engine's
        step: `update` without building the views it returns)."""
        end = self._length + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            self._grow(end)
        self._key_buffer[:, :, self._length : end] = key_states
        self._value_buffer[:, :, self._length : end] = value_states
        self._length = end

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self._key_buffer.shape[-2])
        shape = (*self._key_buffer.shape[:2], capacity, self._key_buffer.shape[3])
        key_buffer = self._key_buffer.new_empty(shape)
        value_buffer = self._value_buffer.new_empty(shape)
        key_buffer[:, :, : self._length].copy_(self._key_buffer[:, :, : self._length])
        value_buffer[:, :, : self._length].copy_(self._value_buffer[:, :, : self._length])
        self._key_buffer, self._value_buffer = key_buffer, value_buffer

    def get_seq_length(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers, at their capacity."""
        return sum(t.numel() * t.element_size() for t in (self._key_buffer, self._value_buffer))

    @property
    def next_position(self) -> int:
        """RoPE position of the next token written."""
        return self._length + self.position_offset

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        self._length = max(0, self._length + tokens_to_remove)


def _refuse_assignment(name: str, value: torch.Tensor | None) -> None:
    # `DynamicLayer.__init__` sets both to `None`; anything else would bypass the buffer.
    if value is not None:
        raise AttributeError(f"PreallocatedLayer.{name} is a view of its buffer; write with update()")


class WorkingCache(DynamicCache):
    """The `transformers` cache object of one turn: one `PreallocatedLayer` per model layer."""

    def __init__(self, layers: list[PreallocatedLayer]) -> None:
        super().__init__()
        self.layers = list(layers)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's key and value buffers, at their capacity."""
        return sum(layer.nbytes for layer in self.prealloc_layers)

    @property
    def prealloc_layers(self) -> list[PreallocatedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PreallocatedLayer)]
