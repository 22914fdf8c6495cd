"""Forks: a session starting from another's KV up to one of its turns (regenerate, edit, retry,
branches). Each fork's reply is compared with a full re-prefill of its conversation (invariant 1)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from sessions.engine import Engine
from sessions.errors import InvalidInput, SessionNotFound
from sessions.manager import SessionManager
from sessions.records import Reply
from sessions.replicas.routing import Route
from sessions.turn_door import PlannedTurn
from sessions.turn_target import TurnTarget
from tests.sessions.offload_helpers import key_of, one_torch_thread, open_manager, reference_reply

SYSTEM = "You are terse."
MESSAGES = ["Name a colour.", "Name another one.", "And a third?", "Which is warmest?"]
TOKENS = 6


def conversation(manager: SessionManager, tenant: str, turns: int) -> str:
    sid = manager.open_session(tenant, SYSTEM)
    for message in MESSAGES[:turns]:
        manager.chat(tenant, sid, message, max_new_tokens=TOKENS)
    return sid


def returned(manager: SessionManager, tenant: str, sid: str) -> list[tuple[str, str]]:
    texts = [m.text for m in manager.history(tenant, sid)]
    return list(zip(texts[::2], texts[1::2], strict=True))


def test_a_fork_holds_the_first_turns_and_continues_warm_and_exact(tiny_manager: SessionManager) -> None:
    manager = tiny_manager
    tenant = manager.create_tenant("acme").id
    parent = conversation(manager, tenant, 3)
    before = manager.history(tenant, parent)
    fork = manager.fork(tenant, parent, 2)
    info = manager.session_info(tenant, fork)
    assert (info.parent_id, info.fork_turns, info.origin, info.message_count) == (parent, 2, "fork", 4)
    assert [(m.role, m.text, m.token_ids) for m in manager.history(tenant, fork)] == [
        (m.role, m.text, m.token_ids) for m in before[:4]
    ]
    expected = reference_reply(manager, tenant, fork, "Something else.", TOKENS)
    reply = manager.chat(tenant, fork, "Something else.", max_new_tokens=TOKENS)
    assert reply.token_ids == expected
    assert reply.stats.restored_from == "device" and reply.stats.reused_tokens > 0
    assert manager.history(tenant, parent) == before  # the parent is untouched
    follow = manager.chat(tenant, parent, MESSAGES[3], max_new_tokens=TOKENS)
    assert follow.stats.restored_from == "device"


@pytest.mark.parametrize("tier", ["host", "disk", "drop"])
def test_a_fork_reads_its_parent_where_it_is(tiny_manager: SessionManager, tier: str) -> None:
    manager = tiny_manager
    tenant = manager.create_tenant("acme").id
    parent = conversation(manager, tenant, 3)
    manager.internals.tiers.flush()
    manager.evict_session(tenant, parent, tier)
    fork = manager.fork(tenant, parent, 2)
    assert manager.internals.tiers.placement(key_of(tenant, parent)) == (
        None if tier == "drop" else manager.internals.tiers.placement(key_of(tenant, parent))
    )
    expected = reference_reply(manager, tenant, fork, "Something else.", TOKENS)
    reply = manager.chat(tenant, fork, "Something else.", max_new_tokens=TOKENS)
    assert reply.token_ids == expected
    assert reply.stats.restored_from == ("rebuilt" if tier == "drop" else "device")
    forks = manager.stats()["forks"]
    assert forks == {("rebuilt" if tier == "drop" else tier): 1.0}


def stateless_conversation(manager: SessionManager, tenant: str, turns: int) -> str:
    """A conversation as a stateless client has it: each turn posts the whole history so far."""
    history: list[tuple[str, str]] = []
    sid = None
    for message in MESSAGES[:turns]:
        turn = manager.continue_history(tenant, SYSTEM, history, message, max_new_tokens=TOKENS)
        reply = list(turn)[-1]
        assert isinstance(reply, Reply)
        history.append((message, reply.text))
        assert sid is None or turn.session_id == sid
        sid = turn.session_id
    assert sid is not None
    return sid


def post(manager: SessionManager, tenant: str, turns: list[tuple[str, str]], message: str) -> tuple[Reply, PlannedTurn]:
    turn = manager.continue_history(tenant, SYSTEM, turns, message, max_new_tokens=TOKENS)
    items = list(turn)
    assert isinstance(items[-1], Reply)
    return items[-1], turn


def test_a_posted_history_continues_forks_or_starts_anew(tiny_manager: SessionManager) -> None:
    """The stateless decision: the whole history continues its session; a history that a session
    holds and goes past (regenerate, edit, retry) forks it; another starts a new session."""
    manager = tiny_manager
    tenant = manager.create_tenant("acme").id
    parent = stateless_conversation(manager, tenant, 3)
    assert manager.session_info(tenant, parent).origin == "implicit"
    history = returned(manager, tenant, parent)

    # Chosen ahead (replicas forward the request to that session's owner); a single process runs it here.
    def plan(turns: list[tuple[str, str]]) -> tuple[str, Route]:
        planned = manager.plan_turn(tenant, TurnTarget(SYSTEM, turns))
        return planned.action, planned.route

    assert plan(history) == ("continue", Route("local", parent))
    assert plan(history[:2]) == ("fork", Route("local", parent))  # the parent to fork
    assert plan([("Unrelated?", "Yes.")]) == ("new", Route("local", None))
    _, turn = post(manager, tenant, history, MESSAGES[3])  # continue
    assert (turn.session_id, turn.action) == (parent, "continue")
    regenerate, turn = post(manager, tenant, history[:2], MESSAGES[2])  # regenerate the third reply
    assert turn.action == "fork" and turn.parent_id == parent and turn.fork_source == "device"
    assert regenerate.stats.restored_from == "device" and regenerate.stats.reused_tokens > 0
    assert regenerate.token_ids == reference_reply(manager, tenant, turn.session_id, MESSAGES[2], TOKENS)
    edited, turn = post(manager, tenant, history[:1], "Name a shape.")  # edit the second user message
    assert turn.action == "fork" and edited.stats.reused_tokens > 0
    _, turn = post(manager, tenant, [("Unrelated?", "Yes.")], "Go on.")
    assert turn.action == "new" and manager.session_info(tenant, turn.session_id).origin == "implicit"


def test_a_posted_history_never_adds_a_turn_to_a_session_a_client_named(tiny_manager: SessionManager) -> None:
    """Explicit and named sessions belong to the client that made them: another request posting
    the same history (a common greedy opening) forks them, warm, and leaves them untouched."""
    manager = tiny_manager
    tenant = manager.create_tenant("acme").id
    explicit = conversation(manager, tenant, 2)
    named = manager.open_session(tenant, SYSTEM, name="user-1")
    for message in MESSAGES[:2]:
        manager.chat(tenant, named, message, max_new_tokens=TOKENS)
    for sid in (explicit, named):
        history = returned(manager, tenant, sid)
        before = manager.history(tenant, sid)
        reply, turn = post(manager, tenant, history, "My password is hunter2.")
        assert turn.action == "fork" and turn.session_id != sid
        assert reply.stats.reused_tokens > 0
        assert manager.history(tenant, sid) == before
        assert manager.session_info(tenant, turn.session_id).origin == "implicit"


def test_identical_posts_at_once_all_complete_exactly(tmp_path: Path, tiny_engine: Engine) -> None:
    """Ten clients posting one history at once (retries, a regenerate button pressed ten times):
    one may continue the session, the others fork it; every request gets its reply, the same one."""
    with open_manager(tmp_path / "home", tiny_engine) as manager:
        tenant = manager.create_tenant("acme").id
        parent = stateless_conversation(manager, tenant, 2)
        history = returned(manager, tenant, parent)
        manager.internals.tiers.flush()
        manager.evict_session(tenant, parent, "disk")  # the forks' seeds are slow to read: a wider race
        results: list[tuple[Reply, PlannedTurn]] = []
        errors: list[BaseException] = []

        def post_one() -> None:
            try:
                results.append(post(manager, tenant, history[:1], MESSAGES[1]))
            except Exception as exc:  # noqa: BLE001 - reported below, with the other threads'
                errors.append(exc)

        threads = [threading.Thread(target=post_one) for _ in range(10)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert errors == []
        assert len(results) == 10
        assert len({turn.session_id for _, turn in results}) == 10  # no two requests shared a session
        reference = reference_reply(manager, tenant, manager.fork(tenant, parent, 1), MESSAGES[1], TOKENS)
        assert [reply.token_ids for reply, _ in results] == [reference] * 10
        assert sorted(turn.action or "" for _, turn in results).count("fork") >= 9


def test_another_tenants_identical_history_finds_nothing(tiny_manager: SessionManager) -> None:
    manager = tiny_manager
    acme, beta = manager.create_tenant("acme").id, manager.create_tenant("beta").id
    parent = conversation(manager, acme, 2)
    history = returned(manager, acme, parent)
    turn = manager.continue_history(beta, SYSTEM, history[:1], MESSAGES[1], max_new_tokens=TOKENS)
    reply = list(turn)[-1]
    assert turn.action == "new" and isinstance(reply, Reply)
    assert reply.stats.reused_tokens == 0  # not even acme's system prompt: pools are per tenant
    with pytest.raises(SessionNotFound):
        manager.fork(beta, parent, 1)


def test_a_fork_that_never_completes_a_turn_is_deleted(tiny_manager: SessionManager) -> None:
    manager = tiny_manager
    tenant = manager.create_tenant("acme").id
    parent = conversation(manager, tenant, 2)
    history = returned(manager, tenant, parent)
    turn = manager.continue_history(tenant, SYSTEM, history[:1], "Again", max_new_tokens=500, temperature=1.0, seed=1)
    assert isinstance(turn.start(), str)
    fork = turn.session_id
    turn.close()  # the client went away mid-reply
    assert [s.id for s in manager.list_sessions(tenant)] == [parent]
    with pytest.raises(SessionNotFound):
        manager.session_info(tenant, fork)


def test_forks_are_refused_for_turns_a_session_does_not_have(tiny_manager: SessionManager) -> None:
    manager = tiny_manager
    tenant = manager.create_tenant("acme").id
    parent = conversation(manager, tenant, 1)
    for bad in (2, -1, True, "1", 2**62):
        with pytest.raises(InvalidInput):
            manager.fork(tenant, parent, bad)  # type: ignore[arg-type]
    assert manager.session_info(tenant, manager.fork(tenant, parent, 0)).message_count == 0


def test_eight_forks_at_once_while_the_parent_goes_on(tmp_path: Path, tiny_engine: Engine) -> None:
    with open_manager(tmp_path / "home", tiny_engine) as manager:
        tenant = manager.create_tenant("acme").id
        parent = conversation(manager, tenant, 2)
        replies: list[tuple[str, Reply]] = []
        errors: list[BaseException] = []

        def fork_and_chat(i: int) -> None:
            try:
                fork = manager.fork(tenant, parent, 1 + i % 2)
                replies.append((f"Branch {i}", manager.chat(tenant, fork, f"Branch {i}", max_new_tokens=TOKENS)))
            except Exception as exc:  # noqa: BLE001 - reported below, with the other threads'
                errors.append(exc)

        threads = [threading.Thread(target=fork_and_chat, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        parent_reply = manager.chat(tenant, parent, MESSAGES[2], max_new_tokens=TOKENS)
        for thread in threads:
            thread.join(60)
        assert errors == []
        assert parent_reply.stats.restored_from == "device"
        assert len(replies) == 8
        for message, reply in replies:
            assert reply.stats.reused_tokens > 0
            i = int(message.split()[1])
            reference = manager.fork(tenant, parent, 1 + i % 2)  # the same prefix, checked alone
            assert reply.token_ids == reference_reply(manager, tenant, reference, message, TOKENS)


def test_a_windowed_parent_is_forked_by_rebuilding_exactly(tmp_path: Path, tiny_engine: Engine) -> None:
    """The parent's window demoted turn 0 (its later turns were computed without it in view), so
    its KV is no fork's: the fork rebuilds from its transcript, like a fresh session would."""
    with open_manager(tmp_path / "home", tiny_engine, context_budget_tokens=90) as manager:
        tenant = manager.create_tenant("acme").id
        parent = conversation(manager, tenant, 4)
        assert [s.turn_index for s in manager.inspect_session(tenant, parent).layers][1] != 0  # turn 0 went
        fork = manager.fork(tenant, parent, 2)
        expected = reference_reply(manager, tenant, fork, "Something else.", TOKENS)
        reply = manager.chat(tenant, fork, "Something else.", max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "rebuilt" and reply.stats.demoted_tokens == 0
        assert reply.token_ids == expected
        assert manager.stats()["forks"] == {"rebuilt": 1.0}


def test_a_quantised_parent_is_forked_by_rebuilding_exactly(tmp_path: Path, tiny_engine: Engine) -> None:
    with open_manager(
        tmp_path / "home", tiny_engine, offload_precision="int8", quant_residual_tokens=0, persist="on_evict"
    ) as manager:
        tenant = manager.create_tenant("acme").id
        parent = conversation(manager, tenant, 3)
        manager.evict_session(tenant, parent, "host")
        fork = manager.fork(tenant, parent, 2)
        expected = reference_reply(manager, tenant, fork, "Something else.", TOKENS)
        reply = manager.chat(tenant, fork, "Something else.", max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "rebuilt"
        assert reply.token_ids == expected


def test_a_fork_reads_its_parent_from_the_shared_redis_tier(
    tmp_path: Path, tiny_engine: Engine, redis_url: str, redis_prefix: str
) -> None:
    """Another replica's session, published to Redis when that replica stopped: the fork's cache
    comes from Redis without this replica taking the parent over."""
    shared = {
        "database_url": f"sqlite:///{tmp_path / 'shared.db'}",
        "redis_url": redis_url,
        "redis_prefix": redis_prefix,
    }
    with open_manager(tmp_path / "a", tiny_engine, replica_id="a", **shared) as first:
        tenant = first.create_tenant("acme").id
        parent = conversation(first, tenant, 3)
    with open_manager(tmp_path / "b", tiny_engine, replica_id="b", **shared) as second:
        assert second.inspect_session(tenant, parent).shared_copy
        fork = second.fork(tenant, parent, 2)
        expected = reference_reply(second, tenant, fork, "Something else.", TOKENS)
        reply = second.chat(tenant, fork, "Something else.", max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "device" and reply.token_ids == expected
        assert second.stats()["forks"] == {"redis": 1.0}


@pytest.mark.real_model
def test_regenerate_edit_and_retry_are_warm_and_exact_on_the_real_model(tmp_path: Path, real_engine: Engine) -> None:
    """The stateless paths of a chat UI on the default model: each reply equals a full re-prefill
    of its conversation (greedy), and each fork prefilled less than its whole history."""
    with one_torch_thread(), open_manager(tmp_path / "home", real_engine) as manager:
        tenant = manager.create_tenant("acme").id
        history: list[tuple[str, str]] = []
        for message in MESSAGES[:3]:
            reply = run(manager.continue_history(tenant, SYSTEM, history, message, max_new_tokens=16))
            history.append((message, reply.text))
        made = []
        for name, posted, message in [
            ("regenerate", history[:2], MESSAGES[2]),
            ("edit", history[:1], "Name a fruit instead."),
            ("retry", history[:2], MESSAGES[2]),
        ]:
            turn = manager.continue_history(tenant, SYSTEM, posted, message, max_new_tokens=16)
            reply = run(turn)
            assert turn.action == "fork" and turn.parent_id is not None, name
            whole = reply.stats.prefill_tokens + reply.stats.reused_tokens
            assert reply.stats.reused_tokens > whole // 2, name
            made.append((name, turn.parent_id, len(posted), message, reply))
        for name, parent, turns, message, reply in made:  # references after: they are sessions too
            check = manager.fork(tenant, parent, turns)
            assert reply.token_ids == reference_reply(manager, tenant, check, message, 16), name


def run(turn: object) -> Reply:
    items = list(turn)  # type: ignore[call-overload]
    assert isinstance(items[-1], Reply)
    return items[-1]
