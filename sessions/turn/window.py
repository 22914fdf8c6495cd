"""The window step before a reuse turn: make base + kept tokens + prefill + reply fit the budget.

Two policies (`Settings.window_policy`, docs/architecture.md "Context window"):

- `turns` (default, exact per layer): `WindowPolicy.plan` picks the oldest unpinned turn layers,
  `demote` drops them and re-rotates the kept keys (or re-prefills the kept layers when the model
  has no known RoPE layout).
- `attention` (lossy): one prefill per evicting turn, as SnapKV does it. The turn's own ids
  (closing of the last turn plus the new turn) but the last are prefilled on the full cache while
  the last `observation_tokens` queries of every model layer are captured
  (`cache.attention_scores`); their attention ranks the cached tokens and each KV head evicts its
  least attended tokens of the unpinned turn layers, never the base layer nor the `recent_tokens`
  most recent (`cache.token_eviction`). The prefilled ids' KV (computed with the whole cache in
  view) is carried over behind the kept tokens (`carry_prefill`), and the engine loop feeds only
  the last id before sampling. So an evicting turn prefills its ids once, like a `turns` turn.

      working (full)   | base | own ............................ | turn ids but the last |
      scores           |      | per KV head, from the last W queries of the turn's ids ---^
      working (kept)   | base | own, kept per head | turn ids but the last | last id, reply ...

- `agnostic` (lossy, question-agnostic): evicts like `attention`, but by scores fixed when the
  previous turns committed (`SessionCache.own_scores`), so the kept set does not depend on the
  next question and the window step prefills nothing. The scores are KVzip's (Kim et al.,
  NeurIPS 2025): when a turn commits, after its reply was streamed, the runner has the model
  repeat the ids the turn added on a copy of the cache (`reconstruction_scores`, prefill-only
  requests of the engine loop) and each held token keeps the most attention any reconstruction
  query paid it, over the turns so far (`sessions.turn.runner.TurnRunner._commit_scores`). A
  cache without scores (restored from a blob, or a failed reconstruction) evicts by recency until
  a turn commits on it. A chunked rebuild (`prefill_evicting`) scores its chunks by their own
  queries instead (`cache.attention_scores.QueryLog`: no reconstruction pass per chunk).
  `benchmarks/window_quality.py` measures both scores: the reconstruction pays with per-head
  budgets (Ada-KV, the default allocation); with uniform budgets it is about even with the query
  log, at more cost per commit (benchmarks/README.md, "KVzip's own scores").

Only full-attention model layers evict under `attention` and `agnostic`: a sliding-window layer
holds its window and no more (never scored past it); a model without full-attention layers demotes
whole turns under every policy.

Kept keys keep their positions under the lossy policies, so positions outgrow the cache; a turn
whose positions would pass the model's position limit takes the rebuild path instead
(`positions_overflow`), which prefills the kept past at contiguous positions and evicts from it
the same way (`TurnPreparer._rebuild_by_eviction` in `sessions/turn/preparer.py`): at once (at
most 1.25x the budget), or, with `window_rebuild_chunk_tokens`, in chunks that each evict down to
the budget before the next (`prefill_evicting`).

A session's cache works under either policy, so changing `window_policy` on a home with sessions
is handled, not refused: `turns` demotes a layer that lost tokens as a whole (its gaps move with
it), `attention` evicts from layers that `turns` re-rotated.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from cache.attention_scores import ObservationWindow, QueryLog, ReconstructionScores
from cache.layer_table import LayerSpan, span_offsets
from cache.session_cache import SessionCache
from cache.token_eviction import carry_prefill, committed_scores, evict_by_scores, evictable_tokens, stored_scores
from cache.window_policy import LOSSY_POLICIES, ContextOverflow, WindowPlan, WindowPolicy, demote_by_rotation
from cache.working_cache import WorkingCache
from sessions.engine import Engine
from sessions.engine.request import KVAccountant
from sessions.errors import ContextTooLong

log = logging.getLogger(__name__)

RECONSTRUCTION_INSTRUCTION = "Repeat the previous context exactly."
"""The user turn of KVzip's reconstruction prompt (Kim et al., 2025, whose prompt asks the same)."""
RECONSTRUCTION_CHUNK_TOKENS = 2048
"""Context ids reconstructed per prefill (KVzip's chunk: about 2K); a chunk's buffer holds the cache,
the prompt and the chunk."""


@dataclass(frozen=True)
class FittedWindow:
    """The cache a reuse turn starts from.

    Attributes:
        cache: after demotion or eviction.
        demoted_tokens: tokens per KV head windowed out before this turn (whole layers, or
            evicted tokens).
        last_demoted: the last turn layer was demoted, so its closing ids are not fed.
        scoring_s / eviction_s: under `attention` (0 otherwise), seconds spent on the observed
            prefill (the turn's own ids but the last, with the scores) and on gathering the kept
            tokens and carrying the prefill over.
        working: under `attention` when tokens were evicted, the turn's working buffer: `cache`
            followed by the first `prefilled_tokens` of the turn's ids (closing, then turn), with
            room for the rest and the reply; the turn continues it instead of building one.
        prefilled_tokens: how many of the turn's ids `working` already holds.
        peak_tokens: most tokens a buffer of the window step held (the full cache with the
            prefilled ids); 0 when it prefilled nothing.
        recomputed_tokens: kept own tokens a demotion re-prefilled (no RoPE layout, or a ragged
            cache), so not served from the cache.
    """

    cache: SessionCache
    demoted_tokens: int
    last_demoted: bool
    scoring_s: float = 0.0
    eviction_s: float = 0.0
    working: WorkingCache | None = None
    prefilled_tokens: int = 0
    peak_tokens: int = 0
    recomputed_tokens: int = 0


@dataclass(frozen=True)
class KeptLayers:
    """The layers a demotion keeps, to be prefilled after the base (`restack_kept`).

    Attributes:
        ids: their stream ids, in order (evicted tokens included: a prefill holds every token).
        spans: their rows at contiguous positions from the end of the base, every token held.
    """

    ids: tuple[int, ...]
    spans: tuple[LayerSpan, ...]


def restack_kept(
    layers: Iterable[tuple[LayerSpan, Sequence[int]]], demote: Sequence[LayerSpan], base_tokens: int
) -> KeptLayers:
    """The walk every re-prefill of kept layers makes (a demotion without a RoPE layout, a
    rebuild's kept past): skip the layers in `demote`, lay the others one after another from
    position `base_tokens`.

    Args:
        layers: each layer's row with the stream ids it covers (`original_tokens` of them), in
            stream order.
        demote: rows of `layers` to drop (matched by `original_start`).
        base_tokens: length of the base layer the kept layers follow.
    """
    dropped = {span.original_start for span in demote}
    ids: list[int] = []
    spans: list[LayerSpan] = []
    position = base_tokens
    for span, span_ids in layers:
        if span.original_start in dropped:
            continue
        ids.extend(span_ids)
        spans.append(replace(span, position_start=position, token_count=span.original_tokens, evicted_tokens=0))
        position += span.original_tokens
    return KeptLayers(tuple(ids), tuple(spans))


@dataclass(frozen=True)
class EvictedPast:
    """A rebuild's kept past, prefilled chunk by chunk (`TurnWindow.prefill_evicting`).

    Attributes:
        cache: the base and the past, evicted down to the budget.
        peak_tokens: most tokens one chunk's buffer held (the cache so far plus the chunk).
    """

    cache: SessionCache
    peak_tokens: int


def chunk_spans(held: Sequence[LayerSpan], kept: Sequence[LayerSpan], start: int, end: int) -> tuple[LayerSpan, ...]:
    """Layer-table rows a chunk of the kept past fills, from the first layer it touches.

    Args:
        held: the cache's rows so far (a layer the previous chunk began is extended: its held and
            evicted counts stay, the chunk's tokens are added).
        kept: every row of the kept past, whole (`KeptLayers.spans`).
        start, end: the chunk, as offsets into the kept past's ids.
    """
    so_far = {span.original_start: span for span in held}
    rows, offset = [], 0
    for span in kept:
        first, last = max(start, offset), min(end, offset + span.original_tokens)
        if first < last:
            old, fed = so_far.get(span.original_start), last - first
            rows.append(replace(old or span, token_count=(old.token_count if old else 0) + fed))
        offset += span.original_tokens
    return tuple(rows)


class TurnWindow:
    """Fits a reuse turn into the window under the configured policy (see the module docstring).

    Args:
        engine: runs the scoring prefill and any re-prefill of kept layers.
        window: the budget and policy settings.
        accountant: pays for the working buffers of those prefills out of the device budget
            (idle caches move down first), as the engine loop does for a request's buffer;
            `None` reserves nothing.
    """

    def __init__(self, engine: Engine, window: WindowPolicy, accountant: KVAccountant | None = None) -> None:
        self.engine = engine
        self.window = window
        self.accountant = accountant

    @contextmanager
    def device_buffer(self, tokens: int) -> Iterator[None]:
        """Hold a device reservation for a working buffer of `tokens` tokens while the block runs.
        Forced: a prefill that must run is never refused, but idle caches make room first."""
        nbytes = tokens * self.engine.layout.bytes_per_token
        if self.accountant is None or nbytes <= 0:
            yield
            return
        self.accountant.reserve_device_bytes(nbytes, force=True)
        try:
            yield
        finally:
            self.accountant.release_device_bytes(nbytes)

    def positions_overflow(self, cache: SessionCache, prefill_tokens: int, max_new_tokens: int) -> bool:
        """Would this turn run past the model's positions (possible once tokens were evicted with
        their positions kept)? Then the turn must rebuild its window from the transcript."""
        return cache.next_position + prefill_tokens + max_new_tokens > self.engine.max_context_tokens

    def plan_layers(
        self, layers: Sequence[LayerSpan], base_tokens: int, closing_tokens: int, turn_tokens: int, max_new_tokens: int
    ) -> WindowPlan:
        """`WindowPolicy.plan`, with `ContextOverflow` raised as `ContextTooLong`."""
        try:
            return self.window.plan(layers, base_tokens, closing_tokens, turn_tokens, max_new_tokens)
        except ContextOverflow as exc:
            raise ContextTooLong(exc.needed_tokens, exc.budget_tokens, reply_tokens=max_new_tokens) from None

    def fit(
        self, cache: SessionCache, closing: Sequence[int], turn: Sequence[int], max_new_tokens: int
    ) -> FittedWindow:
        """Shrink `cache` so the turn fits.

        Raises:
            ContextTooLong: if it cannot fit (pinned turns, base and the recent window too large).
        """
        if self.window.policy in LOSSY_POLICIES and cache.full_layers:
            return self._evict(cache, [*closing, *turn], max_new_tokens)
        window = self.plan_layers(cache.layers, cache.base_tokens, len(closing), len(turn), max_new_tokens)
        last = cache.layers[-1].original_start if cache.layers else None
        last_demoted = any(span.original_start == last for span in window.demote)
        recomputed = 0
        if window.demote:
            rotates = self.rotates(cache)
            cache = self.demote(cache, window.demote)
            recomputed = 0 if rotates else cache.own_tokens
        return FittedWindow(cache, window.demoted_tokens, last_demoted, recomputed_tokens=recomputed)

    def _evict(self, cache: SessionCache, prefill: list[int], max_new_tokens: int) -> FittedWindow:
        needed = cache.total_tokens + len(prefill) + max_new_tokens
        excess = needed - self.window.budget_tokens
        if excess <= 0:
            return FittedWindow(cache, 0, False)
        evictable = evictable_tokens(cache, self.window.recent_tokens)
        if excess > evictable:
            raise ContextTooLong(needed - evictable, self.window.budget_tokens, reply_tokens=max_new_tokens)
        if self.window.policy == "agnostic":  # scores fixed at commit: no prefill, only the gather
            started = time.perf_counter()
            evicted = evict_by_scores(
                cache, stored_scores(cache), excess, self.window.recent_tokens, self.window.allocation
            )
            return FittedWindow(evicted, excess, False, 0.0, time.perf_counter() - started)
        if len(prefill) < 2:  # nothing to prefill ahead of the request's own last id: score on a copy
            started = time.perf_counter()
            scores = self.score(cache, prefill)
            scored = time.perf_counter()
            evicted = evict_by_scores(cache, scores, excess, self.window.recent_tokens, self.window.allocation)
            held = cache.total_tokens + len(prefill)
            return FittedWindow(evicted, excess, False, scored - started, time.perf_counter() - scored, None, 0, held)
        return self._prefill_and_evict(cache, prefill, excess, max_new_tokens)

    def _prefill_and_evict(
        self, cache: SessionCache, prefill: Sequence[int], excess: int, max_new_tokens: int
    ) -> FittedWindow:
        """The one prefill of an evicting turn (module docstring): every id of `prefill` but the
        last on the full cache, observed; evict `excess` tokens per head; carry the prefill over."""
        ahead = len(prefill) - 1
        extra = len(prefill) + max_new_tokens
        with self.device_buffer(cache.score_width + extra):
            started = time.perf_counter()
            working = cache.to_working_cache(extra)
            with ObservationWindow(working, self.window.observation_tokens) as observed:
                self.engine.prefill(working, prefill[:ahead])
            scores = observed.scores(cache.score_width)
            scored = time.perf_counter()
            evicted = evict_by_scores(cache, scores, excess, self.window.recent_tokens, self.window.allocation)
            carried = carry_prefill(evicted, working, ahead, extra - ahead)
            del working
        done = time.perf_counter()
        held = cache.total_tokens + ahead
        return FittedWindow(evicted, excess, False, scored - started, done - scored, carried, ahead, held)

    def prefill_evicting(self, cache: SessionCache, kept: KeptLayers) -> EvictedPast:
        """`cache` with the kept past `kept` prefilled after it in chunks, evicting as it goes, so
        that no buffer holds more than the budget plus one chunk (issue 31): a rebuild's cost and
        memory follow the budget, and it keeps pieces of more of the past than dropping whole
        oldest turns down to the budget would.

        Each chunk (`rebuild_chunk_tokens`, or more while the cache is below the budget: those
        need no eviction) is prefilled on the cache so far with its queries captured, then every
        KV head evicts its lowest-scored tokens (base, pinned turns and the last `recent_tokens`
        kept) until the cache fits the budget again:

            cache so far (<= budget) | chunk ........ |   prefilled, its queries observed
            scores                   | ... over both  |   `attention`: the chunk's last
                                                          `observation_tokens` queries (SnapKV's
                                                          observation window, Li et al., 2024);
                                                          `agnostic`: every query, the most
                                                          attention each token got, accumulated
                                                          into `own_scores` (KVzip-style, Kim et
                                                          al., 2025), as when turns commit
            evicted                  | kept, per head (<= budget) |  the next chunk follows

        This is SnapKV's prefill compression applied chunk by chunk (a bounded "pot" compressed
        whenever it fills, as InfiniPot does: Kim et al., EMNLP 2024): each time the cache must
        shrink, its tokens are judged by the latest chunk's queries, not by the whole
        conversation's (nor by the next question, until the turn's own prefill evicts).

        Args:
            cache: base (and nothing else held yet) at the position the past starts from.
            kept: the past's ids and rows at contiguous positions after `cache` (`restack_kept`).

        Raises:
            ContextTooLong: if a chunk cannot be made to fit: base, pinned turns and the recent
                window alone exceed the budget.
            ValueError: if the policy's `rebuild_chunk_tokens` is 0 (a rebuild at once).
        """
        if self.window.rebuild_chunk_tokens < 1:
            raise ValueError("prefill_evicting needs rebuild_chunk_tokens >= 1; 0 prefills the past at once")
        position, peak = 0, cache.total_tokens
        while position < len(kept.ids):
            size = max(self.window.rebuild_chunk_tokens, self.window.budget_tokens - cache.total_tokens, 1)
            end = min(len(kept.ids), position + size)
            peak = max(peak, cache.total_tokens + end - position)
            cache = self._prefill_chunk(cache, kept, position, end)
            position = end
        return EvictedPast(cache, peak)

    def _prefill_chunk(self, cache: SessionCache, kept: KeptLayers, start: int, end: int) -> SessionCache:
        """One step of `prefill_evicting`: `kept.ids[start:end]` prefilled, observed, evicted."""
        ids = kept.ids[start:end]
        agnostic = self.window.policy == "agnostic"
        excess = cache.total_tokens + len(ids) - self.window.budget_tokens
        with self.device_buffer(cache.score_width + len(ids)):
            working = cache.to_working_cache(len(ids))
            spans = chunk_spans(cache.layers, kept.spans, start, end)
            if not agnostic and excess <= 0:  # nothing to evict: no scores needed
                self.engine.prefill(working, ids)
                return cache.after_turn(working, ids, spans)
            observer = QueryLog(working) if agnostic else ObservationWindow(working, self.window.observation_tokens)
            with observer:
                self.engine.prefill(working, ids)
            after = cache.after_turn(working, ids, spans)
            if isinstance(observer, QueryLog):
                after = after.with_scores(committed_scores(cache, after, observer.turn_scores()))
                scores = stored_scores(after)
            else:  # the buffer's columns are `cache`'s slots: a ragged head's chunk follows the longest head
                fresh = tuple(observer.scores(cache.score_width + len(ids)))
                scores = stored_scores(after.with_scores(committed_scores(cache.with_scores(None), after, fresh)))
            del working, observer
        if excess <= 0:
            return after
        evictable = evictable_tokens(after, self.window.recent_tokens)
        if excess > evictable:
            raise ContextTooLong(after.total_tokens - evictable, self.window.budget_tokens)
        return evict_by_scores(after, scores, excess, self.window.recent_tokens, self.window.allocation)

    def score(self, cache: SessionCache, prefill: Sequence[int]) -> torch.Tensor:
        """`[full_model_layers, kv_heads, cache.score_width]` float32 importance of the cached tokens
        to the last `observation_tokens` of `prefill` (prefilled on a copy of the cache, which is
        then dropped; the copy's buffer is reserved against the device budget meanwhile)."""
        with self.device_buffer(cache.score_width + len(prefill)):
            working = cache.to_working_cache(len(prefill))
            with ObservationWindow(working, self.window.observation_tokens) as observed:
                self.engine.prefill(working, prefill)
            del working
            return observed.scores(cache.score_width)

    def reconstruction_scores(
        self,
        cache: SessionCache,
        context_ids: Sequence[int],
        prompt_ids: Sequence[int],
        chunk_tokens: int = RECONSTRUCTION_CHUNK_TOKENS,
    ) -> torch.Tensor:
        """KVzip's question-agnostic scores of every cached token (Kim et al., "KVzip: Query-Agnostic
        KV Cache Compression with Context Reconstruction", NeurIPS 2025): the model is made to
        repeat `context_ids` on top of `cache`, and each cached KV pair scores the most attention
        any reconstruction query of the KV group's query heads paid it (`ReconstructionScores`).

            buffer (a copy)   | base | own ........................ | prompt | chunk of context_ids |
            scored            | every cached slot <----------------- max over these queries -----|

        Each chunk of `chunk_tokens` ids is prefilled after the prompt on its own copy of the cache
        (as KVzip chunks its reconstruction), and a pair keeps its best score over the chunks. The
        copies, the reconstruction's KV among them, are dropped: nothing enters the session cache.
        Each copy's buffer is reserved against the device budget while it lives.

        Args:
            cache: the cache to score (positions of the reconstruction continue after it).
            context_ids: what the model repeats (a turn's ids, or the whole held context's).
            prompt_ids: `ChatTemplate.reconstruction_prompt_ids(RECONSTRUCTION_INSTRUCTION)`.
            chunk_tokens: context ids per prefill.

        Returns:
            `[full_model_layers, kv_heads, cache.score_width]` float32 on the CPU, in `[0, 1]`
            (sliding-window layers are not scored).

        Raises:
            ValueError: if `context_ids` is empty or `chunk_tokens < 1`.
        """
        if not context_ids or chunk_tokens < 1:
            raise ValueError(f"need context ids and chunk_tokens >= 1, got {len(context_ids)} ids, {chunk_tokens}")
        chunks = range(0, len(context_ids), chunk_tokens)
        scored = [self._reconstruct(cache, [*prompt_ids, *context_ids[i : i + chunk_tokens]]) for i in chunks]
        return torch.stack(scored).amax(dim=0)

    def _reconstruct(self, cache: SessionCache, ids: Sequence[int]) -> torch.Tensor:
        """One chunk of `reconstruction_scores`, on a copy of `cache` that is dropped after."""
        with self.device_buffer(cache.score_width + len(ids)):
            working = cache.to_working_cache(len(ids))
            with ReconstructionScores(working, cache.score_width) as observed:
                self.engine.prefill(working, ids)
            del working
        return observed.scores()

    def rotates(self, cache: SessionCache) -> bool:
        """Whether `demote` moves `cache`'s kept keys by RoPE re-rotation (else it re-prefills them):
        the model has a known RoPE layout and the cache is not ragged."""
        return self.engine.rope_layout is not None and not cache.ragged

    def demote(self, cache: SessionCache, demote: Sequence[LayerSpan]) -> SessionCache:
        """Drop whole layers: re-rotate the kept keys, or re-prefill the kept layers (evicted
        tokens included: that path is exact) when the model has no known RoPE layout or the
        cache is ragged (per-head budgets: its heads' slots of a layer differ)."""
        if self.rotates(cache) and self.engine.rope_layout is not None:
            return demote_by_rotation(cache, demote, self.engine.rope_layout)
        own = [
            (span, cache.own_token_ids[off : off + span.original_tokens]) for span, _, off in span_offsets(cache.layers)
        ]
        kept = restack_kept(own, demote, cache.base_tokens)
        return self.prefill_layers(self.engine.empty_cache(cache.base), kept.ids, kept.spans)

    def prefill_layers(self, cache: SessionCache, ids: Sequence[int], spans: Sequence[LayerSpan]) -> SessionCache:
        """`cache` with `ids` prefilled after it as the layers `spans`, at once and outside the
        engine loop (a demotion's re-prefill, a rebuild's kept past), its working buffer reserved
        against the device budget meanwhile. `cache` itself when `ids` is empty."""
        if not ids:
            return cache
        with self.device_buffer(len(ids)):
            working = cache.to_working_cache(len(ids))
            self.engine.prefill(working, ids)
            return cache.after_turn(working, ids, spans)
