"""Sessions found by their history (the OpenAI API's stateless clients), sessions started from a
posted history, and `reuse_kv = False` (the benchmarks' baseline: every turn re-prefilled)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sessions.engine import Engine
from sessions.errors import InvalidInput, SessionBusy
from sessions.manager import SessionManager
from sessions.turn.chat_template import PastTurn
from tests.conftest import make_settings


def test_a_session_is_found_by_its_exact_history_and_only_by_its_tenant(tiny_manager: SessionManager) -> None:
    manager = tiny_manager
    acme, beta = manager.create_tenant("acme"), manager.create_tenant("beta")
    sid = manager.open_session(acme, "Be terse.")
    first = manager.chat(acme, sid, "Hello", max_new_tokens=4)
    history = [("Hello", first.text)]
    assert manager.internals.registry.find_by_history(acme.id, "Be terse.", history) == [sid]
    assert manager.internals.registry.find_by_history(beta.id, "Be terse.", history) == []
    assert manager.internals.registry.find_by_history(acme.id, None, history) == []
    assert manager.internals.registry.find_by_history(acme.id, "Be terse.", [("Hello", first.text + " ")]) == []
    assert manager.internals.registry.find_by_history(acme.id, "Be terse.", []) == []  # nothing to reuse


def test_a_found_session_that_moved_on_is_not_continued(tiny_manager: SessionManager) -> None:
    manager = tiny_manager
    tenant = manager.create_tenant("acme")
    sid = manager.open_session(tenant)
    manager.chat(tenant, sid, "Hello", max_new_tokens=4)
    manager.chat(tenant, sid, "Again", max_new_tokens=4)  # another client got there first
    with pytest.raises(SessionBusy, match="moved on"):
        next(manager.stream_chat(tenant, sid, "Late", max_new_tokens=4, expected_turns=1))
    assert len(manager.history(tenant, sid)) == 4


def test_a_session_started_from_a_posted_history_prefills_it_once(tiny_manager: SessionManager) -> None:
    manager = tiny_manager
    tenant = manager.create_tenant("acme")
    posted = [("What is 2+2?", "4"), ("And 3+3?", "")]
    sid = manager.open_session(tenant, "Be terse.", history=posted)
    assert manager.internals.registry.find_by_history(tenant.id, "Be terse.", posted) == [sid]
    history = manager.history(tenant, sid)
    assert [(m.role, m.text) for m in history] == [
        ("user", "What is 2+2?"),
        ("assistant", "4"),
        ("user", "And 3+3?"),
        ("assistant", ""),
    ]
    stop = manager.internals.engine.stop_token_ids[0]
    assert history[1].token_ids == (*manager.internals.engine.tokenizer.encode("4", add_special_tokens=False), stop)
    reply = manager.chat(tenant, sid, "And 4+4?", max_new_tokens=4)
    past = [PastTurn(u.text, a.text, a.token_ids) for u, a in zip(history[::2], history[1::2], strict=True)]
    conversation = manager.internals.template.conversation("Be terse.", past, "And 4+4?")
    assert reply.stats.restored_from == "rebuilt"
    assert reply.stats.prefill_tokens + reply.stats.reused_tokens == len(conversation.token_ids)
    follow = manager.chat(tenant, sid, "And 5+5?", max_new_tokens=4)
    assert follow.stats.restored_from == "device" and follow.stats.reused_tokens == reply.stats.cache_tokens
    with pytest.raises(InvalidInput, match="NUL"):
        manager.open_session(tenant, history=[("a\x00", "b")])
    assert len(manager.list_sessions(tenant)) == 1


def test_with_reuse_off_every_turn_re_prefills_the_conversation_and_replies_do_not_change(
    tmp_path: Path, tiny_engine: Engine
) -> None:
    messages = ["Hello", "Tell me more", "And then?"]
    replies = {}
    for reuse in (True, False):
        with SessionManager(make_settings(tmp_path / str(reuse), reuse_kv=reuse), engine=tiny_engine) as manager:
            tenant = manager.create_tenant("acme")
            sid = manager.open_session(tenant, "Be terse.")
            replies[reuse] = [manager.chat(tenant, sid, m, max_new_tokens=6) for m in messages]
            if not reuse:
                assert manager.session_info(tenant, sid).tier is None  # no cache kept
                assert len(manager.internals.tiers.pool) == 0
    for on, off in zip(replies[True], replies[False], strict=True):
        assert off.token_ids == on.token_ids
        assert off.stats.reused_tokens == 0
        assert off.stats.prefill_tokens == on.stats.prefill_tokens + on.stats.reused_tokens
    assert [r.stats.restored_from for r in replies[False]] == ["new", "rebuilt", "rebuilt"]
    assert replies[True][2].stats.reused_tokens > 0
