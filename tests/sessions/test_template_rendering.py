"""Templates that do not render a conversation as a stable prefix of its continuation: the model
is fed exactly what the template renders now, never a stale cache or a flattened history.

References come from the tokenizer's own `apply_chat_template` text, cut only around the
replies it keeps verbatim (those are fed as their generated ids, as chatkv's invariant 1 wants),
and plain `transformers` greedy decoding on those ids."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer
from transformers.utils import chat_template_utils

from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.records import Reply
from sessions.turn.chat_template import ChatTemplate, PastTurn, TemplateDivergence, rendering_digest
from tests.sessions.offload_helpers import greedy_from_scratch, key_of, open_manager

SYSTEM = "Be brief."
MESSAGES = ["first question", "second question", "third question", "fourth question"]
TOKENS = 10

_CLOSE = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
SHORTENS_REPLIES = (
    # Earlier replies are cut to 6 characters (as templates that drop reasoning from history do).
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}{{ m.content[:6] }}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}" + _CLOSE
)
NUMBERS_USER_TURNS = (
    # User turns are numbered from the end: every earlier one is renumbered by a new message.
    "{% set ns = namespace(left=messages | selectattr('role', 'equalto', 'user') | list | length) %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'user' %}[{{ ns.left }}] {% set ns.left = ns.left - 1 %}{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}" + _CLOSE
)
COUNTS_MESSAGES = (
    # The system turn says how long the conversation is.
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.role == 'system' %} ({{ messages | length }} messages){% endif %}<|im_end|>\n{% endfor %}" + _CLOSE
)
DATED = (
    # Like Llama 3.x: the system turn carries today's date.
    "<|im_start|>system\nToday Date: {{ strftime_now('%d %b %Y') }}\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}<|im_end|>\n"
    "{% for m in messages if m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    + _CLOSE
)


def engine_with_template(tiny_model_dir: Path, tiny_engine: Engine, template: str) -> Engine:
    """The tiny model (same weights object) with its own copy of the tokenizer using `template`."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = template
    return Engine(replace(tiny_engine.loaded, tokenizer=tokenizer))


def template_prompt(engine: Engine, past: list[PastTurn], message: str) -> tuple[tuple[int, ...], int]:
    """The template's own rendering of the conversation up to the generation prompt, as ids: each
    assistant content the template kept verbatim is its generated ids, the rest is tokenised.
    Returns the ids and the number of replies the template rewrote."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for turn in past:
        messages += [{"role": "user", "content": turn.user_text}, {"role": "assistant", "content": turn.assistant_text}]
    messages.append({"role": "user", "content": message})
    tokenizer = engine.tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    contents = list(re.finditer(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", text, re.DOTALL))
    assert len(contents) == len(past)
    ids: list[int] = []
    cursor, rewritten = 0, 0
    for match, turn in zip(contents, past, strict=True):
        if match.group(1) != turn.assistant_text:
            rewritten += 1
            continue
        ids += tokenizer.encode(text[cursor : match.start(1)], add_special_tokens=False)
        ids += [i for i in turn.assistant_ids if i not in engine.stop_token_ids]
        cursor = match.end(1)
    ids += tokenizer.encode(text[cursor:], add_special_tokens=False)
    return tuple(ids), rewritten


def fed_ids(manager: SessionManager, tenant_id: str, session_id: str, reply: Reply) -> tuple[int, ...]:
    """Ids the model saw before the reply's first token: the session cache less the fed reply ids."""
    cache = manager.internals.tiers.peek(key_of(tenant_id, session_id))
    assert cache is not None
    return cache.token_ids[: cache.total_tokens - len(reply.token_ids) + 1]


def test_whole_conversation_of_a_stable_template_is_the_spliced_conversation(tiny_engine: Engine) -> None:
    """On a template with stable prefixes, the one-render path feeds the same ids as the cut one."""
    template = ChatTemplate(tiny_engine.tokenizer, tiny_engine.stop_token_ids)
    encode, eos = tiny_engine.tokenizer.encode, tiny_engine.tokenizer.eos_token_id
    # Reply ids that re-tokenising the text would not give back: each character on its own.
    past = [
        PastTurn(q, a, (*(i for ch in a for i in encode(ch, add_special_tokens=False)), eos))
        for q, a in [("Hi", "Hello there.\n\nHow can I help?"), ("Tell me more", "More, then.")]
    ]
    cut = template.conversation(SYSTEM, past, "And then?")
    whole = template.whole_conversation(SYSTEM, past, "And then?")
    assert whole.token_ids == cut.token_ids
    assert whole.rendering == cut.rendering
    assert whole.base_tokens == cut.base_tokens > 0
    assert whole.turn_starts == (cut.turn_starts[0], cut.turn_starts[-1])


FIRST_USER_FRAMED_APART = (
    # The first user turn is framed unlike the later ones (as Llama 2 wraps its first [INST]).
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'user' and loop.index0 <= 1 %}(first) {% endif %}{{ m.content }}<|im_end|>\n{% endfor %}" + _CLOSE
)


class _CountingTokenizer:
    """A tokenizer whose template renders are counted."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template
        self.renders = 0

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        self.renders += 1
        return self._tokenizer.apply_chat_template(conversation, **kwargs)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> Any:
        return self._tokenizer(texts, add_special_tokens=add_special_tokens)


def _past(engine: Engine, turns: int) -> list[PastTurn]:
    """`turns` turns whose replies re-tokenise to other ids (each character on its own) and whose
    texts contain the template's own framing."""
    encode, eos = engine.tokenizer.encode, engine.tokenizer.eos_token_id
    past = []
    for i in range(turns):
        user = f"question {i} <|im_start|>user\n" if i % 7 == 3 else f" question {i}\n\n"
        reply = f"answer {i}<|im_end|>\n" if i % 5 == 2 else f"answer {i}\n\nmore"
        past.append(PastTurn(user, reply, (*(t for ch in reply for t in encode(ch, add_special_tokens=False)), eos)))
    return past


def _cut_by_renders(template: ChatTemplate, system_prompt: str, past: list[PastTurn], message: str) -> list[int]:
    """The stream cut where every turn's prefix renders end (one render per turn: the reference)."""
    conversation = template.conversation(system_prompt, [], message) if not past else None
    if conversation is not None:
        return list(conversation.token_ids)
    system = [{"role": "system", "content": system_prompt}]
    full = template._render([*system, *_messages(past), {"role": "user", "content": message}], True)
    base = template._system_text(system)
    ids, cursor = list(template._encode(base)), len(base)
    for index, turn in enumerate(past):
        cut = template._cut_by_renders(full, system, past, index)
        ids += template._encode(full[cursor : cut.content_start])
        ids += template.content_ids(turn.assistant_ids)
        ids += template._encode(full[cut.content_end : cut.next_start])
        cursor = cut.next_start
    return ids + list(template._encode(full[cursor:]))


def _messages(past: list[PastTurn]) -> list[dict[str, str]]:
    return [
        m
        for t in past
        for m in ({"role": "user", "content": t.user_text}, {"role": "assistant", "content": t.assistant_text})
    ]


@pytest.mark.parametrize("template_text", [None, FIRST_USER_FRAMED_APART], ids=["model-template", "first-turn-apart"])
def test_a_long_conversation_is_rendered_a_few_times_and_cut_where_its_prefixes_end(
    tiny_model_dir: Path, tiny_engine: Engine, template_text: str | None
) -> None:
    """200 turns: a handful of renders, not two per turn (issue 18: a 5,000-turn history took tens
    of minutes), and the same ids as cutting every turn at its own prefix renders."""
    engine = tiny_engine if template_text is None else engine_with_template(tiny_model_dir, tiny_engine, template_text)
    counting = _CountingTokenizer(engine.tokenizer)
    template = ChatTemplate(counting, engine.stop_token_ids)
    past = _past(engine, 200)
    counting.renders = 0
    conversation = template.conversation(SYSTEM, past, "And then?")
    assert counting.renders <= 8
    assert list(conversation.token_ids) == _cut_by_renders(template, SYSTEM, past, "And then?")
    assert len(conversation.turn_starts) == 201


def test_next_turn_refuses_a_cache_of_another_rendering(tiny_engine: Engine) -> None:
    template = ChatTemplate(tiny_engine.tokenizer, tiny_engine.stop_token_ids)
    eos = tiny_engine.tokenizer.eos_token_id
    past = [PastTurn("Hi", "Hello.", (*tiny_engine.tokenizer.encode("Hello.", add_special_tokens=False), eos))]
    first = template.conversation(SYSTEM, [], "Hi")
    cached = rendering_digest(first.rendering + "Hello.")
    delta = template.next_turn(SYSTEM, past, "Again", cached_digest=cached)
    assert delta.rendering.startswith(first.rendering + "Hello.")
    for stale in (rendering_digest(first.rendering.replace(SYSTEM, "Be long.") + "Hello."), ""):
        with pytest.raises(TemplateDivergence, match="renders differently now"):
            template.next_turn(SYSTEM, past, "Again", cached_digest=stale)


@pytest.mark.parametrize(
    ("template", "rewrites_replies"),
    [(SHORTENS_REPLIES, True), (NUMBERS_USER_TURNS, False), (COUNTS_MESSAGES, False)],
    ids=["shortens-replies", "numbers-user-turns", "counts-messages"],
)
def test_history_rewriting_template_is_fed_its_own_rendering(
    tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine, template: str, rewrites_replies: bool
) -> None:
    engine = engine_with_template(tiny_model_dir, tiny_engine, template)
    with open_manager(tmp_path / "home", engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        past: list[PastTurn] = []
        for turn, message in enumerate(MESSAGES):
            reply = manager.chat(tenant, sid, message, max_new_tokens=TOKENS)
            expected, rewritten = template_prompt(engine, past, message)
            assert fed_ids(manager, tenant.id, sid, reply) == expected, f"turn {turn}"
            assert reply.token_ids == greedy_from_scratch(engine, expected, TOKENS), f"turn {turn}"
            assert rewritten == (turn if rewrites_replies else 0)
            assert reply.stats.restored_from == ("new" if turn == 0 else "rebuilt")
            past.append(PastTurn(message, reply.text, reply.token_ids))


def test_agnostic_under_a_template_that_rewrites_replies_evicts_by_recency(
    tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """KVzip's repeat prompt follows a reply rendered verbatim; a template that rewrites replies
    has none, so the manager still opens, says so once, and its caches carry no scores."""
    engine = engine_with_template(tiny_model_dir, tiny_engine, SHORTENS_REPLIES)
    with caplog.at_level(logging.WARNING, logger="sessions.turn.runner"):
        manager = open_manager(tmp_path / "home", engine, window_policy="agnostic")
    with manager:
        assert [r.getMessage() for r in caplog.records if r.name == "sessions.turn.runner"] == [
            "window policy agnostic: no KVzip reconstruction prompt (the probe reply is not rendered verbatim); "
            "evicting by recency"
        ]
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        reply = manager.chat(tenant, sid, MESSAGES[0], max_new_tokens=TOKENS)
        cache = manager.internals.tiers.peek(key_of(tenant.id, sid))
    assert len(reply.token_ids) > 0 and cache is not None and cache.own_scores is None


class _Clock:
    """Stands in for `datetime` in the template renderer (`strftime_now` calls `datetime.now()`)."""

    today = datetime(2025, 3, 1, 23, 59)

    @classmethod
    def now(cls) -> datetime:
        return cls.today


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_Clock]]:
    monkeypatch.setattr(chat_template_utils, "datetime", _Clock)
    yield _Clock
    _Clock.today = datetime(2025, 3, 1, 23, 59)


def test_a_template_that_reads_the_date_is_rebuilt_after_midnight(
    tmp_path: Path, tiny_model_dir: Path, tiny_engine: Engine, clock: type[_Clock]
) -> None:
    engine = engine_with_template(tiny_model_dir, tiny_engine, DATED)
    with open_manager(tmp_path / "home", engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        past: list[PastTurn] = []
        sources, reused = [], []
        cached_tokens = 0
        for turn, message in enumerate([*MESSAGES, "fifth question"]):
            if turn == 2:
                # The stored cache (its rendering digest included) survives a trip to disk.
                assert manager.evict_session(tenant, sid, "disk") == "disk"
            if turn == 3:
                clock.today = datetime(2025, 3, 2, 0, 1)
            reply = manager.chat(tenant, sid, message, max_new_tokens=TOKENS)
            expected, _ = template_prompt(engine, past, message)
            fed = fed_ids(manager, tenant.id, sid, reply)
            assert fed == expected, f"turn {turn}"
            assert reply.token_ids == greedy_from_scratch(engine, expected, TOKENS), f"turn {turn}"
            sources.append(reply.stats.restored_from)
            reused.append(reply.stats.reused_tokens == cached_tokens)
            cached_tokens = reply.stats.cache_tokens
            past.append(PastTurn(message, reply.text, reply.token_ids))
        rendered = engine.tokenizer.decode(fed)
        assert rendered.count("Today Date: 02 Mar 2025") == 1 and "01 Mar" not in rendered
    assert sources == ["new", "device", "disk", "rebuilt", "device"]
    assert reused == [True, True, True, False, True]
