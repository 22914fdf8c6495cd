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

The cut points come from rendering prefixes of the conversation: the text of turn `i` starts where
the rendering of the messages before it ends, and assistant content `i` starts where the rendering
with the generation prompt ends. If the template renders earlier messages differently once more
are added (the prefix property fails), the cut points do not exist; `TemplateDivergence` tells the
caller to re-prefill from the divergent point rather than reuse a cache that no longer matches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

_PROBE_USER = "chatkv-probe-user-7f3a"
_PROBE_REPLY = "chatkv-probe-reply-9c1e"
_PROBE_NEXT = "chatkv-probe-next-2b6d"


class TemplateDivergence(Exception):
    """The template renders earlier turns differently once a message is added (no stable prefix)."""


class Tokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


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
        turn_starts: stream index where each turn begins; the last entry is the new turn.
    """

    token_ids: tuple[int, ...]
    base_tokens: int
    turn_starts: tuple[int, ...]


@dataclass(frozen=True)
class TurnDelta:
    """Ids to add after the previous turn's reply content.

    Attributes:
        closing_ids: the template's end of the previous turn (end-of-turn marker and separator);
            they belong to the previous turn's layer.
        turn_ids: the new turn's rendering up to the generation prompt.
    """

    closing_ids: tuple[int, ...]
    turn_ids: tuple[int, ...]


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
        self._user_prefix = self._probe_user_prefix()

    # -- public --------------------------------------------------------------------------------

    def content_ids(self, assistant_ids: Sequence[int]) -> tuple[int, ...]:
        """The reply content: generated ids without a trailing stop token."""
        if assistant_ids and assistant_ids[-1] in self._stop_ids:
            return tuple(assistant_ids[:-1])
        return tuple(assistant_ids)

    def system_prefix_ids(self, system_prompt: str | None) -> tuple[int, ...]:
        """Ids of the shareable prefix (the system-prompt rendering) of any conversation with this
        system prompt; empty if the template has none that stays fixed."""
        messages = [*_system_messages(system_prompt), {"role": "user", "content": _PROBE_USER}]
        text = self._render(messages, add_generation_prompt=False)
        return self._encode(text[: self._base_end(text)])

    def conversation(self, system_prompt: str | None, past: Sequence[PastTurn], user_text: str) -> ConversationTokens:
        """The whole stream for a new user message after `past` turns (O(turns) renders).

        Raises:
            TemplateDivergence: if the template has no stable prefix for these messages.
        """
        system = _system_messages(system_prompt)
        messages = system + _turn_messages(past)
        full = self._render([*messages, {"role": "user", "content": user_text}], True)
        first = self._render([*system, {"role": "user", "content": _PROBE_USER}], False)
        base_end = self._base_end(first)
        if full[:base_end] != first[:base_end]:
            raise TemplateDivergence("the system prefix renders differently with the real messages")
        ids: list[int] = list(self._encode(full[:base_end]))
        base_tokens = len(ids)
        turn_starts: list[int] = []
        cursor = base_end
        for index, turn in enumerate(past):
            upto_user = system + _turn_messages(past[:index]) + [{"role": "user", "content": turn.user_text}]
            content_start = self._prefix_length(full, upto_user, True)
            closed = system + _turn_messages(past[: index + 1])
            next_start = self._prefix_length(full, closed, False)
            content = self.content_ids(turn.assistant_ids)
            content_end = content_start + len(turn.assistant_text)
            if full[content_start:content_end] != turn.assistant_text or content_end > next_start:
                raise TemplateDivergence(f"turn {index}: the reply is not rendered verbatim")
            turn_starts.append(len(ids))
            ids += self._encode(full[cursor:content_start])
            ids += content
            ids += self._encode(full[content_end:next_start])
            cursor = next_start
        turn_starts.append(len(ids))
        ids += self._encode(full[cursor:])
        return ConversationTokens(tuple(ids), base_tokens, tuple(turn_starts))

    def next_turn(self, system_prompt: str | None, past: Sequence[PastTurn], user_text: str) -> TurnDelta:
        """Ids after the last reply's content for a new user message: three renders, whatever the
        length of the conversation. Requires at least one past turn.

        Raises:
            TemplateDivergence: if the earlier messages render differently with the new one added.
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
        turn_start = self._prefix_length(full, messages, False)
        if turn_start < content_end:
            raise TemplateDivergence("the last reply's closing precedes its content")
        return TurnDelta(
            closing_ids=self._encode(full[content_end:turn_start]),
            turn_ids=self._encode(full[turn_start:]),
        )

    # -- internals -----------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
        return text

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.encode(text, add_special_tokens=False)) if text else ()

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
