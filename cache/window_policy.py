"""The context window: which turn layers to demote so a turn fits, and demotion by RoPE re-rotation.

Before a turn, the window must hold the base layer, the kept turn layers, the tokens the turn
prefills and `max_new_tokens`. While it would not, the oldest unpinned turn layer is demoted out of
the window (the transcript keeps its messages). The kept tokens after a gap are then moved back to
contiguous positions by re-rotating their keys (`cache.rope`), as StreamingLLM does when it evicts
tokens; values carry no position and are kept as they are. Only model layer 0 then equals a fresh
prefill of the window: deeper layers keep what they computed with the demoted turns in context
(StreamingLLM's trade-off; docs/architecture.md, "Context window"). Re-prefilling is exact.

    before   | base | t0 (pinned) | t1 | t2 | t3 |        budget exceeded by the new turn
    demote   | base | t0 (pinned) |         | t3 |        t1, t2 out (oldest unpinned first)
    after    | base | t0 (pinned) | t3 (rotated by -(len t1 + len t2)) | new turn ...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from cache.errors import CacheError
from cache.layer_table import LayerSpan, span_offsets
from cache.rope import RopeLayout, rotate_keys
from cache.session_cache import SessionCache

MIN_TURN_TOKENS = 64
"""Room the window keeps beside the system prompt and pinned turns: a short message and reply.
Pins (and system prompts) that would take it are refused, so a session never becomes unusable."""


class ContextOverflow(CacheError):
    """Even with every unpinned turn demoted, the turn does not fit the window."""

    def __init__(self, needed_tokens: int, budget_tokens: int) -> None:
        super().__init__(f"turn needs {needed_tokens} tokens of context, the window holds {budget_tokens}")
        self.needed_tokens = needed_tokens
        self.budget_tokens = budget_tokens


@dataclass(frozen=True)
class WindowPlan:
    """Turn layers to demote (oldest first) and the window's size after the turn, in tokens."""

    demote: tuple[LayerSpan, ...]
    needed_tokens: int

    @property
    def demoted_tokens(self) -> int:
        return sum(span.token_count for span in self.demote)


WINDOW_POLICIES = ("turns", "attention", "agnostic")
LOSSY_POLICIES = ("attention", "agnostic")
"""Policies that evict tokens per KV head (`cache.token_eviction`) instead of demoting whole turns."""


@dataclass(frozen=True)
class WindowPolicy:
    """Demotes the oldest unpinned turn layers so that a turn fits in `budget_tokens`.

    Attributes:
        budget_tokens: the context window, in tokens.
        policy: `turns` (exact per layer: whole oldest turns go, `plan`), `attention` (lossy:
            tokens of unpinned turn layers are evicted by importance to the new turn, per KV head:
            `cache.token_eviction`; the rebuild path demotes whole turns only until the turn
            fits the budget plus a share of it, then prefills that in chunks and evicts:
            `sessions/turn/preparer.py`) or `agnostic` (lossy, the same eviction by scores fixed
            when earlier turns committed, whatever is asked next: KVzip's reconstruction of each
            committed turn's ids, run after its reply, `sessions/turn/window.py`).
        recent_tokens: under `attention` and `agnostic`, most recent own tokens never evicted.
        observation_tokens: under `attention`, queries at the end of the new turn's prefill whose
            attention scores the cached tokens (`cache.attention_scores`).
        rebuild_chunk_tokens: under `attention` and `agnostic`, a rebuild prefills its kept past
            in chunks of this many tokens and evicts down to the budget after each, so it holds
            at most `budget_tokens` plus a chunk (`sessions.turn.window.TurnWindow.prefill_evicting`);
            0 (the default: better replies, benchmarks/window_rebuild.py) prefills it at once.
        allocation: under `attention` and `agnostic`, how an eviction spends the kept tokens
            over KV heads: `per_head` (Ada-KV, the layer stored ragged) or `uniform`
            (`cache.token_eviction.evict_by_scores`).

    Raises:
        ValueError: if `budget_tokens` is not positive, `policy` is unknown, `recent_tokens` is
            negative (or, under a lossy policy, not below `budget_tokens`), `observation_tokens < 1`
            or `rebuild_chunk_tokens < 0`, or `allocation` is unknown.
    """

    budget_tokens: int
    policy: str = "turns"
    recent_tokens: int = 64
    observation_tokens: int = 32
    rebuild_chunk_tokens: int = 0
    allocation: str = "per_head"

    def __post_init__(self) -> None:
        if self.budget_tokens <= 0:
            raise ValueError(f"budget_tokens must be > 0, got {self.budget_tokens}")
        if self.policy not in WINDOW_POLICIES:
            raise ValueError(f"window policy must be 'turns', 'attention' or 'agnostic', got {self.policy!r}")
        if self.allocation not in ("uniform", "per_head"):
            raise ValueError(f"window budget allocation must be 'uniform' or 'per_head', got {self.allocation!r}")
        if self.recent_tokens < 0 or (self.policy in LOSSY_POLICIES and self.recent_tokens >= self.budget_tokens):
            raise ValueError(
                f"window_recent_tokens must be >= 0 and below the context budget ({self.budget_tokens}), "
                f"got {self.recent_tokens}"
            )
        if self.observation_tokens < 1:
            raise ValueError(f"window_observation_tokens must be >= 1, got {self.observation_tokens}")
        if self.rebuild_chunk_tokens < 0:
            raise ValueError(f"window_rebuild_chunk_tokens must be >= 0, got {self.rebuild_chunk_tokens}")

    def plan(
        self,
        layers: Sequence[LayerSpan],
        base_tokens: int,
        closing_tokens: int,
        turn_tokens: int,
        max_new_tokens: int,
    ) -> WindowPlan:
        """What to demote before a turn.

        Args:
            layers: the own layer table (pinned turns and turn layers), in cache order.
            base_tokens: tokens of the shared system-prompt prefix.
            closing_tokens: tokens prefilled for the end of the last layer's turn (they go with
                that layer: demoting it drops them too).
            turn_tokens: the new turn's tokens up to the generation prompt.
            max_new_tokens: the reply's length limit.

        Raises:
            ContextOverflow: if demoting every unpinned layer is not enough.
        """
        last = layers[-1] if layers else None
        needed = base_tokens + sum(s.token_count for s in layers) + closing_tokens + turn_tokens + max_new_tokens
        demote: list[LayerSpan] = []
        for span in layers:
            if needed <= self.budget_tokens:
                break
            if span.pinned:
                continue
            demote.append(span)
            needed -= span.token_count + (closing_tokens if span is last else 0)
        if needed > self.budget_tokens:
            raise ContextOverflow(needed, self.budget_tokens)
        return WindowPlan(tuple(demote), needed)


def kept_layers(cache: SessionCache, demote: Sequence[LayerSpan]) -> list[tuple[LayerSpan, int, int]]:
    """`span_offsets` of the layers that stay: (span, offset of its held tokens in the own tensors,
    offset of its ids in `own_token_ids`)."""
    dropped = {span.original_start for span in demote}
    return [item for item in span_offsets(cache.layers) if item[0].original_start not in dropped]


def demote_by_rotation(cache: SessionCache, demote: Sequence[LayerSpan], layout: RopeLayout) -> SessionCache:
    """Drop `demote` from the cache and re-rotate the kept keys to contiguous positions.

    A kept layer that lost tokens by importance (`LayerSpan.evicted_tokens`, the `attention`
    policy) moves as a whole: its gaps keep their width, so its own tokens keep their relative
    positions.

    Args:
        cache: the session cache (own tensors `[1, kv_heads, own_tokens, head_dim]`).
        demote: layers of `cache.layers` to drop.
        layout: the model's RoPE layout (`cache.rope.rope_layout`).

    Returns:
        A new cache; `cache` and its tensors are not modified.
    """
    if not demote:
        return cache
    if cache.sliding:
        raise RuntimeError("bug: a cache with sliding-window layers demotes by re-prefill, not by rotation")
    kept = kept_layers(cache, demote)
    position = cache.base_tokens
    spans: list[LayerSpan] = []
    pieces_k: list[list[torch.Tensor]] = [[] for _ in cache.own_keys]
    pieces_v: list[list[torch.Tensor]] = [[] for _ in cache.own_values]
    pieces_index: list[list[torch.Tensor]] = [[] for _ in cache.own_keys]
    token_ids: list[int] = []
    for span, held, ids in kept:
        shift = span.position_start - position
        end = held + span.token_count
        for index, (keys, values) in enumerate(zip(cache.own_keys, cache.own_values, strict=True)):
            pieces_k[index].append(rotate_keys(keys[:, :, held:end], shift, layout))
            pieces_v[index].append(values[:, :, held:end])
            if cache.own_stream_index is not None:
                pieces_index[index].append(cache.own_stream_index[index][:, held:end])
        token_ids.extend(cache.own_token_ids[ids : ids + span.original_tokens])
        spans.append(replace(span, position_start=position))
        position += span.original_tokens
    stream_index = None
    if cache.own_stream_index is not None:
        stream_index = tuple(
            torch.cat(p, dim=-1) if p else i[:, :0] for p, i in zip(pieces_index, cache.own_stream_index, strict=True)
        )
    empty_like = [k[:, :, :0] for k in cache.own_keys]
    return replace(
        cache,
        own_keys=tuple(torch.cat(p, dim=-2) if p else e for p, e in zip(pieces_k, empty_like, strict=True)),
        own_values=tuple(
            torch.cat(p, dim=-2) if p else e
            for p, e in zip(pieces_v, [v[:, :, :0] for v in cache.own_values], strict=True)
        ),
        own_token_ids=tuple(token_ids),
        layers=tuple(spans),
        own_stream_index=stream_index,
        own_scores=None,  # the `agnostic` policy never demotes by rotation; its scores would not follow
    )
