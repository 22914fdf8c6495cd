"""Forks on the chat page (`app.ui.forks`, `app.ui.sessions`, `app.ui.deletion`): a retry at
Temperature 0 keeps no fork identical to one stored already, the picker lists forks as a tree
under their parent, each by its own line, and the delete question names exactly what goes and
what stays. Through the handlers without a browser: a real manager on a tiny model and a real
SQLite file; the tree order also on `SessionInfo` values alone."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from app.ui import LOCAL_TENANT, ChatUI, View, ViewState
from app.ui.forks import SAME_FORK_NOTE, SAME_REPLY_NOTE
from app.ui.render import note_html
from app.ui.sessions import session_tree
from sessions import SessionId, SessionInfo, SessionNotFound, TenantId
from sessions.manager import SessionManager

EM = "\u2003"
SAME_REPLY = note_html(SAME_REPLY_NOTE, kind="same")
SAME_FORK = note_html(SAME_FORK_NOTE, kind="same")


def _send(ui: ChatUI, state: ViewState, message: str, max_new_tokens: int = 6) -> View:
    return list(ui.send(message, max_new_tokens, 0.0, state))[-1]


def _retry(ui: ChatUI, state: ViewState, max_new_tokens: int = 6, temperature: float = 0.0) -> list[View]:
    return list(ui.regenerate(max_new_tokens, temperature, state))


def _edit(ui: ChatUI, state: ViewState, index: int, text: str) -> View:
    return list(ui.edit_message(index, text, 6, 0.0, state))[-1]


def _ids(manager: SessionManager) -> set[str]:
    return {str(info.id) for info in manager.list_sessions(LOCAL_TENANT)}


def test_a_greedy_retry_that_repeats_the_reply_keeps_no_fork(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    done = _send(ui, ui.on_load(ViewState()).state, "Hello there")
    parent = str(done.state.session_id)
    for _ in range(3):  # each click used to add one more identical fork to the picker
        views = _retry(ui, done.state)
        fork = views[0].state.session_id
        assert fork not in (None, parent)  # the turn ran on a fork: only the result tells
        last = views[-1]
        assert last.reply_note == SAME_REPLY and last.error_line == ""
        assert last.state == done.state and last.chatbot == done.chatbot
        assert last.session_picker["choices"] == [("Hello there · just now", parent)]
        assert last.session_picker["value"] == parent
        assert last.remembered == {"tenant": str(done.state.tenant.id), "session": parent}  # type: ignore[union-attr]
        assert last.message["interactive"] is True and last.stop_button["visible"] is False
        with pytest.raises(SessionNotFound):
            tiny_manager.session_info(LOCAL_TENANT, str(fork))
        assert _ids(tiny_manager) == {parent}
    assert len(tiny_manager.history(LOCAL_TENANT, parent)) == 2


def test_a_greedy_retry_equal_to_an_earlier_fork_opens_that_fork(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    done = _send(ui, ui.on_load(ViewState()).state, "Hello there")
    parent = str(done.state.session_id)
    # Two more tokens: another reply, so a fork even at Temperature 0.
    longer = _retry(ui, done.state, max_new_tokens=8)[-1]
    fork = str(longer.state.session_id)
    assert fork != parent and longer.reply_note != SAME_REPLY and _ids(tiny_manager) == {parent, fork}

    again = _retry(ui, done.state, max_new_tokens=8)
    assert again[0].state.session_id not in (parent, fork)
    last = again[-1]
    assert last.state.session_id == fork and last.reply_note == SAME_FORK
    assert last.chatbot == longer.chatbot and last.session_picker["value"] == fork
    assert [sid for _, sid in last.session_picker["choices"]] == [parent, fork]
    assert last.remembered == {"tenant": str(done.state.tenant.id), "session": fork}  # type: ignore[union-attr]
    assert last.message["interactive"] is True and last.stop_button["visible"] is False
    assert _ids(tiny_manager) == {parent, fork}

    # The same for an edit to a text that a fork at that turn already ran.
    edited = _edit(ui, done.state, 0, "Hi")
    edit_fork = str(edited.state.session_id)
    assert _ids(tiny_manager) == {parent, fork, edit_fork}
    same_edit = _edit(ui, done.state, 0, "Hi")
    assert same_edit.state.session_id == edit_fork and same_edit.reply_note == SAME_FORK
    assert _ids(tiny_manager) == {parent, fork, edit_fork}


def test_a_retry_above_temperature_0_is_always_a_new_branch(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    done = _send(ui, ui.on_load(ViewState()).state, "Hello there")
    parent = str(done.state.session_id)
    forks = []
    for _ in range(2):
        last = _retry(ui, done.state, temperature=1.0)[-1]
        forks.append(str(last.state.session_id))
        assert SAME_REPLY not in last.reply_note
    assert len(set(forks)) == 2 and parent not in forks
    assert _ids(tiny_manager) == {parent, *forks}
    assert [sid for _, sid in last.session_picker["choices"]] == [parent, *forks]  # by age at one fork turn


def _info(sid: str, created: int, active: int, parent: str | None = None, turns: int | None = None) -> SessionInfo:
    base = datetime(2026, 1, 1, tzinfo=UTC)
    return SessionInfo(
        id=SessionId(sid),
        tenant_id=TenantId("t"),
        title=sid,
        system_prompt=None,
        model_fingerprint="m",
        token_count=0,
        message_count=2,
        created_at=base + timedelta(minutes=created),
        last_active_at=base + timedelta(minutes=active),
        parent_id=None if parent is None else SessionId(parent),
        fork_turns=turns,
        origin="explicit" if parent is None else "fork",
    )


def test_the_tree_lists_forks_under_their_parent_and_families_by_their_latest_activity() -> None:
    infos = [  # as `list_sessions` orders them: most recently active first
        _info("fork-b1", 2, 50, "root-b", 0),
        _info("root-a", 1, 40),
        _info("fork-b3", 3, 30, "root-b", 2),
        _info("fork-b2", 4, 20, "root-b", 0),
        _info("orphan-4", 5, 15, "gone-9", 1),
        _info("fork-b4", 6, 12, "fork-b3", 3),
        _info("root-b", 0, 10),
    ]
    tree = session_tree(infos)
    rows = [(str(row.info.id), row.depth, None if row.parent is None else str(row.parent.id)) for row in tree]
    assert rows == [
        ("root-b", 0, None),  # its fork fork-b1 is the most recently active session
        ("fork-b1", 1, "root-b"),  # forks at turn 1 by age (b1 made before b2), then the fork at turn 3
        ("fork-b2", 1, "root-b"),
        ("fork-b3", 1, "root-b"),
        ("fork-b4", 2, "fork-b3"),
        ("root-a", 0, None),
        ("orphan-4", 0, None),  # its parent is not listed (deleted): on its own
    ]
    assert session_tree([]) == []


def test_the_delete_question_names_the_fork_and_says_what_stays(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    state = ui.on_load(ViewState()).state
    for message in ("Name a colour.", "Name another one."):
        state = _send(ui, state, message).state
    parent = str(state.session_id)
    shape = _edit(ui, state, 2, "Name a shape.")
    size = _edit(ui, shape.state, 2, "Name a size.")
    fruit = _edit(ui, state, 0, "Name a fruit.")
    fork_shape, fork_size = str(shape.state.session_id), str(size.state.session_id)
    gone = " Its transcript and its cache in every tier are removed; this cannot be undone."

    asked = ui.ask_delete(size.state)
    assert asked.delete_question == (
        f"Delete the fork at turn 2: “Name a size.” (<code>{fork_size}</code>, 2 turns) for good?{gone}"
        " The fork at turn 2: “Name a shape.”, the session it was forked from, stays as it is."
    )
    asked = ui.ask_delete(shape.state)
    assert asked.delete_question == (
        f"Delete the fork at turn 2: “Name a shape.” (<code>{fork_shape}</code>, 2 turns) for good?{gone}"
        " “Name a colour.”, the session it was forked from, stays as it is."
        " Its fork stays, listed on its own as a fork of a deleted session."
    )
    assert ui.ask_delete(fruit.state).delete_question == (
        f"Delete the fork at turn 1: “Name a fruit.” (<code>{fruit.state.session_id}</code>, 1 turn) for good?{gone}"
        " “Name a colour.”, the session it was forked from, stays as it is."
    )
    assert ui.ask_delete(state).delete_question == (
        f"Delete “Name a colour.” (<code>{parent}</code>, 2 turns) for good?{gone}"
        " Its 2 forks stay, each listed on its own as a fork of a deleted session."
    )

    # Deleting the fork deletes it alone: its own fork is listed on its own, by its own line.
    deleted = ui.confirm_delete(ui.ask_delete(shape.state).state)
    assert _ids(tiny_manager) == {parent, str(fruit.state.session_id), fork_size}
    assert deleted.session_picker["choices"] == [
        ("Name a colour. · just now", parent),  # its fork's turn ran last
        (f"{EM}↳ fork at turn 1: “Name a fruit.” · just now", fruit.state.session_id),
        ("↳ fork at turn 2 of a deleted session: “Name a size.” · just now", fork_size),
    ]


def test_a_fork_of_a_titled_session_is_named_by_its_change_not_the_title(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    titled = ui.new_session("Colours", "", ui.on_load(ViewState()).state)
    parent = str(titled.state.session_id)
    done = _send(ui, titled.state, "Name a colour.")
    edited = _edit(ui, done.state, 0, "Name a shape.")
    fork = str(edited.state.session_id)
    assert tiny_manager.session_info(LOCAL_TENANT, fork).title == "Colours"  # copied by the fork
    assert edited.session_picker["choices"] == [
        ("Colours · just now", parent),
        (f"{EM}↳ fork at turn 1: “Name a shape.” · just now", fork),
    ]
    assert "Colours" in done.session_info and "Colours" not in edited.session_info
    assert f"fork of <code>{parent}</code> at turn 1" in edited.session_info
    assert ui.ask_delete(edited.state).delete_question.startswith("Delete the fork at turn 1: “Name a shape.” (")
