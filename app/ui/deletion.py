"""Deleting a session from the page, in two steps: the Delete button only asks (naming the session
and what goes with it), and the answer deletes it through `SessionManager.delete_session` or puts
the question away. The question remembers the session it names (`ViewState.deleting`), so the
confirmation deletes exactly that one, whatever is open by then."""

from __future__ import annotations

import html
from dataclasses import replace
from typing import TYPE_CHECKING

import gradio as gr

from app.ui.render import error_html
from app.ui.view import DELETE_HIDDEN, View, ViewState, make_view, no_session_view
from sessions import ChatKVError, SessionNotFound, Tenant

if TYPE_CHECKING:
    from app.ui.sessions import SessionLabels
    from app.ui.turns import TurnThreads
    from sessions import SessionManager

NOTHING_TO_DELETE = "open a session first: Delete removes the session on screen"
TURN_IN_FLIGHT = "session {} has a turn in flight: stop it or wait for its reply, then delete"


class SessionDeletion:
    """The delete question and its answers over one manager; the picker's labels name the
    session, and a session with a turn streaming in some tab is refused."""

    def __init__(self, manager: SessionManager, labels: SessionLabels, turns: TurnThreads) -> None:
        self.manager = manager
        self._labels = labels
        self._turns = turns

    def ask(self, tenant: Tenant, state: ViewState) -> View:
        """Show the question for the open session: its name, id and turns, and that it goes for
        good. One error line instead when no session is open or a turn runs on it."""
        session_id = state.session_id
        if session_id is None:
            return make_view(state, error_line=error_html(NOTHING_TO_DELETE))
        if self._turns.find(str(tenant.id), session_id) is not None:
            return make_view(state, error_line=error_html(TURN_IN_FLIGHT.format(session_id)))
        try:
            info = self.manager.session_info(tenant, session_id)
            name = self._labels.name(tenant, info)
        except ChatKVError as exc:
            return make_view(state, error_line=error_html(str(exc)))
        turns = info.message_count // 2
        question = (
            f"Delete “{html.escape(name)}” (<code>{html.escape(session_id)}</code>, {turns} "
            f"turn{'' if turns == 1 else 's'}) for good? Its transcript and its cache in every tier are "
            "removed; this cannot be undone. Forks made from it stay."
        )
        return make_view(
            replace(state, deleting=session_id),
            delete_panel=gr.update(visible=True),
            delete_question=question,
            error_line="",
        )

    def confirm(self, tenant: Tenant, state: ViewState) -> View:
        """Delete the session the question named and refresh the picker; if it is the one on
        screen, the chat empties (the next message starts a new session). A session deleted
        meanwhile (another tab, an operator) is gone all the same: the picker is refreshed."""
        session_id = state.deleting
        if session_id is None:  # a second click on the answer
            return make_view(state, **DELETE_HIDDEN)
        if self._turns.find(str(tenant.id), session_id) is not None:
            return make_view(state, error_line=error_html(TURN_IN_FLIGHT.format(session_id)))
        note = f"Deleted session <code>{html.escape(session_id)}</code>."
        try:
            self.manager.delete_session(tenant, session_id)
        except SessionNotFound:
            note = f"Session <code>{html.escape(session_id)}</code> was already deleted."
        except ChatKVError as exc:
            return make_view(replace(state, deleting=None), error_line=error_html(str(exc)), **DELETE_HIDDEN)
        if session_id == state.session_id:
            view = no_session_view(state, note + " Your next message starts a new session.")
        else:
            view = make_view(replace(state, deleting=None), error_line="", **DELETE_HIDDEN)
        try:
            return view._replace(session_picker=self._labels.picker(tenant, view.state.session_id))
        except ChatKVError as exc:
            return view._replace(error_line=error_html(str(exc)))

    def cancel(self, state: ViewState) -> View:
        """Put the question away; nothing is deleted."""
        return make_view(replace(state, deleting=None), **DELETE_HIDDEN)
