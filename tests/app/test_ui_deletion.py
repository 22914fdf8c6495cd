"""Deleting a session from the chat page (`app.ui.deletion`), through the handlers without a
browser: a real manager on a tiny model and a real SQLite file. Also the page's sign-in help."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.ui import KEY_HELP, LOCAL_TENANT, ChatUI, View, ViewState
from app.ui.deletion import NOTHING_TO_DELETE, TURN_IN_FLIGHT
from app.ui.render import error_html
from sessions import SessionNotFound
from sessions.manager import SessionManager

HIDDEN = {"__type__": "update", "visible": False}
SHOWN = {"__type__": "update", "visible": True}


def _chatted(ui: ChatUI, state: ViewState, message: str) -> View:
    """The last view of a sent message (a new session when none is open)."""
    return list(ui.send(message, 4, 0.0, state))[-1]


def _choice_ids(view: View) -> list[str]:
    return [value for _, value in view.session_picker["choices"]]


def test_delete_asks_first_and_then_removes_the_open_session(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    kept = _chatted(ui, ui.on_load(ViewState()).state, "keep me")
    doomed = _chatted(ui, ui.leave_session(kept.state).state, "delete me")
    sid = doomed.state.session_id
    assert sid is not None

    asked = ui.ask_delete(doomed.state)
    assert asked.delete_panel == SHOWN and asked.state.deleting == sid
    assert "“delete me”" in asked.delete_question and f"<code>{sid}</code>, 1 turn)" in asked.delete_question
    assert "cannot be undone" in asked.delete_question
    assert len(tiny_manager.history(LOCAL_TENANT, sid)) == 2  # asking deletes nothing

    deleted = ui.confirm_delete(asked.state)
    with pytest.raises(SessionNotFound):
        tiny_manager.session_info(LOCAL_TENANT, sid)
    assert deleted.state == ViewState(tenant=doomed.state.tenant)
    assert (deleted.chatbot, deleted.stats_table, deleted.remembered) == ([], [], None)
    assert deleted.delete_panel == HIDDEN and deleted.error_line == ""
    assert deleted.session_info.startswith(f"Deleted session <code>{sid}</code>.")
    assert _choice_ids(deleted) == [kept.state.session_id] and deleted.session_picker["value"] is None
    # A second click on the answer finds no question and deletes nothing more.
    again = ui.confirm_delete(deleted.state)
    assert again.delete_panel == HIDDEN and again.error_line == {"__type__": "update"}
    assert [info.id for info in tiny_manager.list_sessions(LOCAL_TENANT)] == [kept.state.session_id]


def test_keeping_it_deletes_nothing_and_opening_another_session_puts_the_question_away(
    tiny_manager: SessionManager,
) -> None:
    ui = ChatUI(tiny_manager, local=True)
    chatted = _chatted(ui, ui.on_load(ViewState()).state, "hello")
    sid = chatted.state.session_id
    assert sid is not None
    kept = ui.cancel_delete(ui.ask_delete(chatted.state).state)
    assert kept.delete_panel == HIDDEN and kept.delete_question == ""
    assert kept.state == chatted.state
    assert [info.id for info in tiny_manager.list_sessions(LOCAL_TENANT)] == [sid]

    other = _chatted(ui, ui.leave_session(chatted.state).state, "another")
    assert other.state.session_id is not None
    asked = ui.ask_delete(chatted.state)
    for moved in (
        ui.select_session(other.state.session_id, asked.state),
        ui.new_session("", "", asked.state),
        ui.leave_session(asked.state),
    ):
        assert moved.delete_panel == HIDDEN and moved.state.deleting is None


def test_the_picker_sending_the_open_session_again_changes_nothing(tiny_manager: SessionManager) -> None:
    # Gradio's dropdown sends its value when it loses focus, e.g. to the Delete button's click:
    # the open session must not be reloaded over the question that click asks.
    ui = ChatUI(tiny_manager, local=True)
    chatted = _chatted(ui, ui.on_load(ViewState()).state, "hello")
    asked = ui.ask_delete(chatted.state)
    again = ui.select_session(chatted.state.session_id, chatted.state)
    assert all(value == {"__type__": "update"} for value in again)  # the state too: `deleting` stays
    assert asked.state.deleting == chatted.state.session_id
    # No session open and the picker empty: its blur beside New session must not undo that click.
    empty = ui.leave_session(chatted.state).state
    assert all(value == {"__type__": "update"} for value in ui.select_session(None, empty))


def test_the_answer_deletes_the_session_the_question_named(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    first = _chatted(ui, ui.on_load(ViewState()).state, "first")
    second = _chatted(ui, ui.leave_session(first.state).state, "second")
    first_sid, second_sid = first.state.session_id, second.state.session_id
    assert first_sid is not None and second_sid is not None
    asked = ui.ask_delete(second.state)
    # Another session is open by the time the answer comes (a fork started by Retry opens one):
    # the answer deletes `second`, which the question named, and leaves the open one on screen.
    deleted = ui.confirm_delete(replace(asked.state, session_id=first_sid))
    assert [info.id for info in tiny_manager.list_sessions(LOCAL_TENANT)] == [first_sid]
    assert deleted.state.session_id == first_sid and deleted.state.deleting is None
    assert deleted.chatbot == {"__type__": "update"}  # the session on screen is untouched
    assert _choice_ids(deleted) == [first_sid] and deleted.session_picker["value"] == first_sid


def test_a_session_deleted_meanwhile_reads_as_already_deleted(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    chatted = _chatted(ui, ui.on_load(ViewState()).state, "hello")
    sid = chatted.state.session_id
    assert sid is not None
    asked = ui.ask_delete(chatted.state)
    tiny_manager.delete_session(LOCAL_TENANT, sid)  # another tab, or an operator
    gone = ui.confirm_delete(asked.state)
    assert gone.session_info.startswith(f"Session <code>{sid}</code> was already deleted.")
    assert gone.error_line == "" and gone.session_picker["choices"] == [] and gone.chatbot == []


def test_delete_refuses_with_one_line_without_a_session_or_during_a_turn(tiny_manager: SessionManager) -> None:
    ui = ChatUI(tiny_manager, local=True)
    empty = ui.on_load(ViewState()).state
    refused = ui.ask_delete(empty)
    assert refused.error_line == error_html(NOTHING_TO_DELETE) and refused.delete_panel == {"__type__": "update"}

    state = ui.new_session("", "", empty).state
    sid = state.session_id
    assert sid is not None
    stream = ui.send("Tell me a long story", 1500, 1.0, state)
    streaming = next(stream)  # the turn runs in this tab
    try:
        busy = ui.ask_delete(streaming.state)
        assert busy.error_line == error_html(TURN_IN_FLIGHT.format(sid)) and busy.state.deleting is None
        # A question asked before the turn started is refused the same way when answered.
        answered = ui.confirm_delete(replace(streaming.state, deleting=sid))
        assert answered.error_line == error_html(TURN_IN_FLIGHT.format(sid))
    finally:
        ui.stop(streaming.state)
        list(stream)
    assert tiny_manager.session_info(LOCAL_TENANT, sid).id == sid


def test_signed_out_or_revoked_tabs_cannot_delete(tiny_manager: SessionManager) -> None:
    acme = tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session(acme, title="plans")
    ui = ChatUI(tiny_manager, local=False)
    assert ui.ask_delete(ViewState()).error_line == error_html("sign in first")
    signed_in = ui.select_session(sid, ui.login(tiny_manager.issue_api_key(acme), ViewState()).state)
    asked = ui.ask_delete(signed_in.state)
    assert "“plans”" in asked.delete_question
    tiny_manager.issue_api_key(acme)  # rotated: the tab's key no longer works
    answered = ui.confirm_delete(asked.state)
    assert answered.main_panel == HIDDEN
    assert [info.id for info in tiny_manager.list_sessions(acme)] == [sid]


def test_the_sign_in_page_says_where_keys_come_from(tiny_manager: SessionManager) -> None:
    from app.ui import build_ui

    config = build_ui(tiny_manager, local=False).get_config_file()
    by_id = {c["props"].get("elem_id"): c for c in config["components"]}
    assert by_id["login-help"]["props"]["value"] == KEY_HELP
    assert "chatkv tenants create <name>" in KEY_HELP and "administrator" in KEY_HELP
    assert by_id["delete-panel"]["props"]["visible"] is False
    assert {"delete-session", "confirm-delete", "cancel-delete", "delete-question"} <= set(by_id)
