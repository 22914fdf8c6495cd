"""Completing a turn once its reply is generated: the session's cache after it, its layer rows, its
stats and the ids the transcript stores. Pure bookkeeping over tensors already computed: no model,
no engine loop, no I/O (`complete_turn`).

A reply cut by a stop string stores what its client saw, as a posted history of it would (the cut
text, its ids and a stop token), so continuing the session answers as a fresh post of that history
does: the cache is cropped back to the end of the cut text when those ids are the first generated
ones, and is not kept otherwise (a cut inside a token), so that the next turn rebuilds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from cache.layer_table import LayerKind, LayerSpan
from cache.session_cache import SessionCache
from cache.window_policy import MIN_TURN_TOKENS
from cache.working_cache import WorkingCache
from sessions.records import FinishReason, Reply, TurnStats
from sessions.turn.chat_template import PastTurn, rendering_digest
from sessions.turn.prepared import PreparedTurn
from sessions.turn.transcript import Transcript, transcript_digest

log = logging.getLogger(__name__)


class ReplyIds(Protocol):
    """The two `ChatTemplate` calls a cut reply needs."""

    def text_reply_ids(self, text: str) -> tuple[int, ...]: ...

    def content_ids(self, assistant_ids: Sequence[int]) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class TurnRules:
    """What completing a turn needs of the model and the settings.

    Attributes:
        template: tokenises a cut reply's text (`ChatTemplate`).
        stop_token_ids: ids that end a reply.
        budget_tokens: the context budget (a pin must leave `MIN_TURN_TOKENS` of it).
    """

    template: ReplyIds
    stop_token_ids: tuple[int, ...]
    budget_tokens: int


@dataclass(frozen=True)
class Generation:
    """What the engine generated for a turn, as the runner's stream read it.

    Attributes:
        token_ids: every sampled id, the stop token included when one ended the reply.
        text: all of them detokenised.
        cut: where the first stop string starts in `text`, or `None`.
        working: the request's working cache: the start cache, the prefill, and every generated id
            but the last (never fed). `complete_turn` may crop it.
        ttft_s: from the turn's call to its first sampled id.
        decode_s: from the first sampled id to the end of the stream.
        queue_s: from submitting the request to the first step that ran it.
    """

    token_ids: tuple[int, ...]
    text: str
    cut: int | None
    working: WorkingCache
    ttft_s: float
    decode_s: float
    queue_s: float

    @property
    def returned_text(self) -> str:
        """The reply as returned: cut before the stop string, if one was found."""
        return self.text if self.cut is None else self.text[: self.cut]


@dataclass(frozen=True)
class TurnOutcome:
    """Everything the manager stores after the turn."""

    reply: Reply
    cache: SessionCache | None
    """The session's cache after the turn; `None` when it is not kept (a stop string cut the reply
    where no cache ends: the next turn rebuilds from the transcript)."""
    user_token_ids: tuple[int, ...]
    reply_token_ids: tuple[int, ...]
    """Ids the transcript stores for the reply: the generated ids (`Reply.token_ids`), or after a
    stop string the returned text's ids and a stop token, as a posted history of that text has."""
    token_count: int
    """Conversation-stream length once the reply's stored ids are fed (all but the last)."""
    unpinned_turn: int | None = None
    """A turn due to be pinned (`pin_first_turn`) that was left unpinned: pinning it would have
    left less than `MIN_TURN_TOKENS` of the window."""


def complete_turn(
    prepared: PreparedTurn,
    generation: Generation,
    *,
    start: SessionCache,
    transcript: Transcript,
    user_text: str,
    rules: TurnRules,
) -> TurnOutcome:
    """The outcome of a generated turn. Nothing is stored here.

    Args:
        prepared: the turn as it was submitted.
        generation: what the engine generated; its working cache is cropped in place when a stop
            string cut the reply and the cache is kept (see the module docstring).
        start: the cache `generation.working` continues: `prepared.cache`, or, when the turn
            prefilled a pending base, an empty cache over that base as adopted into the pool
            (the prefill's base ids are then part of `start`, not of what the turn appended).
        transcript: the transcript before the turn (its digest is chained with the new turn's).
        user_text: the turn's user message.
        rules: the template, stop ids and context budget.
    """
    generated, text = generation.token_ids, generation.returned_text
    if generation.cut is None:
        stored_ids, keep = generated, True
    else:
        stored_ids, keep = _cut_reply(rules.template, text, generated)
    # The reply's part of the stream: every stored id but the last (the generated one never
    # fed, or the stop token after a cut, replaced by the template's closing next turn).
    reply_tokens = len(stored_ids) - 1
    if keep and reply_tokens < len(generated) - 1:
        generation.working.crop(reply_tokens - (len(generated) - 1))  # transformers 5 crops by a negative count
    spans, unpinned = _reply_spans(prepared, start, reply_tokens, rules.budget_tokens)
    cache = None
    if keep:
        prefilled = prepared.prefill if prepared.start.pending_base is None else prepared.prefill[start.base_tokens :]
        cache = start.after_turn(
            generation.working,
            (*prefilled, *generated[:reply_tokens]),
            spans,
            transcript_digest=transcript_digest(transcript.digest, PastTurn(user_text, text, stored_ids), None),
            rendering_digest=rendering_digest(prepared.ids.rendering + text),
        )
    stopped = generation.cut is not None or bool(generated and generated[-1] in rules.stop_token_ids)
    finish: FinishReason = "stop" if stopped else "length"
    reply = Reply(
        text=text,
        token_ids=generated,
        stats=_stats(prepared, generation, cache),
        finish_reason=finish,
        generated_text=None if generation.cut is None else generation.text,
    )
    # Whether the cache was kept or the next turn rebuilds, the stream goes on after the
    # reply's stored ids, as a rebuild from the transcript counts it.
    token_count = prepared.ids.stream_tokens + reply_tokens
    return TurnOutcome(reply, cache, prepared.ids.user_token_ids, stored_ids, token_count, unpinned)


def _cut_reply(template: ReplyIds, text: str, generated: Sequence[int]) -> tuple[tuple[int, ...], bool]:
    """The ids a reply cut by a stop string is stored with, and whether the turn's cache can
    be kept.

    The ids are those a posted history with the returned `text` stores
    (`ChatTemplate.text_reply_ids`: `text` tokenised, then a stop token), so that continuing
    the session answers as a fresh post of what the client saw. The cache is kept (cropped
    to end after `text`'s ids) only if those ids are the first generated ones and were fed:
    not when the cut fell inside a token or `text` tokenises another way; the next turn then
    rebuilds from the transcript.
    """
    stored = template.text_reply_ids(text)
    content = template.content_ids(stored)
    fed = len(generated) - 1  # the working cache holds every generated id but the last
    return stored, len(content) <= fed and tuple(generated[: len(content)]) == content


def _reply_spans(
    prepared: PreparedTurn, start: SessionCache, reply_tokens: int, budget_tokens: int
) -> tuple[list[LayerSpan], int | None]:
    """The turn's layer rows once its reply's `reply_tokens` are fed, and the turn left unpinned
    (`None` if none): a turn due to be pinned stays a turn layer when pinning it would leave less
    than `MIN_TURN_TOKENS` of the budget."""
    spans = list(prepared.spans)
    spans[-1] = replace(spans[-1], token_count=len(prepared.ids.turn) + reply_tokens)
    if not spans[-1].pinned or _pins_leave_room(start, spans, budget_tokens):
        return spans, None
    unpinned = spans[-1].turn_index
    spans[-1] = replace(spans[-1], kind=LayerKind.TURN)
    log.warning("turn %s is not pinned: it would leave no room in the window", unpinned)
    return spans, unpinned


def _pins_leave_room(cache: SessionCache, spans: Sequence[LayerSpan], budget_tokens: int) -> bool:
    first_new = spans[0].original_start
    layers = [s for s in cache.layers if s.original_start < first_new] + list(spans)
    pinned = sum(s.token_count for s in layers if s.pinned)
    return cache.base_tokens + pinned + MIN_TURN_TOKENS <= budget_tokens


def _stats(prepared: PreparedTurn, generation: Generation, cache: SessionCache | None) -> TurnStats:
    start, choice = prepared.start, prepared.choice
    fed = len(prepared.prefill) + max(0, len(generation.token_ids) - 1)  # the last sampled id is never fed
    own_buffer = start.cache.total_tokens + fed
    return TurnStats(
        prefill_tokens=len(prepared.prefill) + start.base_computed,
        reused_tokens=start.reused_tokens,
        ttft_s=generation.ttft_s,
        decode_tokens=len(generation.token_ids),
        decode_s=generation.decode_s,
        restored_from=prepared.source,
        restore_s=prepared.restore_s,
        base_reused_tokens=start.base_reused,
        demoted_tokens=start.demoted_tokens,
        cache_tokens=0 if cache is None else cache.total_tokens,
        peak_tokens=max(start.peak_tokens, own_buffer),
        queue_s=generation.queue_s,
        restore_choice=None if choice is None else "recompute" if choice.recompute else "restore",
        restore_estimate_s=None if choice is None else choice.restore_s,
        recompute_estimate_s=None if choice is None else choice.recompute_s,
    )
