"""The chat page's event handlers (`ChatUI`): signing in, opening and starting sessions, and
streaming turns. Each returns a `View` (`app.ui.view`), so tests call them without a browser; the
page that wires them to components is `app.ui.build_ui`."""

from __future__ import annotations

import contextlib
import html
from collections.abc import Callable, Generator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import gradio as gr

from app.ui.deletion import SessionDeletion
from app.ui.forks import (
    FORK_STOPPED_NOTE,
    NO_SUCH_MESSAGE,
    SAME_FORK_NOTE,
    SAME_REPLY_NOTE,
    ForkPoint,
    edit_point,
    regenerate_point,
    same_turn,
)
from app.ui.render import (
    chat_messages,
    error_html,
    failure_message,
    length_note,
    note_html,
    session_info_html,
    stats_html,
    stats_row,
)
from app.ui.sessions import SessionLabels
from app.ui.turns import Turn, TurnThreads, slider_options
from app.ui.view import (
    DELETE_HIDDEN,
    View,
    ViewState,
    input_update,
    make_view,
    no_session_shown,
    no_session_view,
    overlay,
    remembered_session,
    remembered_value,
    stop_button_update,
    unchanged_view,
)
from sessions import ChatKVError, InvalidInput, Reply, Tenant, TenantExists, TenantNotFound, TurnTarget

if TYPE_CHECKING:
    from app.http.prefetch import Prefetcher
    from sessions import SessionManager

LOCAL_TENANT = "local"
UNKNOWN_KEY_MESSAGE = "unknown API key"
"""The one answer to a wrong key and to a key of an unknown tenant (they must look the same)."""
EMPTY_KEY_MESSAGE = "enter an API key"
STOPPED_NOTE = (
    "Stopped. The partial reply was discarded and nothing was stored for this turn; your message is back in the box."
)
"""Shown under the chat after Stop: the manager stores nothing for a cancelled turn."""


class ChatUI:
    """Event handlers of the chat page over one manager. Holds no tab's data (that is in
    `ViewState`): only the turns in flight and the first messages that label untitled sessions."""

    def __init__(self, manager: SessionManager, *, local: bool, prefetcher: Prefetcher | None = None) -> None:
        self.manager = manager
        self.local = local
        self.prefetcher = prefetcher
        """Restores a selected session's cache to the device before its next message (server only)."""
        self._turns = TurnThreads()
        self._labels = SessionLabels(manager)
        self._deletion = SessionDeletion(manager, self._labels, self._turns)

    # -- signing in ----------------------------------------------------------------------------

    def on_load(self, state: ViewState, remembered: object = None) -> View:
        """Page opened: local mode signs in as the `local` tenant (created if missing) and opens the
        session this browser had open (`remembered`), if it is still there."""
        if not self.local:
            return self._signed_out()
        try:
            tenant = local_tenant(self.manager)
        except ChatKVError as exc:
            return make_view(ViewState(), main_panel=gr.update(visible=True), error_line=error_html(str(exc)))
        return self._signed_in(tenant, None, remembered)

    def login(self, api_key: str, state: ViewState, remembered: object = None) -> View:
        """Resolve a tenant API key; any wrong or unknown key gets `UNKNOWN_KEY_MESSAGE`. The
        session this browser had open is opened again if it is this tenant's."""
        key = (api_key or "").strip()
        if not key:
            return self._signed_out(message=error_html(EMPTY_KEY_MESSAGE))
        try:
            tenant = self.manager.tenant_for_api_key(key)
        except TenantNotFound:
            return self._signed_out(message=error_html(UNKNOWN_KEY_MESSAGE))
        return self._signed_in(tenant, key, remembered)

    def sign_out(self, state: ViewState) -> View:
        """Sign out and forget the open session in this browser."""
        return self._signed_out()._replace(remembered=None)

    def _signed_out(self, message: str = "") -> View:
        # Every tenant-derived component is cleared, so the next sign-in never sees this one's data.
        return make_view(
            ViewState(),
            login_panel=gr.update(visible=True),
            main_panel=gr.update(visible=False),
            login_message=message,
            api_key="",
            tenant_line="",
            session_picker=gr.update(choices=[], value=None),
            **no_session_shown(),
        )

    def _signed_in(self, tenant: Tenant, api_key: str | None, remembered: object) -> View:
        state = ViewState(tenant=tenant, api_key=api_key)
        view = make_view(
            state,
            login_panel=gr.update(visible=False),
            main_panel=gr.update(visible=True),
            login_message="",
            api_key="",
            tenant_line=f"Tenant <b>{html.escape(tenant.name)}</b> · model {html.escape(self.manager.model_name)}",
            session_picker=self._labels.picker(tenant, None),
            **no_session_shown(),
        )
        session_id = remembered_session(remembered, tenant)
        if session_id is None:
            return view
        try:
            opened = self._open(tenant, session_id, state)
        except ChatKVError:  # deleted since, or never this tenant's: start without it
            return view._replace(remembered=None)
        return overlay(view, opened)._replace(session_picker=self._labels.picker(tenant, session_id))

    def _tenant(self, state: ViewState) -> Tenant | View:
        """The tab's tenant, its API key checked again (it may have been rotated or deleted, or the
        tenant deleted, since sign-in); else the view to answer with (signed out, or "sign in first")."""
        if state.tenant is None:
            return make_view(state, error_line=error_html("sign in first"))
        if self.local:
            return state.tenant
        try:
            tenant = self.manager.tenant_for_api_key(state.api_key or "")
        except TenantNotFound:
            return self._signed_out(message=error_html(UNKNOWN_KEY_MESSAGE))
        if tenant.id != state.tenant.id:  # a key names its tenant; never another one
            return self._signed_out(message=error_html(UNKNOWN_KEY_MESSAGE))
        return tenant

    # -- sessions ------------------------------------------------------------------------------

    def refresh_sessions(self, state: ViewState) -> View:
        tenant = self._tenant(state)
        if isinstance(tenant, View):
            return tenant
        try:
            return make_view(state, session_picker=self._labels.picker(tenant, state.session_id), error_line="")
        except ChatKVError as exc:
            return make_view(state, error_line=error_html(str(exc)))

    def select_session(self, session_id: str | None, state: ViewState) -> View:
        """Open one of the tenant's sessions and show its history. The session already open (or
        none while none is open) changes nothing: the picker sends its value on every blur too
        (Gradio's dropdown fires `input` when it loses focus), and a reload then would put away a
        delete question asked by the click that took the focus, redraw a reply streaming in this
        tab, or write back a state that a New session or Sign out click has changed meanwhile."""
        tenant = self._tenant(state)
        if isinstance(tenant, View):
            return tenant
        if (session_id or None) == state.session_id:  # the open one, or none while none is open
            return unchanged_view()
        if not session_id:
            return make_view(
                replace(state, session_id=None, shown=(), stats_rows=()),
                chatbot=[],
                session_info="",
                reply_note="",
                remembered=None,
            )
        try:
            return self._open(tenant, session_id, state)
        except ChatKVError as exc:
            return make_view(state, error_line=error_html(str(exc)))

    def _open(self, tenant: Tenant, session_id: str, state: ViewState) -> View:
        """The view of `state` with the tenant's session `session_id` open (raises `ChatKVError`)."""
        info = self.manager.session_info(tenant, session_id)
        if self.prefetcher is not None and info.tier in ("host", "disk"):
            self.prefetcher.start(tenant, info.id)  # its next message finds the cache warm
        history = self.manager.history(tenant, session_id)
        shown = tuple((m.role, m.text) for m in history if m.role in ("user", "assistant"))
        state = replace(state, session_id=info.id, shown=shown, stats_rows=(), deleting=None)
        note = note_html(
            "Turn stats cover the turns you send in this page visit; earlier turns were not measured here."
        )
        return make_view(
            state,
            session_info=session_info_html(info),
            chatbot=chat_messages(shown),
            stats_line=note if shown else "",
            stats_table=[],
            error_line="",
            reply_note="",
            remembered=remembered_value(tenant, info.id),
            **DELETE_HIDDEN,
        )

    def new_session(self, title: str, system_prompt: str, state: ViewState) -> View:
        """Start a session (empty title / system prompt: none) and switch to it."""
        tenant = self._tenant(state)
        if isinstance(tenant, View):
            return tenant
        try:
            session_id = self.manager.open_session(
                tenant, system_prompt=system_prompt.strip() or None, title=title.strip() or None
            )
            info = self.manager.session_info(tenant, session_id)
            picker = self._labels.picker(tenant, session_id)
        except ChatKVError as exc:
            return make_view(state, error_line=error_html(str(exc)))
        return make_view(
            replace(state, session_id=session_id, shown=(), stats_rows=(), deleting=None),
            session_picker=picker,
            session_info=session_info_html(info),
            chatbot=[],
            stats_line="",
            stats_table=[],
            error_line="",
            reply_note="",
            remembered=remembered_value(tenant, session_id),
            **DELETE_HIDDEN,
        )

    def leave_session(self, state: ViewState) -> View:
        """The chat's clear button: close the session on screen (it stays stored and listed); the
        next message starts a new one."""
        tenant = self._tenant(state)
        if isinstance(tenant, View):
            return tenant
        note = "New conversation: your next message starts a new session."
        if state.session_id is not None:
            note += " The previous one is kept in the Session list."
        return no_session_view(state, html.escape(note))

    def ask_delete(self, state: ViewState) -> View:
        """The Delete button: ask whether to delete the open session (`SessionDeletion.ask`)."""
        tenant = self._tenant(state)
        return tenant if isinstance(tenant, View) else self._deletion.ask(tenant, state)

    def confirm_delete(self, state: ViewState) -> View:
        """The question's Delete: delete the session it names (`SessionDeletion.confirm`)."""
        tenant = self._tenant(state)
        return tenant if isinstance(tenant, View) else self._deletion.confirm(tenant, state)

    def cancel_delete(self, state: ViewState) -> View:
        """The question's Cancel: nothing is deleted."""
        return self._deletion.cancel(state)

    # -- turns ---------------------------------------------------------------------------------

    def send(
        self, message: str, max_new_tokens: float, temperature: float, state: ViewState
    ) -> Generator[View, None, None]:
        """Stream one turn: the reply grows on screen, then the turn's stats appear. Without an open
        session a new untitled one is started (and deleted again if the turn fails or is stopped).
        The message box and Send are disabled and Stop is shown while the reply streams. An error
        restores the message box and shows one line; so does Stop, with `STOPPED_NOTE`. A reply cut
        at `max_new_tokens` gets a note saying so. The turn runs in a worker thread: it completes
        (and is stored) even if this generator is closed because the tab went away.

        Args:
            max_new_tokens: most tokens of the reply (a slider's float).
            temperature: 0 for greedy decoding.
        """
        text = message or ""
        tenant = self._tenant(state)
        if isinstance(tenant, View):
            yield tenant
            return
        if not text.strip():
            yield make_view(state, error_line=error_html("type a message first"))
            return
        try:
            options = slider_options(max_new_tokens, temperature)
        except InvalidInput as exc:
            yield make_view(state, error_line=error_html(str(exc)))
            return
        new = state.session_id is None
        target = TurnTarget(new_session=True) if new else TurnTarget(session=state.session_id)
        # Started before the first yield: if the tab goes away right after sending, the turn still runs.
        turn = self._turns.start(Turn(self.manager, tenant, target, text, options))
        opening: dict[str, Any] = {}
        if new and turn.session_id is not None:  # made for the turn; `None`: refused before, `_stream` says why
            opening = self._session_shown(tenant, turn.session_id) | {
                "remembered": remembered_value(tenant, turn.session_id)
            }
        before = state
        yield from self._stream(
            turn,
            tenant,
            replace(state, session_id=turn.session_id),
            STOPPED_NOTE,
            lambda **notes: self._undone(before, tenant, text, turn.made, **notes),
            message=input_update(False, value=""),
            **opening,
        )

    def _stream(
        self,
        turn: Turn,
        tenant: Tenant,
        state: ViewState,
        stopped_note: str,
        undo: Callable[..., View],
        **opening: Any,
    ) -> Generator[View, None, None]:
        """The views of a started `turn` on `state`'s session: the user's message with the input
        disabled and Stop shown (`opening` adds to that view), the reply as it grows, then the
        stored turn with its stats, or `undo(error_line=..., reply_note=...)`: the tab as it was
        before the turn, for a turn that failed or was stopped (`stopped_note`)."""
        shown = (*state.shown, ("user", turn.text))
        streaming = {
            "chatbot": chat_messages(shown),
            "message": input_update(False),
            "send_button": input_update(False),
            "error_line": "",
            "stop_button": stop_button_update(True),
            "reply_note": "",
        }
        yield make_view(state, **(streaming | opening))
        for partial in turn.partial_replies():
            yield make_view(state, chatbot=chat_messages((*shown, ("assistant", partial))))
        if turn.stopped:
            yield undo(error_line="", reply_note=note_html(stopped_note, kind="stopped"))
        elif turn.reply is None:
            yield undo(error_line=error_html(failure_message(turn.failure)))
        else:  # a stored turn had its session
            yield self._after_turn(state, tenant, str(turn.session_id), turn.text, turn.reply)

    def stop(self, state: ViewState) -> dict[str, Any]:
        """The Stop button: cancel the reply streaming in this tab's session. The turn's `send`
        then ends with `STOPPED_NOTE` once the session is free (a regenerate or an edit with
        `FORK_STOPPED_NOTE`, its fork deleted); nothing of the turn is stored.
        Returns the Stop button's update: disabled, its visibility left to `send` (which hides it;
        if that update lands first, showing it again here would leave a dead button). Its only
        output: the tab's state is `send`'s to change."""
        tenant = self._tenant(state)
        if not isinstance(tenant, View) and state.session_id is not None:
            turn = self._turns.find(str(tenant.id), str(state.session_id))
            if turn is not None:
                turn.stop()
        return gr.update(interactive=False)

    def wait_for_turns(self, timeout_s: float) -> bool:
        """Wait until the turns in flight (of any tab, also of tabs that went away) are stored;
        `False` if some are still running after `timeout_s`. The server calls it before closing
        the manager."""
        return self._turns.wait(timeout_s)

    # -- forks: regenerate and edit (`app.ui.forks`) ---------------------------------------------

    def regenerate(self, max_new_tokens: float, temperature: float, state: ViewState) -> Generator[View, None, None]:
        """The chat's retry button on the last reply: a fork of the open session keeping every turn
        but the last, where the last user message runs again, streamed like a send. The fork
        becomes the open session; the original stays as it was, in the picker. At Temperature 0
        a fork whose turn equals one stored already is not kept (`app.ui.forks.same_turn`).
        Refusals are one line; a failed or stopped regeneration deletes the fork and opens the
        original again."""
        tenant = self._tenant(state)
        if isinstance(tenant, View):
            yield tenant
            return
        point = regenerate_point(state.shown)
        if isinstance(point, str):
            yield self._refused(state, point)
            return
        yield from self._fork_turn(tenant, state, point, max_new_tokens, temperature)

    def edit(
        self, event: gr.EditData, max_new_tokens: float, temperature: float, state: ViewState
    ) -> Generator[View, None, None]:
        """The chat's edit of a message (Gradio passes `event`: its index on screen, its new
        text): `edit_message`."""
        index = event.index if isinstance(event.index, int) else -1
        text = event.value if isinstance(event.value, str) else ""
        yield from self.edit_message(index, text, max_new_tokens, temperature, state)

    def edit_message(
        self, index: int, text: str, max_new_tokens: float, temperature: float, state: ViewState
    ) -> Generator[View, None, None]:
        """Edit the user message at `index` of the messages on screen to `text`: a fork of the open
        session keeping the turns before it, where `text` runs as that turn's message, streamed
        like a send. The fork becomes the open session; the original stays, in the picker. Refused
        with one line and nothing stored: an empty text, a reply (the page offers only user
        messages), a turn in flight on the session."""
        tenant = self._tenant(state)
        if isinstance(tenant, View):
            yield tenant
            return
        point = edit_point(state.shown, index, text)
        if isinstance(point, str):
            yield self._refused(state, point)
            return
        yield from self._fork_turn(tenant, state, point, max_new_tokens, temperature)

    def _fork_turn(
        self, tenant: Tenant, state: ViewState, point: ForkPoint, max_new_tokens: float, temperature: float
    ) -> Generator[View, None, None]:
        """Fork the open session at `point` and stream its turn there (see `regenerate`)."""
        parent = state.session_id
        if parent is None:  # nothing on screen: the fork points above refuse first
            yield self._refused(state, NO_SUCH_MESSAGE)
            return
        if self._turns.find(str(tenant.id), parent) is not None:
            # The streaming turn redraws the chat: the edit shown by the browser goes with it.
            yield make_view(state, error_line=error_html(f"session {parent} has a turn in flight; wait for its reply"))
            return
        try:
            options = slider_options(max_new_tokens, temperature)
        except ChatKVError as exc:
            yield self._refused(state, str(exc))
            return
        turn = self._turns.start(
            Turn(self.manager, tenant, TurnTarget(session=parent, fork_turns=point.turns), point.text, options)
        )
        if turn.session_id is None:  # refused before its fork was made (the session deleted meanwhile)
            yield from self._refusal(turn, state)
            return
        fork = turn.session_id
        views = self._stream(
            turn,
            tenant,
            replace(state, session_id=fork, shown=point.shown, stats_rows=()),
            FORK_STOPPED_NOTE,
            lambda **notes: self._reopened(state, tenant, **notes),
            remembered=remembered_value(tenant, fork),
            **self._session_shown(tenant, fork),
        )
        for view in views:
            stored = len(view.state.shown) == len(point.shown) + 2  # the last view, of the stored turn
            if stored and options.sampling.greedy and turn.reply is not None:
                view = self._kept_or_same(view, tenant, state, point, turn.reply.text)
            yield view

    def _kept_or_same(self, view: View, tenant: Tenant, state: ViewState, point: ForkPoint, reply: str) -> View:
        """`view` (the fork after its stored turn), unless the same turn is stored already
        (`same_turn`): then the fork is deleted and that session opens, with a note saying why."""
        parent, fork = str(state.session_id), str(view.state.session_id)
        try:
            same = same_turn(self.manager, tenant, parent, fork, point, reply)
            if same is not None:
                self.manager.delete_session(tenant, fork)
        except ChatKVError:  # nothing to compare with, or the fork not deleted: it stays
            return view
        if same is None:
            return view
        if same == parent:
            return self._reopened(state, tenant, error_line="", reply_note=note_html(SAME_REPLY_NOTE, kind="same"))
        try:
            opened = self._open(tenant, same, state)
        except ChatKVError as exc:  # deleted just now (another tab): the original is left
            return self._reopened(state, tenant, error_line=error_html(str(exc)))
        return opened._replace(
            message=input_update(True),
            send_button=input_update(True),
            stop_button=stop_button_update(False),
            reply_note=note_html(SAME_FORK_NOTE, kind="same"),
            **self._session_shown(tenant, same),
        )

    def _refusal(self, turn: Turn, state: ViewState) -> Generator[View, None, None]:
        """The tab as it is with the line of a turn that failed before it had a session."""
        for _ in turn.partial_replies():  # none come: it failed
            pass
        yield self._refused(state, failure_message(turn.failure))

    def _refused(self, state: ViewState, message: str) -> View:
        """The tab as it is with one error line; the chat redrawn, undoing an edit the browser shows."""
        return make_view(state, chatbot=chat_messages(state.shown), error_line=error_html(message))

    def _reopened(self, state: ViewState, tenant: Tenant, **notes: Any) -> View:
        """The tab as it was before a fork's turn (`state`, the original open) after the turn
        stored nothing and its fork was deleted. `notes`: the error line and reply note."""
        return make_view(
            state,
            chatbot=chat_messages(state.shown),
            message=input_update(True),
            send_button=input_update(True),
            stop_button=stop_button_update(False),
            remembered=remembered_value(tenant, state.session_id),
            **self._session_shown(tenant, state.session_id),
            **notes,
        )

    def _session_shown(self, tenant: Tenant, session_id: str | None) -> dict[str, Any]:
        """The picker with `session_id` chosen and its session line; nothing when they cannot be
        read now (the session deleted meanwhile: the turn's end says so)."""
        if session_id is None:
            return {}
        try:
            info = self.manager.session_info(tenant, session_id)
            return {"session_picker": self._labels.picker(tenant, session_id), "session_info": session_info_html(info)}
        except ChatKVError:
            return {}

    def _undone(self, state: ViewState, tenant: Tenant, text: str, made: bool, **notes: Any) -> View:
        """The tab as it was before the send (`state`), the message back in the box to edit or send
        again: a failed or stopped turn stores nothing. `notes`: the error line and reply note."""
        view = make_view(
            state,
            chatbot=chat_messages(state.shown),
            message=input_update(True, value=text),
            send_button=input_update(True),
            stop_button=stop_button_update(False),
            **notes,
        )
        if made:  # the session made for the turn went with it
            view = view._replace(remembered=remembered_value(tenant, state.session_id))
            with contextlib.suppress(ChatKVError):
                view = view._replace(session_picker=self._labels.picker(tenant, None))
        return view

    def _after_turn(self, state: ViewState, tenant: Tenant, session_id: str, text: str, reply: Reply) -> View:
        shown = (*state.shown, ("user", text), ("assistant", reply.text))
        turn = sum(1 for role, _ in shown if role == "user")
        row = stats_row(turn, reply.stats)
        state = replace(state, shown=shown, stats_rows=(*state.stats_rows, row))
        view = make_view(
            state,
            chatbot=chat_messages(shown),
            message=input_update(True),
            send_button=input_update(True),
            stats_line=stats_html(turn, reply.stats),
            stats_table=[list(r) for r in state.stats_rows],
            stop_button=stop_button_update(False),
            reply_note=length_note(reply) if reply.finish_reason == "length" else "",
        )
        try:
            info = self.manager.session_info(tenant, session_id)
            return view._replace(
                session_info=session_info_html(info), session_picker=self._labels.picker(tenant, session_id)
            )
        except ChatKVError as exc:  # e.g. the session was deleted by an operator just now
            return view._replace(error_line=error_html(str(exc)))


def local_tenant(manager: SessionManager) -> Tenant:
    """The `local` tenant of single-tenant mode, created on first use."""
    try:
        return manager.get_tenant(LOCAL_TENANT)
    except TenantNotFound:
        pass
    try:
        return manager.create_tenant(LOCAL_TENANT)
    except TenantExists:  # another tab created it at the same moment
        return manager.get_tenant(LOCAL_TENANT)
