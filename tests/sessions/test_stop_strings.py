"""Stop strings: the reply returned ends before the first one, the request finishes early (not
cancelled) at the engine loop's next step, and the stored turn keeps every generated id and their
whole text, so the next turn continues a consistent cache (compared with a full re-prefill)."""

from __future__ import annotations

import pytest

from sessions.chat_template import PastTurn
from sessions.engine import Engine, Request
from sessions.errors import InvalidInput
from sessions.manager import SessionManager
from sessions.records import Reply
from sessions.sampling import SamplingParams
from sessions.stop_strings import StopScanner, StopStrings
from storage.history_digest import history_digest
from tests.sessions.test_exact_reuse import greedy_from_scratch

SAMPLED = {"temperature": 1.0, "seed": 7, "max_new_tokens": 40}
"""The tiny model's greedy replies are one token repeated; a seeded sample is varied and repeatable."""


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        (["a", "b", "c", "d", "e"], "at most 4"),
        ([""], "must not be empty"),
        (["a\x00"], "NUL"),
        ("stop", "must be a list"),
        ([3], "must be a string"),
    ],
)
def test_bad_stop_strings_are_refused(stop: object, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        StopStrings(stop)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pieces", "released", "cut"),
    [
        (["Hel", "lo wor", "ld! more"], ["Hel", "lo ", ""], 6),  # "wor" held back until it is "world"
        (["Hel", "lo wo", "rm"], ["Hel", "lo ", "worm"], None),  # held back, then not a stop after all
        (["xy", "world"], ["xy", ""], 2),
        (["wo", "rl"], ["", ""], None),  # released at the end
    ],
)
def test_the_scanner_never_releases_a_stop_string(pieces: list[str], released: list[str], cut: int | None) -> None:
    scanner = StopScanner(StopStrings(["world", "!!"]))
    text, out = "", []
    for piece in pieces:
        text += piece
        out.append(scanner.push(text))
    tail = scanner.finish(text)
    assert (out, scanner.cut) == (released, cut)
    assert "".join(out) + tail == (text if cut is None else text[:cut])


def _stream(manager: SessionManager, tenant: str, sid: str, message: str, **kwargs: object) -> tuple[str, Reply]:
    pieces, reply = [], None
    for item in manager.stream_chat(tenant, sid, message, **kwargs):  # type: ignore[arg-type]
        if isinstance(item, Reply):
            reply = item
        else:
            pieces.append(item)
    assert reply is not None
    return "".join(pieces), reply


def test_a_stop_string_ends_the_turn_early_and_the_turn_keeps_every_generated_id(
    tiny_manager: SessionManager,
) -> None:
    manager = tiny_manager
    tenant = manager.create_tenant("acme")
    free = manager.chat(tenant, manager.open_session(tenant, "Be terse."), "Hello", **SAMPLED)  # type: ignore[arg-type]
    assert free.finish_reason == "length" and len(free.text) > 30
    stop = free.text[12:16]
    cut = free.text.index(stop)

    sid = manager.open_session(tenant, "Be terse.")
    streamed, reply = _stream(manager, tenant.id, sid, "Hello", stop=[stop, "never-produced"], **SAMPLED)
    assert reply.text == streamed == free.text[:cut]
    assert reply.finish_reason == "stop"
    # The same seeded samples, ended early: a few tokens past the stop string at most, not 40.
    n = len(reply.token_ids)
    assert reply.token_ids == free.token_ids[:n] and n < len(free.token_ids)
    stored = manager.engine.tokenizer.decode(reply.token_ids, skip_special_tokens=False)
    assert reply.stored_text == stored and stored.startswith(reply.text + stop)
    [user, assistant] = manager.history(tenant, sid)
    assert (user.text, assistant.text, assistant.token_ids) == ("Hello", stored, reply.token_ids)
    # The session is found by the history its client saw: the reply as returned.
    assert manager.find_sessions_by_history(tenant, "Be terse.", [("Hello", reply.text)]) == [sid]
    assert manager.find_sessions_by_history(tenant, "Be terse.", [("Hello", stored)]) == []


def test_finish_early_ends_a_request_normally_with_a_consistent_cache(tiny_engine: Engine) -> None:
    engine = tiny_engine
    prompt = engine.tokenizer.encode("Tell me a story.", add_special_tokens=False)
    request = Request(
        tenant_id="tn_x",  # type: ignore[arg-type]
        prefill_ids=prompt,
        params=SamplingParams(max_new_tokens=200, temperature=1.0, seed=3),
        start=engine.empty_cache(None),
        stop_token_ids=engine.stop_token_ids,
    )
    stream = engine.loop.submit(request).tokens()
    seen = [next(stream) for _ in range(3)]
    request.finish_early()
    engine.loop.wake()
    rest = []
    while True:
        try:
            rest.append(next(stream))
        except StopIteration as done:
            result = done.value
            break
    assert list(result.generated) == seen + rest and len(result.generated) < 200
    # Every generated token but the last was fed, as when a reply ends at its length limit.
    assert result.working.get_seq_length() == len(prompt) + len(result.generated) - 1


@pytest.mark.real_model
def test_after_a_stop_string_the_next_turn_continues_an_exact_cache(real_manager: SessionManager) -> None:
    manager = real_manager
    tenant = manager.create_tenant("acme")
    system, first, second = "You are a helpful assistant.", "List three fruits, one per line.", "Which is the sweetest?"
    free = manager.chat(tenant, manager.open_session(tenant, system), first, max_new_tokens=30)
    lines = free.text.split("\n")
    assert len(lines) >= 3, free.text
    stop = lines[1][:4]  # ends the reply in its second line

    sid = manager.open_session(tenant, system)
    cut = manager.chat(tenant, sid, first, max_new_tokens=30, stop=[stop])
    assert cut.text == free.text[: free.text.index(stop)] and cut.finish_reason == "stop"
    reply = manager.chat(tenant, sid, second, max_new_tokens=20)
    assert reply.stats.restored_from == "device"
    past = [PastTurn(first, cut.stored_text, cut.token_ids)]
    conversation = manager.template.conversation(system, past, second)
    assert list(reply.token_ids) == greedy_from_scratch(manager.engine, list(conversation.token_ids), 20)
    assert manager.find_sessions_by_history(tenant, system, [(first, cut.text), (second, reply.text)]) == [sid]
    assert history_digest(system, [(first, cut.text)]) != history_digest(system, [(first, cut.stored_text)])
