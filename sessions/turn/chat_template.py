"""Token ids of a conversation from the model's chat template, without re-tokenising replies.

A reply's ids are the ids the model generated. Re-tokenising its text can give other ids ("\\n\\n"
as one token or two, a word split differently), which would silently invalidate the KV cache of
every later token. So the template is rendered as text, cut at fixed points, and only the
template's own pieces are tokenised; each assistant content is spliced in as its generated ids:

    piece                                          cut at                  ids
    <|im_start|>system\nS<|im_end|>\n              0 .. base end           tokenised (the base layer)
    <|im_start|>user\nQ<|im_end|>\n                base end .. content     tokenised
      <|im_start|>assistant\n                         start
    A (the reply content)                          content start .. end    generated ids
    <|im_end|>\n                                   content end .. turn 1   tokenised (closes turn 0)
    <|im_start|>user\n...                          turn 1 start ..         tokenised

The cut points are where renderings of prefixes of the conversation end: the text of turn `i`
starts where the rendering of the messages before it ends, and assistant content `i` starts where
the rendering with the generation prompt ends. Rendering every prefix costs a render per turn
(quadratic in the conversation), so `conversation` renders once and finds the cut points in one
pass from the framing the template puts around a probe conversation (the text a user turn starts
with, the generation prompt), checking the last turn against its prefix renders as `next_turn`
cuts it. If the template renders earlier messages differently once more are added (the prefix
property fails), the cut points do not exist; `TemplateDivergence` tells the caller not to reuse a
cache that no longer matches. The caller then prefills `whole_conversation`:
one render of every message, with each reply the template kept verbatim spliced in as its ids and
every reply it rewrote (shortened, say) tokenised as rendered, so the model sees exactly what the
template says the conversation is now.

A template can also render the cached part differently without any new message: one that reads
the clock (`strftime_now`, Llama 3.x's "Today Date") changes its system turn at midnight. So every
cache records `rendering_digest` of the text it stands for (through its last reply's content), and
`next_turn` refuses the cache when a fresh render of that part has another digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

_PROBE_USER = "chatkv-probe-user-7f3a"
_PROBE_REPLY = "chatkv-probe-reply-9c1e"
_PROBE_NEXT = "chatkv-probe-next-2b6d"


MAX_RENDERED_CUTS = 16
"""Turns of one conversation that may be cut by rendering their prefixes (see `_turn_cuts`)."""


class TemplateDivergence(Exception):
    """The template renders earlier turns differently once a message is added (no stable prefix)."""


class Tokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def __call__(self, text: list[str], add_special_tokens: bool = ...) -> Any:
        """A batch: `["input_ids"]` holds each text's ids."""
        ...


@dataclass(frozen=True)
class PastTurn:
    """A completed turn: the user's text, the reply text and the reply's generated ids."""

    user_text: str
    assistant_text: str
    assistant_ids: tuple[int, ...]


@dataclass(frozen=True)
class ConversationTokens:
    """The conversation stream up to the new turn's generation prompt.

    Attributes:
        token_ids: every id the model sees, in order: base, each turn (user framing, generated
            reply content, closing), and the new turn up to the generation prompt.
        base_tokens: length of the shareable prefix (the system-prompt rendering).
        turn_starts: stream index where each turn begins; the last entry is the new turn. From
            `whole_conversation`, the earlier turns are one entry (the history as one layer).
        rendering: the template's text these ids stand for.
    """

    token_ids: tuple[int, ...]
    base_tokens: int
    turn_starts: tuple[int, ...]
    rendering: str


@dataclass(frozen=True)
class TurnDelta:
    """Ids to add after the previous turn's reply content.

    Attributes:
        closing_ids: the template's end of the previous turn (end-of-turn marker and separator);
            they belong to the previous turn's layer.
        turn_ids: the new turn's rendering up to the generation prompt.
        rendering: the template's text of the whole conversation up to the generation prompt.
    """

    closing_ids: tuple[int, ...]
    turn_ids: tuple[int, ...]
    rendering: str


@dataclass(frozen=True)
class _TurnCut:
    """Character offsets of one past turn in a rendered conversation (see `ChatTemplate._turn_cuts`)."""

    content_start: int
    content_end: int
    next_start: int


def rendering_digest(text: str) -> str:
    """SHA-256 of a rendered conversation: what a cache records of the text its ids stand for."""
    return hashlib.sha256(text.encode()).hexdigest()


class ChatTemplate:
    """Renders a model's chat template into exact token ids. See the module docstring.

    Args:
        tokenizer: a `transformers` tokenizer with a chat template.
        stop_token_ids: ids that end a reply; a trailing one is not part of the reply content.

    Raises:
        ValueError: if the tokenizer has no chat template.
    """

    def __init__(self, tokenizer: Tokenizer, stop_token_ids: Sequence[int]) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; chatkv needs one to frame turns")
        self._tokenizer = tokenizer
        self._stop_ids = frozenset(stop_token_ids)
        self._reply_end = tuple(stop_token_ids[:1])
        self._user_prefix = self._probe_user_prefix()
        self._reply_prefix = self._probe_reply_prefix()

    # -- public --------------------------------------------------------------------------------

    def content_ids(self, assistant_ids: Sequence[int]) -> tuple[int, ...]:
        """The reply content: generated ids without a trailing stop token."""
        if assistant_ids and assistant_ids[-1] in self._stop_ids:
            return tuple(assistant_ids[:-1])
        return tuple(assistant_ids)

    def text_reply_ids(self, text: str) -> tuple[int, ...]:
        """Ids of a reply known by its text only (a posted history, or a reply cut by a stop
        string): the text tokenised, then the first stop token, so it reads as a complete reply
        (an empty one too) and the next turn feeds the template's closing after it."""
        return (*self._encode(text), *self._reply_end)

    def history_ids(self, history: Sequence[tuple[str, str]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per posted turn `(user text, reply text)`: the user text's ids and `text_reply_ids` of
        the reply, in one batch call of the tokenizer (the same ids as one by one)."""
        encoded = self._encode_many([text for turn in history for text in turn])
        return [(encoded[2 * i], (*encoded[2 * i + 1], *self._reply_end)) for i in range(len(history))]

    def reconstruction_prompt_ids(self, instruction: str) -> tuple[int, ...]:
        """Ids that follow a reply's content to ask the model to repeat the context: the reply's
        closing, a user turn with `instruction`, the generation prompt (KVzip's reconstruction
        prompt, Kim et al., 2025: the context's ids are fed after it)."""
        probe = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_REPLY},
            {"role": "user", "content": instruction},
        ]
        full = self._render(probe, True)
        end = full.find(_PROBE_REPLY)
        if end < 0:
            raise TemplateDivergence("the probe reply is not rendered verbatim")
        return self._encode(full[end + len(_PROBE_REPLY) :])

    def system_prefix_ids(self, system_prompt: str | None) -> tuple[int, ...]:
        """Ids of the shareable prefix (the system-prompt rendering) of any conversation with this
        system prompt; empty if the template has none that stays fixed."""
        messages = [*_system_messages(system_prompt), {"role": "user", "content": _PROBE_USER}]
        text = self._render(messages, add_generation_prompt=False)
        return self._encode(text[: self._base_end(text)])

    def conversation(self, system_prompt: str | None, past: Sequence[PastTurn], user_text: str) -> ConversationTokens:
        """The whole stream for a new user message after `past` turns: one render of the
        conversation, cut in one pass (`_turn_cuts`), so the work is linear in its length.

        Raises:
            TemplateDivergence: if the template has no stable prefix for these messages.
        """
        system = _system_messages(system_prompt)
        full = self._render([*system, *_turn_messages(past), {"role": "user", "content": user_text}], True)
        base_text = self._system_text(system)
        if not full.startswith(base_text):
            raise TemplateDivergence("the system prefix renders differently with the real messages")
        cuts = self._turn_cuts(full, len(base_text), system, past)
        # Every piece of template text in one batch call: a 2,000-message history is 3,000 pieces,
        # which one by one cost seconds of Python holding the GIL (the engine loop's and every
        # other turn's); the fast tokenizer encodes a batch in Rust.
        pieces, cursor = [base_text], len(base_text)
        for cut in cuts:
            pieces += [full[cursor : cut.content_start], full[cut.content_end : cut.next_start]]
            cursor = cut.next_start
        pieces.append(full[cursor:])
        encoded = iter(self._encode_many(pieces))
        ids: list[int] = list(next(encoded))
        base_tokens = len(ids)
        turn_starts: list[int] = []
        for turn in past:
            turn_starts.append(len(ids))
            ids += next(encoded)
            ids += self.content_ids(turn.assistant_ids)
            ids += next(encoded)
        turn_starts.append(len(ids))
        ids += next(encoded)
        return ConversationTokens(tuple(ids), base_tokens, tuple(turn_starts), full)

    def whole_conversation(
        self, system_prompt: str | None, past: Sequence[PastTurn], user_text: str
    ) -> ConversationTokens:
        """The stream exactly as the template renders the whole conversation now (one render),
        for templates that rewrite history (`conversation` raised `TemplateDivergence`).

        A reply rendered verbatim right after its turn's generation prompt is spliced in as its
        generated ids; a reply the template rewrote is tokenised as rendered, with the text around
        it. Layers are coarse: the system prefix when it renders as in a first turn, the earlier
        turns as one layer, and the new turn from its user framing when that can be found.
        """
        system = _system_messages(system_prompt)
        full = self._render([*system, *_turn_messages(past), {"role": "user", "content": user_text}], True)
        base_text = self._system_text(system)
        base_end = len(base_text) if full.startswith(base_text) else 0
        ids: list[int] = list(self._encode(full[:base_end]))
        base_tokens = len(ids)
        cursor = search = base_end  # cursor: end of the text turned into ids; search: where to look next
        for turn in past:
            user_at = full.find(turn.user_text, search)
            if user_at >= 0:
                search = user_at + len(turn.user_text)
            header_at = full.find(self._reply_prefix, search)
            if header_at < 0:
                break
            search = header_at + len(self._reply_prefix)
            content_end = search + len(turn.assistant_text)
            if full[search:content_end] != turn.assistant_text:
                continue  # rewritten: tokenised with the text that follows
            ids += self._encode(full[cursor:search])
            ids += self.content_ids(turn.assistant_ids)
            cursor = search = content_end
        new_turn_at = full.find(self._user_prefix, search) if past and self._user_prefix else -1
        if new_turn_at >= 0:
            ids += self._encode(full[cursor:new_turn_at])
            cursor = new_turn_at
        new_turn_start = len(ids)
        ids += self._encode(full[cursor:])
        starts = (base_tokens, new_turn_start) if new_turn_start > base_tokens else (base_tokens,)
        return ConversationTokens(tuple(ids), base_tokens, starts, full)

    def next_turn(
        self, system_prompt: str | None, past: Sequence[PastTurn], user_text: str, *, cached_digest: str
    ) -> TurnDelta:
        """Ids after the last reply's content for a new user message: three renders, whatever the
        length of the conversation. Requires at least one past turn.

        Args:
            cached_digest: the cache's `rendering_digest`; the conversation through the last
                reply's content must render to the text it was taken of.

        Raises:
            TemplateDivergence: if the earlier messages render differently with the new one added,
                or differently from what the cache was computed from (a date in the template).
        """
        if not past:
            raise ValueError("next_turn needs a past turn; use conversation() for the first")
        system = _system_messages(system_prompt)
        messages = system + _turn_messages(past)
        full = self._render([*messages, {"role": "user", "content": user_text}], True)
        last = past[-1]
        content_start = self._prefix_length(full, messages[:-1], True)
        content_end = content_start + len(last.assistant_text)
        if full[content_start:content_end] != last.assistant_text:
            raise TemplateDivergence("the last reply is not rendered verbatim")
        if rendering_digest(full[:content_end]) != cached_digest:
            raise TemplateDivergence("the cached part renders differently now (a date, or another template)")
        turn_start = self._prefix_length(full, messages, False)
        if turn_start < content_end:
            raise TemplateDivergence("the last reply's closing precedes its content")
        return TurnDelta(
            closing_ids=self._encode(full[content_end:turn_start]),
            turn_ids=self._encode(full[turn_start:]),
            rendering=full,
        )

    # -- internals -----------------------------------------------------------------------------

    def _turn_cuts(
        self, full: str, base_end: int, system: list[dict[str, str]], past: Sequence[PastTurn]
    ) -> list[_TurnCut]:
        """Where each past turn's reply content starts and ends in `full`, and where the next turn
        starts, found in one pass from the probed framing (`_user_prefix`, `_reply_prefix`):

            turn i   | user prefix | user text | ... reply prefix | reply content | closing | turn i+1
                     ^ start                                      ^ content_start ^ content_end ^ next_start

        A turn whose framing is not where the probe says (a template that frames the first user
        turn otherwise, or trims a message) is cut by rendering its two prefixes instead, which
        costs two renders of the conversation; more than `MAX_RENDERED_CUTS` such turns is
        `TemplateDivergence` (the caller then renders the whole conversation once). The last
        turn's cut is always checked against the prefix renders, as `next_turn` cuts it, so a
        rebuilt stream and a reused one agree.
        """
        cuts: list[_TurnCut] = []
        rendered = 0
        cursor = base_end
        for index, turn in enumerate(past):
            cut = self._walk_cut(full, cursor, turn, past[index + 1].user_text if index + 1 < len(past) else None)
            if cut is None or index == len(past) - 1:
                by_renders = self._cut_by_renders(full, system, past, index)
                if cut is not None and cut != by_renders:
                    raise TemplateDivergence(f"turn {index}: its framing is not where the probed template puts it")
                rendered += cut is None
                if rendered > MAX_RENDERED_CUTS:
                    raise TemplateDivergence(f"more than {MAX_RENDERED_CUTS} turns are framed unlike the probe")
                cut = by_renders
            cuts.append(cut)
            cursor = cut.next_start
        return cuts

    def _walk_cut(self, full: str, start: int, turn: PastTurn, next_user: str | None) -> _TurnCut | None:
        """The cut of the turn starting at `start`, from the probed framing; `None` where the text
        is not framed as the probe says. `next_user`: the next past turn's user text (`None` for
        the last past turn, which the new message follows)."""
        user_prefix, reply_prefix = self._user_prefix, self._reply_prefix
        user_at = start + len(user_prefix)
        if not user_prefix or not reply_prefix or not full.startswith(user_prefix + turn.user_text, start):
            return None
        header_at = full.find(reply_prefix, user_at + len(turn.user_text))
        if header_at < 0:
            return None
        content_start = header_at + len(reply_prefix)
        content_end = content_start + len(turn.assistant_text)
        if full[content_start:content_end] != turn.assistant_text:
            return None
        next_start = full.find(user_prefix, content_end)
        if next_start < 0 or (next_user is not None and not full.startswith(user_prefix + next_user, next_start)):
            return None
        return _TurnCut(content_start, content_end, next_start)

    def _cut_by_renders(
        self, full: str, system: list[dict[str, str]], past: Sequence[PastTurn], index: int
    ) -> _TurnCut:
        """The cut of turn `index` from two renders of its prefixes (each a render of the
        conversation up to it: use sparingly, see `_turn_cuts`)."""
        turn = past[index]
        upto_user = [*system, *_turn_messages(past[:index]), {"role": "user", "content": turn.user_text}]
        content_start = self._prefix_length(full, upto_user, True)
        next_start = self._prefix_length(full, [*system, *_turn_messages(past[: index + 1])], False)
        content_end = content_start + len(turn.assistant_text)
        if full[content_start:content_end] != turn.assistant_text or content_end > next_start:
            raise TemplateDivergence(f"turn {index}: the reply is not rendered verbatim")
        return _TurnCut(content_start, content_end, next_start)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
        return text

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.encode(text, add_special_tokens=False)) if text else ()

    def _encode_many(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        """`_encode` of each text, in one batch call of the tokenizer (the same ids)."""
        batch = self._tokenizer([t or " " for t in texts], add_special_tokens=False)["input_ids"]
        return [tuple(ids) if text else () for text, ids in zip(texts, batch, strict=True)]

    def _prefix_length(self, full: str, messages: list[dict[str, str]], add_generation_prompt: bool) -> int:
        prefix = self._render(messages, add_generation_prompt) if messages else ""
        if not full.startswith(prefix):
            raise TemplateDivergence("earlier messages render differently once a message is added")
        return len(prefix)

    def _probe_user_prefix(self) -> str:
        """The text a user turn starts with (e.g. `<|im_start|>user\\n`), learnt from a probe
        conversation: what lies between the end of turn 1 and the second user message."""
        probe = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_REPLY},
            {"role": "user", "content": _PROBE_NEXT},
        ]
        full = self._render(probe, False)
        try:
            turn_start = self._prefix_length(full, probe[:2], False)
        except TemplateDivergence:
            return ""
        end = full.find(_PROBE_NEXT, turn_start)
        return full[turn_start:end] if end >= 0 else ""

    def _probe_reply_prefix(self) -> str:
        """The text a reply's content follows (the generation prompt, e.g. `<|im_start|>assistant\\n`)."""
        probe = [{"role": "user", "content": _PROBE_USER}]
        closed = self._render(probe, False)
        opened = self._render(probe, True)
        return opened[len(closed) :] if opened.startswith(closed) else ""

    def _system_text(self, system: list[dict[str, str]]) -> str:
        """The system prefix (the base layer's text) of a first turn with these system messages."""
        first = self._render([*system, {"role": "user", "content": _PROBE_USER}], False)
        return first[: self._base_end(first)]

    def _base_end(self, first_turn_text: str) -> int:
        """End of the system prefix in a first-turn rendering whose user content is `_PROBE_USER`."""
        user_at = first_turn_text.find(_PROBE_USER)
        start = user_at - len(self._user_prefix)
        if user_at < 0 or not self._user_prefix or start < 0:
            return 0
        return start if first_turn_text[start:user_at] == self._user_prefix else 0


def _system_messages(system_prompt: str | None) -> list[dict[str, str]]:
    return [] if system_prompt is None else [{"role": "system", "content": system_prompt}]


def _turn_messages(turns: Sequence[PastTurn]) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = []
    for turn in turns:
        messages.append({"role": "user", "content": turn.user_text})
        messages.append({"role": "assistant", "content": turn.assistant_text})
    return messages
