"""Invariant 1 on the real model: replies on a reused cache equal replies from a full re-prefill,
token for token, and a follow-up turn prefills exactly the new turn's tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.turn.chat_template import PastTurn

pytestmark = pytest.mark.real_model

MESSAGES = [
    "What is the capital of France?",
    "Give me two short facts about it, as a list.",
    "Now write one sentence about Berlin.",
    "Which of the two cities is older?",
    "Thanks. Summarise our chat in one line.",
]


@torch.inference_mode()
def greedy_from_scratch(engine: Engine, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference decoding: plain `transformers`, a fresh cache, the whole conversation in one prefill."""
    model = engine.model
    cache = DynamicCache(config=model.config)
    inputs = torch.tensor([token_ids])
    generated: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=inputs, cache=cache, use_cache=True).logits[0, -1]
        token = int(torch.argmax(logits))
        generated.append(token)
        if token in engine.stop_token_ids:
            break
        inputs = torch.tensor([[token]])
    return generated


def expected_new_turn_tokens(manager: SessionManager, past: list[PastTurn], message: str) -> int:
    """Tokens a follow-up turn must prefill, counted independently of the turn runner: the
    template's rendering of the new user turn, plus the end of the previous reply that the model
    never saw (its stop token is replaced by the template's `<|im_end|>\\n`)."""
    tokenizer = manager.internals.engine.tokenizer
    closing = tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
    framing = tokenizer.encode(
        f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    unfed_tail = 0 if past[-1].assistant_ids[-1] in manager.internals.engine.stop_token_ids else 1
    return unfed_tail + len(closing) + len(framing)


def test_five_turns_match_full_reprefill_and_prefill_only_new_tokens(real_manager: SessionManager) -> None:
    manager = real_manager
    tenant = manager.create_tenant("acme")
    sid = manager.open_session(tenant, system_prompt="You are a concise assistant.")
    past: list[PastTurn] = []
    for turn, message in enumerate(MESSAGES):
        reply = manager.chat(tenant, sid, message, max_new_tokens=40)
        conversation = manager.internals.template.conversation("You are a concise assistant.", past, message)
        reference = greedy_from_scratch(manager.internals.engine, list(conversation.token_ids), 40)
        assert list(reply.token_ids) == reference, f"turn {turn} differs from a full re-prefill"
        if turn == 0:
            assert reply.stats.restored_from == "new"
            assert reply.stats.prefill_tokens == len(conversation.token_ids)
            assert reply.stats.reused_tokens == 0
        else:
            assert reply.stats.restored_from == "device"
            assert reply.stats.prefill_tokens == expected_new_turn_tokens(manager, past, message)
            assert reply.stats.reused_tokens == len(conversation.token_ids) - reply.stats.prefill_tokens
        past.append(PastTurn(message, reply.text, reply.token_ids))
    history = manager.history(tenant, sid)
    assert [m.role for m in history] == ["user", "assistant"] * 5
    assert [m.token_ids for m in history if m.role == "assistant"] == [t.assistant_ids for t in past]


def test_reply_with_blank_lines_is_followed_by_full_reuse(real_manager: SessionManager) -> None:
    """Re-tokenising "\\n\\n" differently would break reuse; the generated ids are kept instead."""
    manager = real_manager
    tenant = manager.create_tenant("acme")
    sid = manager.open_session(tenant)
    first = manager.chat(tenant, sid, "Write a short poem with two stanzas.", max_new_tokens=60)
    assert "\n\n" in first.text, f"the model did not produce a blank line: {first.text!r}"
    cached = first.stats.cache_tokens
    second = manager.chat(tenant, sid, "Thanks!", max_new_tokens=8)
    assert second.stats.reused_tokens == cached  # 100% of what was cached
    assert second.stats.prefill_tokens == second.stats.cache_tokens - cached - (second.stats.decode_tokens - 1)
