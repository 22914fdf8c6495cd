"""Stop strings: the reply returned ends before the first one, the request finishes early (not
cancelled) at the engine loop's next step, and the turn is stored as its client saw it (the cut
text, its ids and a stop token, as a posted history of it is), with the cache cropped to end there
or not kept: the next turn answers as a fresh post of that history, and as a full re-prefill."""

from __future__ import annotations

import pytest

from sessions.engine import Engine, Request
from sessions.errors import InvalidInput
from sessions.manager import SessionManager
from sessions.records import Reply
from sessions.sampling import SamplingParams
from sessions.turn.chat_template import PastTurn
from sessions.turn.stop_strings import StopScanner, StopStrings
from sessions.turn_options import TurnOptions
from tests.sessions.test_exact_reuse import expected_new_turn_tokens, greedy_from_scratch

SAMPLED = {"temperature": 1.0, "seed": 7, "max_new_tokens": 40}
"""The tiny model's greedy replies are one token repeated; a seeded sample is varied and repeatable."""
STOP_ID = 2
"""SmolLM2's `<|im_end|>`: the stop token a reply cut by a stop string is stored with."""


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


@pytest.mark.parametrize(
    ("pieces", "armed_at", "released", "cut"),
    [
        (["a! b", "!! c"], 4, ["a! b", ""], 4),  # "!!" ends after the first 4 characters: it cuts
        (["a!", "! b"], 2, ["a", ""], 1),  # across the boundary: it cuts, and was held back
        (["a!! b", "!! c"], 5, ["a!! b", ""], 5),  # the first "!!" ends inside the 5: only the second cuts
        (["wo", "rld", " x"], 5, ["", "world", " x"], None),  # a stop string inside the 5 never cuts
    ],
)
def test_an_unarmed_scanner_cuts_only_at_stop_strings_ending_after_the_armed_length(
    pieces: list[str], armed_at: int, released: list[str], cut: int | None
) -> None:
    """`min_new_tokens`: the runner arms the scanner at the text length of the first N tokens."""
    scanner = StopScanner(StopStrings(["world", "!!"]), armed=False)
    text, out = "", []
    for piece in pieces:
        text += piece
        if len(text) >= armed_at:
            scanner.arm(armed_at)
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


def test_a_stop_string_ends_the_turn_early_and_the_turn_stores_the_reply_as_returned(
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
    generated = manager.internals.engine.tokenizer.decode(reply.token_ids, skip_special_tokens=False)
    assert reply.generated_text == generated and generated.startswith(reply.text + stop)
    # Stored as returned, with the ids a posted history of that text has.
    [user, assistant] = manager.history(tenant, sid)
    returned_ids = (*manager.internals.engine.tokenizer.encode(reply.text, add_special_tokens=False), STOP_ID)
    assert (user.text, assistant.text, assistant.token_ids) == ("Hello", reply.text, returned_ids)
    assert reply.stored_text == reply.text
    # The session is found by the history its client saw: the reply as returned.
    assert manager.internals.registry.find_by_history(tenant.id, "Be terse.", [("Hello", reply.text)]) == [sid]
    assert manager.internals.registry.find_by_history(tenant.id, "Be terse.", [("Hello", generated)]) == []


@pytest.mark.parametrize(("inside_a_token", "restored_from"), [(False, "device"), (True, "rebuilt")])
def test_after_a_cut_the_session_holds_what_its_client_saw_and_the_next_turn_reuses_or_rebuilds_it(
    tiny_manager: SessionManager, inside_a_token: bool, restored_from: str
) -> None:
    manager = tiny_manager
    tenant = manager.create_tenant("acme")
    tokenizer = manager.internals.engine.tokenizer
    # Two sessions alike up to their second turn, which reuses the cache of the first: one
    # replies freely, the other is cut by a stop string at the reply's 6th token (or one
    # character into it), so the same seeded samples are cut.
    sessions = [manager.open_session(tenant, "Be terse.") for _ in range(2)]
    for sid in sessions:
        manager.chat(tenant, sid, "Hello", **SAMPLED)  # type: ignore[arg-type]
    free = manager.chat(tenant, sessions[0], "Tell me more", **SAMPLED)  # type: ignore[arg-type]
    start = len(tokenizer.decode(free.token_ids[:6])) + inside_a_token
    stop = free.text[start : start + 6]
    assert free.text.index(stop) == start
    returned_ids = tuple(tokenizer.encode(free.text[:start], add_special_tokens=False))
    assert (returned_ids == free.token_ids[:6]) is not inside_a_token

    sid = sessions[1]
    cut = manager.chat(tenant, sid, "Tell me more", stop=[stop], **SAMPLED)  # type: ignore[arg-type]
    assert (cut.text, cut.stats.restored_from) == (free.text[:start], "device")
    history = manager.history(tenant, sid)
    assert (history[3].text, history[3].token_ids) == (cut.text, (*returned_ids, STOP_ID))
    info = manager.session_info(tenant, sid)
    # The stream goes on after the stored reply's ids. A reply's last id is not counted: it is
    # fed with the next user message's ids, or it is the stop token the closing replaces.
    fed = sum(len(m.token_ids) for m in history) - 2
    assert info.token_count == fed
    if inside_a_token:
        # No cache ends where the returned text does: none is kept, the transcript rebuilds it.
        assert (info.tier, cut.stats.cache_tokens) == (None, 0)
    else:
        assert (info.tier, cut.stats.cache_tokens) == ("device", fed)

    follow = manager.chat(tenant, sid, "Go on", max_new_tokens=4)
    assert follow.stats.restored_from == restored_from
    history = manager.history(tenant, sid)
    past = [PastTurn(u.text, a.text, a.token_ids) for u, a in zip(history[:4:2], history[1:4:2], strict=True)]
    conversation = manager.internals.template.conversation("Be terse.", past, "Go on")
    assert history[4].token_ids == conversation.token_ids[info.token_count :]
    assert follow.stats.prefill_tokens + follow.stats.reused_tokens == len(conversation.token_ids)
    if not inside_a_token:
        assert follow.stats.reused_tokens == fed and follow.stats.prefill_tokens == len(history[4].token_ids)


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
    [_, stored, _, _] = manager.history(tenant, sid)
    past = [PastTurn(first, cut.text, stored.token_ids)]
    conversation = manager.internals.template.conversation(system, past, second)
    assert list(reply.token_ids) == greedy_from_scratch(manager.internals.engine, list(conversation.token_ids), 20)
    assert manager.internals.registry.find_by_history(tenant.id, system, [(first, cut.text), (second, reply.text)]) == [
        sid
    ]


SYSTEM = "You are a helpful assistant."
FRUITS = "List five fruits as a numbered list."
SWEETEST = "Which one is the sweetest?"


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("stop", "at_token_boundary", "restored"),
    [
        ("\n5", True, "device"),  # "...4. Anise" + "\n" "5": the cut text is the first generated ids
        ("nas", False, "rebuilt"),  # "1. Ba" "nas": cut inside the token " Ban" "anas"
    ],
)
@pytest.mark.parametrize("found_by", ["history", "id"])
def test_after_a_cut_the_next_turn_replies_as_a_fresh_post_of_the_history_the_client_saw(
    real_manager: SessionManager, stop: str, at_token_boundary: bool, restored: str, found_by: str
) -> None:
    manager = real_manager
    tenant = manager.create_tenant("acme")
    tokenizer = manager.internals.engine.tokenizer
    first = manager.continue_history(tenant, SYSTEM, [], FRUITS, TurnOptions(40, 0.0, 1.0, None, (stop,)))
    cut = [*first][-1]
    assert isinstance(cut, Reply) and first.session_id is not None
    assert cut.finish_reason == "stop" and stop not in cut.text and cut.text.startswith("1. Bana")
    cut_ids = tuple(tokenizer.encode(cut.text, add_special_tokens=False))
    assert (cut.token_ids[: len(cut_ids)] == cut_ids) is at_token_boundary

    posted = [(FRUITS, cut.text)]
    if found_by == "history":
        # The stateless client posts the history it saw: the session is found and continued.
        started = manager.continue_history(tenant, SYSTEM, posted, SWEETEST, TurnOptions(30, 0.0, 1.0, None, ()))
        follow = [*started][-1]
        assert isinstance(follow, Reply) and (started.session_id, started.action) == (first.session_id, "continue")
    else:
        follow = manager.chat(tenant, first.session_id, SWEETEST, max_new_tokens=30)
    fresh_id = manager.open_session(tenant, SYSTEM, history=posted)
    fresh = manager.chat(tenant, fresh_id, SWEETEST, max_new_tokens=30)

    assert (follow.text, follow.token_ids) == (fresh.text, fresh.token_ids)
    assert follow.stats.restored_from == restored
    # The cut reply is stored exactly as the fresh post of its history stores it.
    [_, reply, *_], [_, posted_reply, *_] = (manager.history(tenant, s) for s in (first.session_id, fresh_id))
    assert (reply.text, reply.token_ids) == (posted_reply.text, posted_reply.token_ids)
    assert reply.token_ids == (*cut_ids, manager.internals.engine.stop_token_ids[0])
    if at_token_boundary:
        # Only the new turn was prefilled: the cache ends where the returned text ends.
        past = [PastTurn(FRUITS, cut.text, reply.token_ids)]
        assert follow.stats.prefill_tokens == expected_new_turn_tokens(manager, past, SWEETEST)
