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
from sessions import ChatKVError, SessionInfo, SessionNotFound, Tenant

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
        """Show the question for the open session: its name (a fork's own line, as the picker
        shows it), id and turns, that it goes for good, and what becomes of its parent and its
        forks (`_question`). One error line instead when no session is open or a turn runs on it."""
        session_id = state.session_id
        if session_id is None:
            return make_view(state, error_line=error_html(NOTHING_TO_DELETE))
        if self._turns.find(str(tenant.id), session_id) is not None:
            return make_view(state, error_line=error_html(TURN_IN_FLIGHT.format(session_id)))
        try:
            question = self._question(tenant, session_id)
        except ChatKVError as exc:
            return make_view(state, error_line=error_html(str(exc)))
        return make_view(
            replace(state, deleting=session_id),
            delete_panel=gr.update(visible=True),
            delete_question=question,
            error_line="",
        )

    def _question(self, tenant: Tenant, session_id: str) -> str:
        """The question (HTML) naming the session as the picker does, its id and turns, and what
        becomes of the sessions around it: a fork's parent is untouched, and forks made from it
        stay, each then listed on its own (raises `ChatKVError`)."""
        info = self.manager.session_info(tenant, session_id)
        listed = {str(other.id): other for other in self.manager.list_sessions(tenant)}
        turns = info.message_count // 2
        facts = f"<code>{html.escape(session_id)}</code>, {turns} turn{'' if turns == 1 else 's'}"
        question = f"Delete “{html.escape(self._labels.name(tenant, info))}” ({facts}) for good?"
        parent = listed.get(str(info.parent_id)) if info.parent_id is not None else None
        if info.parent_id is not None:
            line = html.escape(self._labels.fork_line(tenant, info, parent))
            question = f"Delete the {line} ({facts}) for good?"
        question += " Its transcript and its cache in every tier are removed; this cannot be undone."
        if parent is not None:
            question += f" {self._parent_name(tenant, parent, listed)}, the session it was forked from, stays as it is."
        forks = sum(1 for other in listed.values() if other.parent_id == info.id)
        if forks:
            question += (
                f" Its {forks} forks stay, each listed on its own as a fork of a deleted session."
                if forks > 1
                else " Its fork stays, listed on its own as a fork of a deleted session."
            )
        return question

    def _parent_name(self, tenant: Tenant, parent: SessionInfo, listed: dict[str, SessionInfo]) -> str:
        """`“its name”`, or for a fork `The fork at turn 2: ...` (HTML; it starts a sentence)."""
        if parent.parent_id is None:
            return f"“{html.escape(self._labels.name(tenant, parent))}”"
        grandparent = listed.get(str(parent.parent_id))
        return f"The {html.escape(self._labels.fork_line(tenant, parent, grandparent))}"

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
