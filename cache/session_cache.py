"""The layered KV cache of one session, and its conversion to the `transformers` cache object.

A session cache is a run of cached tokens split into layers (not model layers):

    conversation stream  | system prompt | turn 0 ........ | turn 1 ....... | turn 2 ........ |
    session cache        | base (shared) | turn 0 (pinned) |   (demoted)    | turn 2          |
    RoPE position        | 0 .. b-1      | b ..            |                | re-rotated, contiguous

- The **base layer** starts with the system-prompt prefix, held read-only in the tenant's prefix pool
  (`BaseLayer`) and shared by the tenant's sessions that start the same way. Turns promoted by
  `pin` belong to the base layer as well; they keep their place in the stream but are never demoted.
- **Turn layers** (one per turn) are the session's own tensors. Demotion drops them out of the
  window; the kept tokens after the gap are re-rotated so positions stay contiguous (`cache.rope`).
  Under the `attention` window policy (`cache.token_eviction`) a turn layer may instead hold only
  some of its tokens, a different set per KV head and model layer: `LayerSpan.evicted_tokens`
  counts the tokens it lost (per head), `SessionCache.own_stream_index` records which ones each
  head holds, and kept keys keep their RoPE positions, so the next token's position
  (`next_position`) is then past the cached length.

Storage shapes, per model layer `l`: the shared base holds `[1, kv_heads, base_tokens, head_dim]`;
the session's own tokens (pinned turns and turn layers, in order) are one tensor pair
`own_keys[l]`, `own_values[l]` of shape `[1, kv_heads, own_tokens, head_dim]` in the model's dtype.

Under per-head budgets (`cache.token_eviction`, Ada-KV) the KV heads of a full-attention model
layer hold different numbers of tokens. Such a layer is stored **ragged**: its heads' slots one
after another in one `[1, 1, n_0 + ... + n_{h-1}, head_dim]` tensor (a rectangular layer is the
same memory with equal counts), with the counts in `own_head_tokens[l]`; so the session holds, and
every tier stores and counts, exactly the tokens it keeps. Only a turn's working buffer is
rectangular: each head's own slots are followed by a **hole** up to the longest head's, masked out
of attention (`PreallocatedLayer.head_valid`), and the turn's new tokens follow at common slots:

    ragged layer, stored     | head 0: n_0 ....... | head 1: n_1 ... | head 2: n_2 ..... |
    working buffer, head 0   | base | n_0 .......           | new tokens ...
                   head 1   | base | n_1 ... | hole (masked) | new tokens ...
    after the turn, stored   | head 0: n_0 + new | head 1: n_1 + new | head 2: n_2 + new |

The layer table then counts each turn layer's tokens per head on average over the heads and full
model layers (`LayerSpan.token_count`; every full model layer holds `kv_heads * own_tokens` in
all), and `own_stream_index` says which token each slot holds.

Model layers differ by attention kind (`SessionCache.windows`). A full-attention layer holds every
token of the layer table. A sliding-window layer of window W (a query sees itself and the W - 1
tokens before it) holds only its **tail**: the own tokens at the last `n` RoPE positions before
`next_position` (`n <= W - 1`, see the checkpoint below), contiguous, `[1, kv_heads, n, head_dim]`;
when the tail starts right after the base, its working KV takes the base's last tokens too (up to
W - 1 in all). A tail is never evicted or re-rotated; older tokens are dropped when a turn completes:

    positions          | base 0..b-1 | own b ................................... next-1 |
    full layer         | base        | every held own token (layer table)                |
    sliding layer, W   |                                 | tail: last <= W-1 positions   |
    a turn's buffer    |                                 | tail | prefill ... | reply ... |  then trimmed

A tail also keeps the W - 1 positions before the last turn when that turn is at most W - 1 tokens
long (a window checkpoint, see `_own_start`), so a fork at the last turn boundary stays warm.
The cache is treated as an immutable value: operations return a new `SessionCache` and never write
into tensors another holder may see (the base is shared, and write-back reads old versions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from cache.ids import PrefixKey
from cache.layer_table import (
    LayerKind,
    LayerSpan,
    appended_stream_index,
    spans_before,
    stream_index_of,
)
from cache.ragged_heads import append_per_head, gather_heads, split_heads, working_layer
from cache.working_cache import PreallocatedLayer, WorkingCache


@dataclass(frozen=True)
class BaseLayer:
    """The shared, read-only system-prompt prefix of a tenant's sessions (an entry of the prefix pool).

    `keys[l]`, `values[l]`: `[1, kv_heads, len(token_ids), head_dim]` per model layer `l`, at RoPE
    positions `0 .. len(token_ids)-1`. Never written after construction.
    """

    key: PrefixKey
    token_ids: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def token_count(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass(frozen=True)
class SessionCache:
    """Base reference plus the session's own KV tensors and layer table. See the module docstring.

    Attributes:
        base: the shared base prefix, or `None` when the template has no shareable prefix.
        base_key / base_token_ids: identity of the base even while `base` is not attached
            (an offloaded cache stores the reference, not the tensors).
        own_keys, own_values: per model layer, `[1, kv_heads, own_tokens, head_dim]`.
        own_token_ids: stream ids the own layers cover, in order: the ids of the held tokens, plus
            those of evicted tokens (`LayerSpan.evicted_tokens`), so a layer can be re-prefilled.
        layers: layer table of the own tokens (pinned turns and turn layers), in cache order.
        own_stream_index: `None` while no token was evicted (cache slot `i` of a layer holds its
            token `i`); else per model layer a `[kv_heads, own_tokens]` int64 tensor (on the CPU)
            of the conversation-stream index of the token each head holds in each slot, ascending
            within each layer (a ragged layer's: `[1, n_0 + ... + n_{h-1}]`, head by head).
        own_head_tokens: `None` while every layer is rectangular; else per model layer `None`
            (rectangular) or the tokens each KV head of that ragged full-attention layer holds
            (module docstring), summing to `kv_heads * own_tokens`.
    """

    base_key: PrefixKey | None
    base_token_ids: tuple[int, ...]
    own_keys: tuple[torch.Tensor, ...]
    own_values: tuple[torch.Tensor, ...]
    own_token_ids: tuple[int, ...]
    layers: tuple[LayerSpan, ...]
    base: BaseLayer | None = field(default=None, compare=False)
    transcript_digest: str = ""
    """Digest of the transcript this cache was computed from (see `sessions.turn.preparer`); a cache is
    used only for the transcript it matches, so an edited message can never reuse a stale KV."""
    rendering_digest: str = ""
    """Digest of the chat template's text of the conversation through the last reply's content
    (see `sessions.turn.chat_template`); a cache whose text renders differently now (a date in the
    system turn, another template) is not reused. Empty: unknown, never reused."""
    own_stream_index: tuple[torch.Tensor, ...] | None = field(default=None, compare=False)
    windows: tuple[int | None, ...] = ()
    """Per model layer, the sliding window W of a sliding-window layer (it holds its tail, see the
    module docstring) or `None` for a full-attention layer; empty: every layer is full."""
    own_scores: tuple[torch.Tensor, ...] | None = field(default=None, compare=False)
    """Importance of the held own tokens under the `agnostic` window policy (KVzip's reconstruction
    scores, `cache.attention_scores.ReconstructionScores`): per full-attention model layer
    (`full_layers` order) a `[kv_heads, own_tokens]` float32 CPU tensor (a ragged layer's: `[1, n_0
    + ... + n_{h-1}]`), accumulated when turns commit; `None` when not scored (another policy, or a
    cache restored from a blob, which does not store them)."""
    own_head_tokens: tuple[tuple[int, ...] | None, ...] | None = None

    def __post_init__(self) -> None:
        if sum(span.original_tokens for span in self.layers) != len(self.own_token_ids):
            raise RuntimeError(
                f"bug: layer table covers {sum(s.original_tokens for s in self.layers)} tokens, "
                f"own token ids are {len(self.own_token_ids)}"
            )
        if self.windows and len(self.windows) != len(self.own_keys):
            raise RuntimeError(f"bug: {len(self.windows)} layer windows for {len(self.own_keys)} model layers")
        held = sum(span.token_count for span in self.layers)
        span = self.next_position - self.base_tokens
        if self.own_head_tokens is not None and len(self.own_head_tokens) != len(self.own_keys):
            raise RuntimeError(f"bug: head counts for {len(self.own_head_tokens)} of {len(self.own_keys)} model layers")
        for index, (keys, values) in enumerate(zip(self.own_keys, self.own_values, strict=True)):
            tokens, window = keys.shape[-2], self.window_of(index)
            counts = self.ragged_counts(index)
            # A full layer holds the table's tokens; a sliding one at least its window (or every own
            # position, fewer), at most every own position: a shorter tail would attend to less.
            if counts is not None:
                fits = window is None and keys.shape[1] == 1 and tokens == sum(counts) == len(counts) * held
            else:
                fits = tokens == held if window is None else min(window - 1, span) <= tokens <= span
            if not fits or values.shape[-2] != tokens:
                raise RuntimeError(
                    f"bug: model layer {index} holds {tokens} own keys and {values.shape[-2]} values; the layer "
                    f"table holds {held}, window {window}, {span} own positions"
                )
        if self.own_stream_index is not None and any(
            t.shape[-1] != k.shape[-2] for t, k in zip(self.own_stream_index, self.own_keys, strict=True)
        ):
            raise RuntimeError("bug: stream index does not cover the held tokens")
        if self.base is not None and self.base.key != self.base_key:
            raise RuntimeError(f"bug: attached base {self.base.key} is not {self.base_key}")
        if self.own_scores is not None:
            shapes = [tuple(t.shape) for t in self.own_scores]
            wanted = [(self.own_keys[i].shape[1], self.own_keys[i].shape[-2]) for i in self.full_layers]
            if shapes != wanted:
                raise RuntimeError(f"bug: own scores {shapes} do not cover the held tokens {wanted}")

    # -- sizes ---------------------------------------------------------------------------------

    def window_of(self, layer: int) -> int | None:
        """The sliding window of model layer `layer`, or `None` for full attention."""
        return self.windows[layer] if self.windows else None

    def ragged_counts(self, layer: int) -> tuple[int, ...] | None:
        """The tokens each KV head of model layer `layer` holds when it is stored ragged, else `None`."""
        return self.own_head_tokens[layer] if self.own_head_tokens is not None else None

    def kv_heads(self, layer: int) -> int:
        """KV heads of model layer `layer`."""
        counts = self.ragged_counts(layer)
        return len(counts) if counts is not None else self.own_keys[layer].shape[1]

    def head_tokens(self, layer: int) -> tuple[int, ...]:
        """Own tokens each KV head of model layer `layer` holds (all equal unless ragged)."""
        counts = self.ragged_counts(layer)
        if counts is not None:
            return counts
        return (self.own_keys[layer].shape[-2],) * self.own_keys[layer].shape[1]

    def head_rows(self, layer: int, rows: torch.Tensor) -> list[torch.Tensor]:
        """A per-slot tensor of model layer `layer` (its `own_stream_index` or `own_scores` row:
        `[kv_heads, n]`, or a ragged layer's `[1, n_0 + ...]`) split into one `[n_h]` per KV head."""
        counts = self.ragged_counts(layer)
        return split_heads(rows[0], counts) if counts is not None else list(rows)

    def head_stream_index(self, layer: int) -> list[torch.Tensor]:
        """Per KV head of model layer `layer`, the int64 stream index of each own slot it holds."""
        if self.own_stream_index is not None:
            return self.head_rows(layer, self.own_stream_index[layer])
        held = self.own_keys[layer].shape[-2]
        tail = stream_index_of(self.layers)[-held:] if held else torch.zeros(0, dtype=torch.long)
        return [tail] * self.kv_heads(layer)

    @property
    def score_width(self) -> int:
        """Columns of a scores tensor over this cache (`cache.token_eviction.evict_by_scores`): the
        base, then the longest KV head's own slots over the full model layers (a ragged layer's
        working buffer is padded to its longest head; head `h`'s own slot `i` is column
        `base_tokens + i`). `total_tokens` for a rectangular cache."""
        longest = max((max(self.head_tokens(i), default=0) for i in self.full_layers), default=0)
        return self.base_tokens + max(longest, self.own_tokens)

    @property
    def ragged(self) -> bool:
        """Whether some model layer is stored ragged (per-head counts differ, module docstring)."""
        return self.own_head_tokens is not None and any(c is not None for c in self.own_head_tokens)

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention model layers (those that hold the whole layer table)."""
        return tuple(i for i in range(len(self.own_keys)) if self.window_of(i) is None)

    @property
    def sliding(self) -> bool:
        """Whether any model layer is a sliding-window layer."""
        return any(w is not None for w in self.windows)

    @property
    def base_tokens(self) -> int:
        return len(self.base_token_ids)

    @property
    def own_tokens(self) -> int:
        """Own tokens held per KV head (evicted ones not counted)."""
        return sum(span.token_count for span in self.layers)

    @property
    def evicted_tokens(self) -> int:
        """Tokens evicted by importance from the layers still in the table, per KV head."""
        return sum(span.evicted_tokens for span in self.layers)

    @property
    def next_position(self) -> int:
        """RoPE position of the next token fed: the cached length unless tokens were evicted with
        their positions kept (then larger)."""
        if self.layers:
            return self.layers[-1].position_end
        return self.base_tokens

    @property
    def total_tokens(self) -> int:
        """Tokens in the attention window: base plus own (quantised layers included)."""
        return self.base_tokens + self.own_tokens

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Stream ids the cache covers (evicted tokens included)."""
        return self.base_token_ids + self.own_token_ids

    @property
    def own_nbytes(self) -> int:
        """Bytes of the session's own tensors on the device (the shared base is counted by the pool):
        a sliding-window layer counts its tail only."""
        return sum(t.numel() * t.element_size() for t in (*self.own_keys, *self.own_values))

    def working_nbytes(self, extra_tokens: int) -> int:
        """Bytes of the working buffer `to_working_cache(extra_tokens)` builds: per model layer its
        working tokens (base part included) plus `extra_tokens`, keys and values."""
        total = 0
        for index, keys in enumerate(self.own_keys):
            per_token = 2 * self.kv_heads(index) * keys.shape[3] * keys.element_size()
            longest = max(self.head_tokens(index), default=0)  # a ragged layer's buffer is padded to it
            total += (self._from_base(index) + longest + max(extra_tokens, 1)) * per_token
        return total

    def _from_base(self, layer: int) -> int:
        """Base tokens model layer `layer` attends to: all of them for a full-attention layer; for a
        sliding layer whose tail starts right after the base, the base's last ones up to W - 1 in all."""
        window = self.window_of(layer)
        if window is None:
            return self.base_tokens
        held = self.own_keys[layer].shape[-2]
        if self.next_position - held != self.base_tokens:
            return 0
        return min(self.base_tokens, max(0, window - 1 - held))

    @property
    def next_original_index(self) -> int:
        """Conversation-stream index just after the last cached token."""
        if self.layers:
            last = self.layers[-1]
            return last.original_start + last.original_tokens
        return self.base_tokens

    def full_layer_table(self) -> list[LayerSpan]:
        """The layer table with the shared system-prompt prefix as its first row."""
        rows = []
        if self.base_tokens:
            rows.append(LayerSpan(LayerKind.BASE, None, self.base_tokens, 0, 0))
        rows.extend(self.layers)
        return rows

    # -- construction and conversion -----------------------------------------------------------

    @classmethod
    def empty(
        cls,
        base: BaseLayer | None,
        num_model_layers: int,
        like: torch.Tensor,
        windows: Sequence[int | None] = (),
    ) -> SessionCache:
        """A cache with only the base. `like`: a `[1, kv_heads, 0, head_dim]`-shaped template tensor
        (device and dtype) for the empty own tensors; `windows`: see `SessionCache.windows`."""
        empty = tuple(like.new_empty((*like.shape[:-2], 0, like.shape[-1])) for _ in range(num_model_layers))
        return cls(
            base_key=base.key if base else None,
            base_token_ids=base.token_ids if base else (),
            own_keys=empty,
            own_values=empty,
            own_token_ids=(),
            layers=(),
            base=base,
            windows=tuple(windows) if any(w is not None for w in windows) else (),
        )

    def with_base(self, base: BaseLayer | None) -> SessionCache:
        """Attach (or detach, with `None`) the base tensors; the reference must match."""
        if base is not None and (base.key != self.base_key or base.token_ids != self.base_token_ids):
            raise ValueError(f"base {base.key} does not match this cache's base {self.base_key}")
        return replace(self, base=base)

    def to_working_cache(self, extra_tokens: int) -> WorkingCache:
        """Concatenate base and own tokens into a preallocated `transformers` cache with room for
        `extra_tokens` more (prefill plus `max_new_tokens`), so decoding never reallocates.

        Raises:
            RuntimeError: if the base is referenced but not attached (a bug in the caller).
        """
        if self.base_tokens and self.base is None:
            raise RuntimeError(f"bug: base {self.base_key} must be attached before the turn runs")
        layers = []
        for index, (own_k, own_v) in enumerate(zip(self.own_keys, self.own_values, strict=True)):
            from_base = self._from_base(index)
            counts = self.ragged_counts(index)
            if counts is not None:
                base = None
                if self.base_tokens and self.base is not None:
                    base = (self.base.keys[index], self.base.values[index])
                layers.append(working_layer(own_k, own_v, counts, base, self.next_position, extra_tokens))
                continue
            parts_k, parts_v = [own_k], [own_v]
            if from_base and self.base is not None:
                parts_k.insert(0, self.base.keys[index][:, :, -from_base:])
                parts_v.insert(0, self.base.values[index][:, :, -from_base:])
            offset = self.next_position - (from_base + own_k.shape[-2])
            layers.append(
                PreallocatedLayer.from_parts(
                    parts_k, parts_v, extra_tokens, position_offset=offset, window=self.window_of(index)
                )
            )
        return WorkingCache(layers)

    def after_turn(
        self,
        working: WorkingCache,
        appended_token_ids: Sequence[int],
        spans: Sequence[LayerSpan],
        transcript_digest: str | None = None,
        rendering_digest: str | None = None,
    ) -> SessionCache:
        """The cache after a turn appended `appended_token_ids` to `working`.

        `spans` replaces the table from the first layer the turn touched: a turn extends the
        previous turn layer with its closing tokens (the reply's end-of-turn tokens are fed at the
        start of the next turn) and adds its own layer. Own tensors are copied out of the working
        buffer so the buffer and the base copy in it are freed.
        """
        next_position = self.next_position + len(appended_token_ids)
        appended = len(appended_token_ids)
        own_keys, own_values = [], []
        for index, layer in enumerate(working.prealloc_layers):
            if layer.next_position != next_position:
                raise RuntimeError(
                    f"bug: working layer {index} ends at position {layer.next_position}, expected "
                    f"{self.next_position} + {len(appended_token_ids)}"
                )
            counts = self.ragged_counts(index)
            if counts is not None:  # each head's own slots, then the appended ones past the hole
                own_slots = self.buffer_own_slots(index, appended)
                own_keys.append(gather_heads(layer.filled_keys, own_slots))
                own_values.append(gather_heads(layer.filled_values, own_slots))
                continue
            first = self._own_start(index, layer)
            own_keys.append(layer.filled_keys[:, :, first:].clone())
            own_values.append(layer.filled_values[:, :, first:].clone())
        kept = spans_before(self.layers, spans)
        stream_index = None
        if self.own_stream_index is not None:
            new = appended_stream_index(self.layers, spans, appended)
            rows = []
            for number, (held, keys) in enumerate(zip(self.own_stream_index, own_keys, strict=True)):
                counts = self.ragged_counts(number)
                if counts is not None:
                    rows.append(append_per_head(held, new, counts))
                else:
                    rows.append(torch.cat([held, new.expand(held.shape[0], -1)], dim=-1)[:, -keys.shape[-2] :])
            stream_index = tuple(rows)
        head_tokens = None
        if self.own_head_tokens is not None:
            head_tokens = tuple(None if c is None else tuple(n + appended for n in c) for c in self.own_head_tokens)
        return replace(
            self,
            own_keys=tuple(own_keys),
            own_values=tuple(own_values),
            own_token_ids=self.own_token_ids + tuple(appended_token_ids),
            layers=(*kept, *spans),
            own_stream_index=stream_index,
            own_head_tokens=head_tokens,
            own_scores=None,  # the turn's own scores are added by the caller that logged its queries
            transcript_digest=self.transcript_digest if transcript_digest is None else transcript_digest,
            rendering_digest=self.rendering_digest if rendering_digest is None else rendering_digest,
        )

    def buffer_own_slots(self, layer: int, appended: int = 0) -> list[torch.Tensor]:
        """Per KV head of full model layer `layer`, the int64 slots (CPU) of its working buffer
        (`to_working_cache`) that hold the head's own tokens once `appended` more were written:
        its held ones after the base, then, past a ragged layer's hole, the appended ones."""
        base, counts = self.base_tokens, self.head_tokens(layer)
        longest = max(counts, default=0)
        tail = torch.arange(base + longest, base + longest + appended)
        return [torch.cat([torch.arange(base, base + n), tail]) for n in counts]

    def _own_start(self, index: int, layer: PreallocatedLayer) -> int:
        """First slot of `layer` (model layer `index` of a working cache built from this cache) that
        the cache keeps after the turn: the own tokens for a full layer; a sliding layer's new tail.

        The tail is the own tokens at the W - 1 positions before the next token, and, when the
        turn appended at most W - 1 tokens, also the W - 1 before this cache's end (where the last
        reply ended): the window as it was at the last turn boundary (a **window checkpoint**), so
        that regenerating or editing the last turn forks warm (`prefix`) instead of re-prefilling
        the conversation. A longer turn gets no checkpoint: it would hold the turn twice over."""
        window = self.window_of(index)
        if window is None:
            return self.base_tokens
        end = layer.next_position
        boundary = self.next_position if end - self.next_position <= window - 1 else end
        keep_from = max(self.base_tokens, boundary - (window - 1))
        return max(0, keep_from - (end - layer.get_seq_length()))

    def with_scores(self, own_scores: Sequence[torch.Tensor] | None) -> SessionCache:
        """Same cache with `own_scores` set (or dropped, with `None`); shapes as the field says.

        Raises:
            RuntimeError: if the scores do not cover the held tokens of every full layer.
        """
        return replace(self, own_scores=None if own_scores is None else tuple(own_scores))

    def replace_layers(self, layers: Sequence[LayerSpan]) -> SessionCache:
        """Same tensors with an edited layer table (pinning, precision marks)."""
        return replace(self, layers=tuple(layers))

    def prefix(self, stream_end: int, *, transcript_digest: str, rendering_digest: str) -> SessionCache | None:
        """The cache of the conversation's first `stream_end` stream tokens, for a fork that keeps
        the turns before that point: the same tensors, sliced (views: the cache is immutable, so
        sharing is copying for free), with the layer table cut where the stream ends.

            stream     | base | turn 0 ......... | turn 1 .... | closing | turn 2 ... |
            prefix     | base | turn 0 ......... | turn 1 .... |                     stream_end

        The KV of a token depends only on the tokens before it, so the prefix is exactly what a
        prefill of those tokens computes, provided nothing before `stream_end` was windowed: no
        turn demoted (the layers are contiguous from the base, at their original positions), no
        token evicted, nothing stored at a lower precision. Otherwise returns `None` (the fork is
        rebuilt from its transcript, as a window change is), as it does when the cache does not
        reach `stream_end`.

        A sliding-window layer needs its window as it was at `stream_end` (the own tokens at the
        W - 1 positions before it); its tail holds the last W - 1 positions of the cache, so the
        prefix is `None` (rebuilt) unless the tail still reaches back that far, as it does while the
        conversation is shorter than the window.

        At the cache's own end (`stream_end == next_original_index`: a fork at the parent's latest
        turn) nothing is cut: the whole cache is returned as it is, windowed or not (demoted turns,
        evicted tokens with their `own_stream_index` and `own_scores`, re-rotated keys), so the
        fork continues exactly as the parent would from the same cache, instead of rebuilding and
        answering differently. Only cuts before the end need an unwindowed prefix.
        """
        if self.layers and stream_end == self.next_original_index:
            return replace(self, transcript_digest=transcript_digest, rendering_digest=rendering_digest)
        if self.own_stream_index is not None or not self.base_tokens <= stream_end <= self.next_original_index:
            return None
        layers: list[LayerSpan] = []
        expected = self.base_tokens
        for span in self.layers:
            if span.original_start >= stream_end:
                break
            exact = span.precision == "exact" and not span.evicted_tokens
            if not exact or span.original_start != expected or span.position_start != span.original_start:
                return None
            kept = min(span.token_count, stream_end - span.original_start)
            layers.append(replace(span, token_count=kept))
            expected = span.original_start + span.token_count
        if expected < stream_end:
            return None
        held = stream_end - self.base_tokens
        slices = [self._prefix_slice(index, stream_end) for index in range(len(self.own_keys))]
        if any(s is None for s in slices):
            return None
        return replace(
            self,
            own_keys=tuple(k[:, :, s] for k, s in zip(self.own_keys, slices, strict=True)),
            own_values=tuple(v[:, :, s] for v, s in zip(self.own_values, slices, strict=True)),
            own_token_ids=self.own_token_ids[:held],
            layers=tuple(layers),
            own_scores=None if self.own_scores is None else tuple(t[:, :held] for t in self.own_scores),
            transcript_digest=transcript_digest,
            rendering_digest=rendering_digest,
        )

    def _prefix_slice(self, index: int, stream_end: int) -> slice | None:
        """Own slots of model layer `index` in the prefix ending at `stream_end` (positions equal
        stream indices there), or `None` when a sliding tail no longer holds that window."""
        window = self.window_of(index)
        if window is None:
            return slice(0, stream_end - self.base_tokens)
        first = self.next_position - self.own_keys[index].shape[-2]  # the tail's first position
        wanted = max(self.base_tokens, stream_end - (window - 1))
        if first > wanted:
            return None
        return slice(wanted - first, stream_end - first)
