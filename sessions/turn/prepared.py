"""A turn ready for the engine loop, in two halves decided apart:

- `TurnIds`: the new turn as the template renders it (its ids, what the user message records, the
  stream length and rendering once it is fed), from the reuse path's delta or the rebuild path's
  whole conversation.
- `TurnStart`: where its cache starts (the cache, the ids fed before the turn's own, the layer rows
  they cover, what was reused or computed to get there), decided by the path it took.

`PreparedTurn` joins them; its prefill and layer rows are derived in one place, and it is what the
runner submits and `complete_turn` completes.

```
prefill   | feed (closing, or base + kept past) | ids.turn |
spans     | start.spans ...                     | new turn at start.cache.next_position + len(feed) |
```
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cache.ids import PrefixKey
from cache.layer_table import LayerKind, LayerSpan
from cache.session_cache import SessionCache
from cache.working_cache import WorkingCache
from sessions.records import RestoreSource
from sessions.turn.chat_template import ConversationTokens
from sessions.turn.costs import RestoreChoice
from sessions.turn.transcript import Transcript


@dataclass(frozen=True)
class TurnPlan:
    """Ids of a reuse turn and how they split: `closing` ends the previous turn's layer (dropped
    when that layer is demoted), `turn` starts the new layer. `rendering`: the template's text of
    the conversation up to the generation prompt."""

    closing: tuple[int, ...]
    turn: tuple[int, ...]
    rendering: str = ""


@dataclass(frozen=True)
class PendingBase:
    """A base layer that is in neither the pool nor a blob: the turn prefills it first."""

    key: PrefixKey
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class TurnIds:
    """The new turn as the template renders it, on either path.

    Attributes:
        turn: the new turn's ids (framing, message, generation prompt): fed last, the start of
            its layer.
        user_token_ids: ids recorded with the user message (its closing of the previous turn,
            framing and text, up to the generation prompt).
        stream_tokens: conversation-stream length once the turn's ids are fed.
        rendering: the template's text of the conversation up to the generation prompt; with the
            reply's text it gives the new cache's `rendering_digest`.
        turn_index: the new turn's index in the transcript.
        pinned: the new turn is due to be pinned (`Transcript.pinned`).
    """

    turn: tuple[int, ...]
    user_token_ids: tuple[int, ...]
    stream_tokens: int
    rendering: str
    turn_index: int
    pinned: bool

    @classmethod
    def after(cls, transcript: Transcript, plan: TurnPlan) -> TurnIds:
        """The reuse path's: the turn follows the transcript's fed tokens and the closing."""
        index = len(transcript.turns)
        return cls(
            turn=plan.turn,
            user_token_ids=plan.closing + plan.turn,
            stream_tokens=transcript.token_count + len(plan.closing) + len(plan.turn),
            rendering=plan.rendering,
            turn_index=index,
            pinned=index in transcript.pinned,
        )

    @classmethod
    def of_conversation(cls, transcript: Transcript, conversation: ConversationTokens) -> TurnIds:
        """The rebuild path's: the last turn of the whole stream. The user message records the
        same ids as on the reuse path: everything after the previous turn's fed tokens."""
        ids, turn_start = conversation.token_ids, conversation.turn_starts[-1]
        index = len(transcript.turns)
        return cls(
            turn=tuple(ids[turn_start:]),
            user_token_ids=tuple(ids[min(transcript.token_count, turn_start) :]),
            stream_tokens=len(ids),
            rendering=conversation.rendering,
            turn_index=index,
            pinned=index in transcript.pinned,
        )

    @property
    def turn_start(self) -> int:
        """Stream index where the new turn's layer starts."""
        return self.stream_tokens - len(self.turn)

    def span(self, position: int) -> LayerSpan:
        """The new turn's row at RoPE position `position`; its `token_count` is set once
        generation finishes."""
        kind = LayerKind.BASE if self.pinned else LayerKind.TURN
        return LayerSpan(kind, self.turn_index, 0, self.turn_start, position)


@dataclass(frozen=True)
class TurnStart:
    """Where a prepared turn's cache starts.

    Attributes:
        cache: the session cache the turn starts from (after demotion or eviction), base attached
            unless `pending_base` is set.
        feed: ids fed before the new turn's own: the previous turn's closing (reuse), or a
            rebuild's base (when pending) and kept past.
        spans: layer-table rows of what `feed` covers: the previous turn's layer extended by its
            closing, or the kept past at contiguous positions.
        reused_tokens: tokens served from cache (session cache or pooled base).
        base_reused: part of `reused_tokens` that is the shared base layer.
        demoted_tokens: tokens windowed out before this turn.
        base_computed: tokens prefilled while preparing, outside the turn's prefill: a base
            recomputed by the restore (no copy of it was stored), an attention rebuild's kept
            past and the base it built, or the kept layers a demotion re-prefilled.
        pending_base: set when `feed` starts with the base layer's ids (`cache` then has no
            base); the base is copied into the pool after the turn.
        working: the turn's working buffer when the window step already prefilled the first
            `prefilled_tokens` ids of the prefill into it (an evicting turn under `attention`:
            `sessions.turn.window`); the engine loop continues it. `None`: built from `cache`.
        prefilled_tokens: ids of the prefill already in `working`.
        peak_tokens: most tokens a buffer held while the turn was prepared (a rebuild's kept
            past, chunk by chunk; an evicting turn's full cache with its prefilled ids); 0 when
            preparing prefilled nothing.
    """

    cache: SessionCache
    feed: tuple[int, ...] = ()
    spans: tuple[LayerSpan, ...] = ()
    reused_tokens: int = 0
    base_reused: int = 0
    demoted_tokens: int = 0
    base_computed: int = 0
    pending_base: PendingBase | None = None
    working: WorkingCache | None = field(default=None, compare=False)
    prefilled_tokens: int = 0
    peak_tokens: int = 0


@dataclass(frozen=True)
class PreparedTurn:
    """A turn ready to prefill (see the module docstring).

    Attributes:
        ids: the new turn as the template renders it.
        start: where its cache starts.
        source: where the cache came from (a tier, `rebuilt`, or `new` for a first turn).
        restore_s: seconds the restore took (0 when nothing was stored).
        choice: restore or recompute, for a cache that was in a lower tier (`None` otherwise).
    """

    ids: TurnIds
    start: TurnStart
    source: RestoreSource
    restore_s: float
    choice: RestoreChoice | None = None

    @property
    def cache(self) -> SessionCache:
        return self.start.cache

    @property
    def prefill(self) -> tuple[int, ...]:
        """Ids to run through the model before the first new token."""
        return (*self.start.feed, *self.ids.turn)

    @property
    def unprefilled(self) -> tuple[int, ...]:
        """Ids of `prefill` the engine loop still feeds (those not already in `start.working`)."""
        return self.prefill[self.start.prefilled_tokens :]

    @property
    def spans(self) -> tuple[LayerSpan, ...]:
        """Layer-table rows from the first layer the turn touches; the last is the new turn's,
        right after what `start.feed` fills."""
        position = self.start.cache.next_position + len(self.start.feed)
        return (*self.start.spans, self.ids.span(position))
