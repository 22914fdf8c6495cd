"""The layer table of a session cache: its rows (`LayerSpan`: one contiguous run of cached tokens
each, the base layer's pinned turns and the turn layers) and the walks over them.

See `cache.session_cache` for what the layers are; a table row counts tokens per KV head (on
average over the heads and full model layers when a layer is stored ragged).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class LayerKind(enum.StrEnum):
    BASE = "base"
    TURN = "turn"


@dataclass(frozen=True)
class LayerSpan:
    """One layer of the session cache: a contiguous run of cached tokens.

    Attributes:
        kind: `base` for the system-prompt prefix and pinned turns, `turn` otherwise.
        turn_index: 0-based turn number; `None` for the system-prompt prefix.
        token_count: tokens in this layer.
        original_start: index of its first token in the conversation stream (every message's
            tokens in order, demoted ones included); also the RoPE position it had when computed
            unless the window had already been compacted then.
        position_start: current RoPE position of its first token (layers are contiguous).
        precision: `exact`, or the lossy precision (`int8`/`int4`) it was stored at in a lower tier.
        evicted_tokens: tokens of the layer evicted by importance (the `attention` window policy),
            the same count in every KV head and model layer; `token_count` counts the ones held.
            The layer still spans `original_tokens` stream indices and RoPE positions.
    """

    kind: LayerKind
    turn_index: int | None
    token_count: int
    original_start: int
    position_start: int
    precision: str = "exact"
    evicted_tokens: int = 0

    @property
    def pinned(self) -> bool:
        return self.kind is LayerKind.BASE

    @property
    def original_tokens(self) -> int:
        """Tokens the layer covers in the conversation stream: held plus evicted."""
        return self.token_count + self.evicted_tokens

    @property
    def position_end(self) -> int:
        return self.position_start + self.original_tokens

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind.value,
            "turn_index": self.turn_index,
            "token_count": self.token_count,
            "original_start": self.original_start,
            "position_start": self.position_start,
            "precision": self.precision,
            "evicted_tokens": self.evicted_tokens,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> LayerSpan:
        turn = data["turn_index"]
        return cls(
            kind=LayerKind(str(data["kind"])),
            turn_index=None if turn is None else int(str(turn)),
            token_count=int(str(data["token_count"])),
            original_start=int(str(data["original_start"])),
            position_start=int(str(data["position_start"])),
            precision=str(data.get("precision", "exact")),
            evicted_tokens=int(str(data.get("evicted_tokens", 0))),
        )


def span_offsets(layers: Sequence[LayerSpan]) -> list[tuple[LayerSpan, int, int]]:
    """(span, offset of its held tokens in the own tensors, offset of its ids in `own_token_ids`)."""
    out, held, ids = [], 0, 0
    for span in layers:
        out.append((span, held, ids))
        held += span.token_count
        ids += span.original_tokens
    return out


def stream_index_of(layers: Sequence[LayerSpan]) -> torch.Tensor:
    """`[own_tokens]` int64 stream index of each held token of a table without evictions."""
    if any(span.evicted_tokens for span in layers):
        raise RuntimeError("bug: a table with evicted tokens needs its recorded stream index")
    parts = [torch.arange(s.original_start, s.original_start + s.token_count) for s in layers]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def appended_stream_index(existing: Sequence[LayerSpan], new: Sequence[LayerSpan], appended: int) -> torch.Tensor:
    """Stream index of the `appended` tokens a turn added (they extend the last layer, then fill
    new ones, never with evictions)."""
    before = {span.original_start: span for span in existing}
    parts = []
    for span in new:
        old = before.get(span.original_start)
        start = span.original_start + (old.original_tokens if old is not None else 0)
        parts.append(torch.arange(start, span.original_start + span.original_tokens))
    index = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    if index.numel() != appended:
        raise RuntimeError(f"bug: the new layers cover {index.numel()} tokens, {appended} were appended")
    return index


def spans_before(existing: Sequence[LayerSpan], new: Sequence[LayerSpan]) -> list[LayerSpan]:
    if not new:
        return list(existing)
    first = new[0].original_start
    return [span for span in existing if span.original_start < first]


def pinned_stream_mask(layers: Sequence[LayerSpan], length: int) -> torch.Tensor:
    """`[length]` bool over the conversation stream: True at the stream index of a pinned turn's token."""
    mask = torch.zeros(length, dtype=torch.bool)
    for span in layers:
        if span.pinned:
            mask[span.original_start : span.original_start + span.original_tokens] = True
    return mask


def tokens_per_span(layers: Sequence[LayerSpan], streams: torch.Tensor) -> list[int]:
    """How many of the stream indices `streams` (int64, any shape) fall in each row of `layers`."""
    return [
        int(((streams >= span.original_start) & (streams < span.original_start + span.original_tokens)).sum())
        for span in layers
    ]
