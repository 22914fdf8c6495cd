"""The Gradio chat UI: sign in with a tenant API key (or run as the single `local` tenant), pick or
start a session, chat with streaming output, and see what each turn cost (TTFT, tokens prefilled
vs reused, where the cache came from, decode speed).

Every page action is a `SessionManager` call made with the tenant of this browser tab. The tenant
and the API key it signed in with live in a `gr.State`, which Gradio keeps server-side per tab (a
client cannot set it); a module global here would show one tenant's sessions on another tenant's
page. The key is checked again on every event that touches the tenant's data, so rotating or
deleting a tenant's key (or the tenant) signs out the tabs that use it.

A turn runs to completion in a worker thread whether or not its tab is still there: reloading or
closing the page mid-reply still stores the message and the whole reply. The Stop button is the
one way to cancel a reply: the worker closes its `stream_chat` stream, which cancels the turn at the
engine's next step and stores nothing, so the partial reply is discarded (the note under the chat
says so) and the session takes the next message at once.

The open session is remembered in the browser (`gr.BrowserState`, the browser's local storage), so
a page reload opens it again once the same tenant is signed in.

The event handlers are methods of `ChatUI` and return a `View` (one field per output component), so
tests call them directly without a browser.
"""

from __future__ import annotations

import contextlib
import html
import logging
import math
import queue
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple

import gradio as gr

from sessions.errors import ChatKVError, InvalidInput, TenantExists, TenantNotFound
from sessions.records import Reply, SessionInfo, Tenant, TurnStats

if TYPE_CHECKING:
    from app.prefetch import Prefetcher
    from sessions.manager import SessionManager

log = logging.getLogger(__name__)

LOCAL_TENANT = "local"
UNKNOWN_KEY_MESSAGE = "unknown API key"
"""The one answer to a wrong key and to a key of an unknown tenant (they must look the same)."""
EMPTY_KEY_MESSAGE = "enter an API key"
CHAT_CONCURRENCY = 16
"""Turns streamed at once across all tabs; the engine loop batches them into each forward pass."""
LABEL_CHARS = 40
"""Longest name of a session in the picker (its title, or its first message), in characters;
longer ones end with an ellipsis. The label adds when it was last active (`· 5 min ago`)."""
STOPPED_NOTE = (
    "Stopped. The partial reply was discarded and nothing was stored for this turn; your message is back in the box."
)
"""Shown under the chat after Stop: the manager stores nothing for a cancelled turn."""
REMEMBERED_KEY = "chatkv-open-session"
"""Local-storage key of the open session (`{"tenant": id, "session": id}`). Not a secret: a
remembered session opens only for its own tenant, whose key the tab signed in with."""
CLEAR_LABEL = "New conversation (this one stays in the Session list)"
"""Tooltip of the chat's clear button, which leaves the session on screen without deleting it."""
STATS_HEADERS = [
    "turn",
    "TTFT (ms)",
    "prefilled tokens",
    "reused tokens",
    "cache from",
    "restore (ms)",
    "decode tokens/s",
    "context tokens",
]
STATS_TABLE_LABEL = "Turns sent in this page visit"
UI_CSS = """
#turn-stats .chatkv-stats { font-size: 0.9em; opacity: 0.85; padding: 2px 4px; }
#turn-stats b { font-variant-numeric: tabular-nums; }
.chatkv-error { color: #b91c1c; font-weight: 600; padding: 2px 4px; }
.chatkv-note { font-size: 0.9em; padding: 2px 4px; color: #92400e; }
#session-info { font-size: 0.85em; opacity: 0.8; }
"""
"""Passed to `gr.mount_gradio_app` (Gradio 6 takes CSS at mount/launch, not in `gr.Blocks`)."""
UI_TRANSLATIONS = {"en": {"chatbot.clear": CLEAR_LABEL}}
"""Passed to `gr.mount_gradio_app` as `gr.I18n(**UI_TRANSLATIONS)`: the clear button's tooltip."""

Shown = tuple[tuple[str, str], ...]
"""Messages on screen as `(role, text)` pairs, roles `user` / `assistant`."""
StatsRow = tuple[int, float, int, int, str, float | None, float | None, int]
_SOURCE_NAMES = {"device": "device", "host": "host memory", "disk": "disk"}
_MAX_LABELS = 10_000


@dataclass(frozen=True)
class ViewState:
    """What one browser tab holds (in a `gr.State`): its tenant and the API key it signed in with
    (checked again on every event; `None` in local mode), the open session, the messages on screen
    and the stats of the turns run in this tab."""

    tenant: Tenant | None = None
    session_id: str | None = None
    shown: Shown = ()
    stats_rows: tuple[StatsRow, ...] = ()
    api_key: str | None = field(default=None, repr=False)


class View(NamedTuple):
    """One value per output component, in the order of `build_ui`'s outputs. `gr.update()` keeps
    a component as it is."""

    state: ViewState
    login_panel: Any
    main_panel: Any
    login_message: Any
    api_key: Any
    tenant_line: Any
    session_picker: Any
    session_info: Any
    chatbot: Any
    message: Any
    send_button: Any
    stats_line: Any
    stats_table: Any
    error_line: Any
    stop_button: Any
    reply_note: Any
    remembered: Any
    """The open session as stored in the browser (`_remembered`), for the next page load."""


def _view(state: ViewState, **changes: Any) -> View:
    values: dict[str, Any] = {name: gr.update() for name in View._fields}
    values.update(changes, state=state)
    return View(**values)


def _input(enabled: bool, **value: Any) -> dict[str, Any]:
    """The message box or the Send button: usable or not (while a reply streams)."""
    return gr.update(interactive=enabled, **value)


class _Turn:
    """One turn run to completion in a worker thread; its reply pieces, then the `Reply` (or the
    exception it failed with), then `_Turn.END`, arrive on `items`. Nobody has to read them: the
    turn is stored when it completes even if its tab went away. `stop()` (the Stop button) is what
    ends it early: then `stopped` is set and no `Reply` comes.

    A first turn of a session started for it (`delete_on_failure`) that fails or is stopped deletes
    that session again, so failed sends do not leave empty sessions behind.
    """

    END = object()

    def __init__(
        self,
        manager: SessionManager,
        tenant: Tenant,
        session_id: str,
        text: str,
        *,
        max_new_tokens: int,
        temperature: float,
        delete_on_failure: bool,
    ) -> None:
        self.manager = manager
        self.tenant = tenant
        self.session_id = session_id
        self.text = text
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.delete_on_failure = delete_on_failure
        self.items: queue.Queue[object] = queue.Queue()
        self.session_deleted = False
        self.stopped = False
        self._stop = threading.Event()

    def stop(self) -> None:
        """Ask the worker to cancel the turn: it closes the stream when the next piece arrives (one
        per engine step while the reply decodes; a turn still queued or prefilling stops at its
        first token), unless the reply is complete and stored by then."""
        self._stop.set()

    def run(self) -> None:
        """Run the turn to its end, queueing what it yields (the worker thread's body). `END` is
        queued only once the stream is closed, so a stopped turn's session is free by then."""
        stream = self.manager.stream_chat(
            self.tenant,
            self.session_id,
            self.text,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
        )
        try:
            # Closing the stream cancels the turn at the engine's next step; nothing is stored.
            with contextlib.closing(stream):
                for item in stream:
                    if self._stop.is_set() and not isinstance(item, Reply):  # a Reply is stored already
                        self.stopped = True
                        break
                    self.items.put(item)
            if self.stopped and self.delete_on_failure:
                self._delete_empty_session()
        # A thread boundary: whatever the turn raises must reach the tab's generator, which is
        # waiting on this queue (a ChatKVError is shown to the user, anything else is logged too).
        except Exception as exc:
            if not isinstance(exc, ChatKVError):
                log.exception("turn on session %s failed", self.session_id)
            if self.delete_on_failure:
                self._delete_empty_session()
            self.items.put(exc)
        finally:
            self.items.put(_Turn.END)

    def _delete_empty_session(self) -> None:
        with contextlib.suppress(ChatKVError):
            if not self.manager.history(self.tenant, self.session_id):
                self.manager.delete_session(self.tenant, self.session_id)
                self.session_deleted = True

    def next_items(self) -> list[object]:
        """Wait for the next item, then take every item already queued (a slow reader gets the
        pieces in batches instead of falling behind)."""
        items = [self.items.get()]
        with contextlib.suppress(queue.Empty):
            while items[-1] is not _Turn.END:
                items.append(self.items.get_nowait())
        return items


class ChatUI:
    """Event handlers of the chat page over one manager. Holds no tab's data (that is in
    `ViewState`): only the turns in flight and the first messages that label untitled sessions."""

    def __init__(self, manager: SessionManager, *, local: bool, prefetcher: Prefetcher | None = None) -> None:
        self.manager = manager
        self.local = local
        self.prefetcher = prefetcher
        """Restores a selected session's cache to the device before its next message (server only)."""
        self._turns: set[threading.Thread] = set()
        self._streaming: dict[tuple[str, str], _Turn] = {}
        """(tenant id, session id) -> the turn in flight on it (one at most: the session's lease)."""
        self._turns_lock = threading.Lock()
        self._first_messages: dict[tuple[str, str], str] = {}
        """(tenant id, session id) -> the session's first user message (it never changes)."""

    # -- signing in ----------------------------------------------------------------------------

    def on_load(self, state: ViewState, remembered: object = None) -> View:
        """Page opened: local mode signs in as the `local` tenant (created if missing) and opens the
        session this browser had open (`remembered`), if it is still there."""
        if not self.local:
            return self._signed_out()
        try:
            tenant = local_tenant(self.manager)
        except ChatKVError as exc:
            return _view(ViewState(), main_panel=gr.update(visible=True), error_line=_error_html(str(exc)))
        return self._signed_in(tenant, None, remembered)

    def login(self, api_key: str, state: ViewState, remembered: object = None) -> View:
        """Resolve a tenant API key; any wrong or unknown key gets `UNKNOWN_KEY_MESSAGE`. The
        session this browser had open is opened again if it is this tenant's."""
        key = (api_key or "").strip()
        if not key:
            return self._signed_out(message=_error_html(EMPTY_KEY_MESSAGE))
        try:
            tenant = self.manager.tenant_for_api_key(key)
        except TenantNotFound:
            return self._signed_out(message=_error_html(UNKNOWN_KEY_MESSAGE))
        return self._signed_in(tenant, key, remembered)

    def sign_out(self, state: ViewState) -> View:
        """Sign out and forget the open session in this browser."""
        return self._signed_out()._replace(remembered=None)

    def _signed_out(self, message: str = "") -> View:
        # Every tenant-derived component is cleared, so the next sign-in never sees this one's data.
        return _view(
            ViewState(),
            login_panel=gr.update(visible=True),
            main_panel=gr.update(visible=False),
            login_message=message,
            api_key="",
            tenant_line="",
            session_picker=gr.update(choices=[], value=None),
            session_info="",
            chatbot=[],
            message=_input(True, value=""),
            send_button=_input(True),
            stats_line="",
            stats_table=[],
            error_line="",
            stop_button=_stop_button(False),
            reply_note="",
        )

    def _signed_in(self, tenant: Tenant, api_key: str | None, remembered: object) -> View:
        state = ViewState(tenant=tenant, api_key=api_key)
        view = _view(
            state,
            login_panel=gr.update(visible=False),
            main_panel=gr.update(visible=True),
            login_message="",
            api_key="",
            tenant_line=f"Tenant <b>{html.escape(tenant.name)}</b> · model {html.escape(self.manager.model_name)}",
            session_picker=self._picker(tenant, None),
            session_info="",
            chatbot=[],
            message=_input(True, value=""),
            send_button=_input(True),
            stats_line="",
            stats_table=[],
            error_line="",
            stop_button=_stop_button(False),
            reply_note="",
        )
        session_id = _remembered_session(remembered, tenant)
        if session_id is None:
            return view
        try:
            opened = self._open(tenant, session_id, state)
        except ChatKVError:  # deleted since, or never this tenant's: start without it
            return view._replace(remembered=None)
        return _overlay(view, opened)._replace(session_picker=self._picker(tenant, session_id))

    def _tenant(self, state: ViewState) -> Tenant | View:
        """The tab's tenant, its API key checked again (it may have been rotated or deleted, or the
        tenant deleted, since sign-in); else the view to answer with (signed out, or "sign in first")."""
        if state.tenant is None:
            return _view(state, error_line=_error_html("sign in first"))
        if self.local:
            return state.tenant
        try:
            tenant = self.manager.tenant_for_api_key(state.api_key or "")
        except TenantNotFound:
            return self._signed_out(message=_error_html(UNKNOWN_KEY_MESSAGE))
        if tenant.id != state.tenant.id:  # a key names its tenant; never another one
            return self._signed_out(message=_error_html(UNKNOWN_KEY_MESSAGE))
        return tenant

    # -- sessions ------------------------------------------------------------------------------

    def refresh_sessions(self, state: ViewState) -> View:
        tenant = self._tenant(state)
        if isinstance(tenant, View):
            return tenant
        try:
            return _view(state, session_picker=self._picker(tenant, state.session_id), error_line="")
        except ChatKVError as exc:
            return _view(state, error_line=_error_html(str(exc)))

    def select_session(self, session_id: str | None, state: ViewState) -> View:
        """Open one of the tenant's sessions and show its history."""
        tenant = self._tenant(state)
        if isinstance(tenant, View):
            return tenant
        if not session_id:
            return _view(
                replace(state, session_id=None, shown=(), stats_rows=()),
                chatbot=[],
                session_info="",
                reply_note="",
                remembered=None,
            )
        try:
            return self._open(tenant, session_id, state)
        except ChatKVError as exc:
            return _view(state, error_line=_error_html(str(exc)))

    def _open(self, tenant: Tenant, session_id: str, state: ViewState) -> View:
        """The view of `state` with the tenant's session `session_id` open (raises `ChatKVError`)."""
        info = self.manager.session_info(tenant, session_id)
        if self.prefetcher is not None and info.tier in ("host", "disk"):
            self.prefetcher.start(tenant, info.id)  # its next message finds the cache warm
        history = self.manager.history(tenant, session_id)
        shown = tuple((m.role, m.text) for m in history if m.role in ("user", "assistant"))
        state = replace(state, session_id=info.id, shown=shown, stats_rows=())
        note = _note_html(
            "Turn stats cover the turns you send in this page visit; earlier turns were not measured here."
        )
        return _view(
            state,
            session_info=_session_info_html(info),
            chatbot=_chat(shown),
            stats_line=note if shown else "",
            stats_table=[],
            error_line="",
            reply_note="",
            remembered=_remembered(tenant, info.id),
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
            picker = self._picker(tenant, session_id)
        except ChatKVError as exc:
            return _view(state, error_line=_error_html(str(exc)))
        return _view(
            replace(state, session_id=session_id, shown=(), stats_rows=()),
            session_picker=picker,
            session_info=_session_info_html(info),
            chatbot=[],
            stats_line="",
            stats_table=[],
            error_line="",
            reply_note="",
            remembered=_remembered(tenant, session_id),
        )

    def leave_session(self, state: ViewState) -> View:
        """The chat's clear button: close the session on screen (it stays stored and listed); the
        next message starts a new one."""
        tenant = self._tenant(state)
        if isinstance(tenant, View):
            return tenant
        left = state.session_id is not None
        note = "New conversation: your next message starts a new session."
        if left:
            note += " The previous one is kept in the Session list."
        return _view(
            replace(state, session_id=None, shown=(), stats_rows=()),
            session_picker=gr.update(value=None),
            session_info=html.escape(note),
            chatbot=[],
            stats_line="",
            stats_table=[],
            error_line="",
            reply_note="",
            remembered=None,
        )

    def _picker(self, tenant: Tenant, selected: str | None) -> dict[str, Any]:
        choices = [(self._session_label(tenant, info), str(info.id)) for info in self.manager.list_sessions(tenant)]
        return gr.update(choices=choices, value=selected)

    def _session_label(self, tenant: Tenant, info: SessionInfo) -> str:
        """`name · 5 min ago`: the title, else the first message, else `(empty)`, shortened to
        `LABEL_CHARS` (with an ellipsis), and when the session was last active."""
        first = self._first_message(tenant, info) if info.message_count and not info.title else None
        name = _shorten(info.title or first or "(empty)", LABEL_CHARS)
        return f"{name} · {_ago(info.last_active_at, datetime.now(UTC))}"

    def _first_message(self, tenant: Tenant, info: SessionInfo) -> str | None:
        key = (str(tenant.id), str(info.id))
        first = self._first_messages.get(key)
        if first is None:
            try:
                history = self.manager.history(tenant, info.id)
            except ChatKVError:  # deleted since it was listed
                return None
            first = next((m.text for m in history if m.role == "user"), None)
            if first is not None:
                if len(self._first_messages) >= _MAX_LABELS:
                    self._first_messages.clear()
                self._first_messages[key] = first
        return first

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
            yield _view(state, error_line=_error_html("type a message first"))
            return
        try:
            max_tokens, temperature = _slider_values(max_new_tokens, temperature)
        except InvalidInput as exc:
            yield _view(state, error_line=_error_html(str(exc)))
            return
        session_id = state.session_id
        created = session_id is None
        try:
            if session_id is None:
                session_id = self.manager.open_session(tenant)
            picker = self._picker(tenant, session_id) if created else gr.update()
        except ChatKVError as exc:
            yield _view(state, error_line=_error_html(str(exc)))
            return
        # Started before the first yield: if the tab goes away right after sending, the turn still runs.
        turn = self._start_turn(
            _Turn(
                self.manager,
                tenant,
                session_id,
                text,
                max_new_tokens=max_tokens,
                temperature=temperature,
                delete_on_failure=created,
            )
        )
        before = state
        state = replace(state, session_id=session_id)
        shown = (*state.shown, ("user", text))
        yield _view(
            state,
            chatbot=_chat(shown),
            message=_input(False, value=""),
            send_button=_input(False),
            session_picker=picker,
            error_line="",
            stop_button=_stop_button(True),
            reply_note="",
            remembered=_remembered(tenant, session_id) if created else gr.update(),
        )
        pieces: list[str] = []
        reply: Reply | None = None
        failure: Exception | None = None
        done = False
        while not done:
            streamed = len(pieces)
            for item in turn.next_items():
                if item is _Turn.END:
                    done = True
                elif isinstance(item, Reply):
                    reply = item
                elif isinstance(item, Exception):
                    failure = item
                elif isinstance(item, str):
                    pieces.append(item)
            if not done and len(pieces) > streamed:
                yield _view(state, chatbot=_chat((*shown, ("assistant", "".join(pieces)))))
        if turn.stopped:
            note = _note_html(STOPPED_NOTE, kind="stopped")
            yield self._undone(before, tenant, text, turn.session_deleted, error_line="", reply_note=note)
        elif reply is None:
            yield self._failed_turn(before, tenant, text, failure, turn.session_deleted)
        else:
            yield self._after_turn(state, tenant, session_id, text, reply)

    def stop(self, state: ViewState) -> dict[str, Any]:
        """The Stop button: cancel the reply streaming in this tab's session. The turn's `send`
        then ends with `STOPPED_NOTE` once the session is free; nothing of the turn is stored.
        Returns the Stop button's update (disabled until `send` hides it). Its only output: the
        tab's state is `send`'s to change."""
        tenant = self._tenant(state)
        if not isinstance(tenant, View) and state.session_id is not None:
            with self._turns_lock:
                turn = self._streaming.get((str(tenant.id), str(state.session_id)))
            if turn is not None:
                turn.stop()
        return _stop_button(True, interactive=False)

    def _start_turn(self, turn: _Turn) -> _Turn:
        """Run `turn` in a worker thread, tracked until it ends (see `wait_for_turns`)."""

        key = (str(turn.tenant.id), str(turn.session_id))

        def work() -> None:
            try:
                turn.run()
            finally:
                with self._turns_lock:
                    self._turns.discard(thread)
                    if self._streaming.get(key) is turn:
                        del self._streaming[key]

        thread = threading.Thread(target=work, name=f"chatkv-turn-{turn.session_id}", daemon=True)
        with self._turns_lock:
            self._turns.add(thread)
            self._streaming[key] = turn
        thread.start()
        return turn

    def wait_for_turns(self, timeout_s: float) -> bool:
        """Wait until the turns in flight (of any tab, also of tabs that went away) are stored;
        `False` if some are still running after `timeout_s`. The server calls it before closing
        the manager."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._turns_lock:
                running = list(self._turns)
            if not running:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            running[0].join(remaining)

    def _failed_turn(
        self, state: ViewState, tenant: Tenant, text: str, failure: Exception | None, session_deleted: bool
    ) -> View:
        if isinstance(failure, ChatKVError):
            message = str(failure)
        else:  # a bug, logged by the worker with its traceback
            message = "the turn failed (internal error, see the server log); nothing was stored"
        return self._undone(state, tenant, text, session_deleted, error_line=_error_html(message))

    def _undone(self, state: ViewState, tenant: Tenant, text: str, session_deleted: bool, **notes: Any) -> View:
        """The tab as it was before the send (`state`), the message back in the box to edit or send
        again: a failed or stopped turn stores nothing. `notes`: the error line and reply note."""
        view = _view(
            state,
            chatbot=_chat(state.shown),
            message=_input(True, value=text),
            send_button=_input(True),
            stop_button=_stop_button(False),
            **notes,
        )
        if session_deleted:
            view = view._replace(remembered=_remembered(tenant, state.session_id))
            with contextlib.suppress(ChatKVError):
                view = view._replace(session_picker=self._picker(tenant, None))
        return view

    def _after_turn(self, state: ViewState, tenant: Tenant, session_id: str, text: str, reply: Reply) -> View:
        shown = (*state.shown, ("user", text), ("assistant", reply.text))
        turn = sum(1 for role, _ in shown if role == "user")
        row = _stats_row(turn, reply.stats)
        state = replace(state, shown=shown, stats_rows=(*state.stats_rows, row))
        view = _view(
            state,
            chatbot=_chat(shown),
            message=_input(True),
            send_button=_input(True),
            stats_line=_stats_html(turn, reply.stats),
            stats_table=[list(r) for r in state.stats_rows],
            stop_button=_stop_button(False),
            reply_note=_length_note(reply) if reply.finish_reason == "length" else "",
        )
        try:
            info = self.manager.session_info(tenant, session_id)
            return view._replace(session_info=_session_info_html(info), session_picker=self._picker(tenant, session_id))
        except ChatKVError as exc:  # e.g. the session was deleted by an operator just now
            return view._replace(error_line=_error_html(str(exc)))


def build_ui(manager: SessionManager, *, local: bool, chat_ui: ChatUI | None = None) -> gr.Blocks:
    """The chat page over `manager`. `local`: single-tenant mode as the `local` tenant, no API key.
    `chat_ui`: the handlers to use (default: new ones; the server keeps them to wait for turns in
    flight at shutdown).

    Stable element ids (for users' CSS and for tests): `api-key`, `login`, `login-message`,
    `tenant-line`, `session-picker`, `refresh-sessions`, `new-title`, `new-system-prompt`,
    `new-session`, `max-new-tokens`, `temperature`, `sign-out`, `session-info`, `chat`,
    `reply-note` (a note about the last reply: `[data-note=stopped]` after Stop, `[data-note=length]`
    when it reached Max new tokens), `message`, `send`, `stop` (shown while a reply streams),
    `chat-error`, `turn-stats` (figures in `[data-stat=...]`: `turn`, `ttft_ms`,
    `prefill_tokens`, `reused_tokens`, `restored_from` (its `data-value` is the `TurnStats` value:
    new, device, host, disk or rebuilt), `restore_ms` (only for host and disk),
    `decode_tokens_per_s`, `context_tokens`) and `stats-table`.
    """
    ui = chat_ui or ChatUI(manager, local=local)
    max_tokens_limit = max(1, min(2048, manager.context_budget_tokens // 2))
    with gr.Blocks(title="chatkv", analytics_enabled=False) as blocks:
        state = gr.State(ViewState())
        # Encrypted with a fixed secret so it survives server restarts; it hides nothing from the
        # browser's user (who may see their own session id), and a value from any other tenant is ignored.
        remembered = gr.BrowserState(None, storage_key=REMEMBERED_KEY, secret=REMEMBERED_KEY)
        gr.Markdown("## chatkv")
        with gr.Column(visible=not local, elem_id="login-panel") as login_panel:
            api_key = gr.Textbox(label="Tenant API key", type="password", elem_id="api-key", placeholder="ckv_...")
            login = gr.Button("Sign in", variant="primary", elem_id="login")
            login_message = gr.HTML(elem_id="login-message")
        with gr.Row(visible=False, elem_id="main-panel") as main_panel:
            with gr.Column(scale=1, min_width=280):
                tenant_line = gr.HTML(elem_id="tenant-line")
                session_picker = gr.Dropdown(
                    label="Session", choices=[], value=None, interactive=True, elem_id="session-picker"
                )
                refresh = gr.Button("Refresh list", size="sm", elem_id="refresh-sessions")
                with gr.Accordion("New session", open=False):
                    title = gr.Textbox(label="Title (optional)", elem_id="new-title")
                    system_prompt = gr.Textbox(label="System prompt (optional)", lines=3, elem_id="new-system-prompt")
                    new = gr.Button("New session", elem_id="new-session")
                max_new_tokens = gr.Slider(
                    1,
                    max_tokens_limit,
                    value=min(256, max_tokens_limit),
                    step=1,
                    label="Max new tokens",
                    elem_id="max-new-tokens",
                )
                temperature = gr.Slider(
                    0.0, 1.5, value=0.0, step=0.05, label="Temperature (0: greedy)", elem_id="temperature"
                )
                sign_out = gr.Button("Sign out", size="sm", visible=not local, elem_id="sign-out")
            with gr.Column(scale=3):
                session_info = gr.HTML(elem_id="session-info")
                chatbot = gr.Chatbot(
                    label="Conversation",
                    show_label=False,
                    height=460,
                    elem_id="chat",
                    feedback_options=None,
                    buttons=["copy", "copy_all"],
                    placeholder=(
                        "Pick a session or just type: a new session starts with your first message. "
                        "The clear button starts a new conversation; it deletes nothing. "
                        "Stop cancels a reply and discards it."
                    ),
                )
                reply_note = gr.HTML(elem_id="reply-note")
                with gr.Row():
                    message = gr.Textbox(
                        label="Message", placeholder="Type a message, Enter to send", scale=5, elem_id="message"
                    )
                    send = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="send")
                    stop = gr.Button("Stop", variant="stop", scale=1, min_width=80, visible=False, elem_id="stop")
                error_line = gr.HTML(elem_id="chat-error")
                stats_line = gr.HTML(elem_id="turn-stats")
                with gr.Accordion("Turn stats", open=False):
                    stats_table = gr.Dataframe(
                        headers=STATS_HEADERS,
                        value=[],
                        interactive=False,
                        label=STATS_TABLE_LABEL,
                        show_label=True,
                        elem_id="stats-table",
                    )
        components = {
            "state": state, "login_panel": login_panel, "main_panel": main_panel, "login_message": login_message,
            "api_key": api_key, "tenant_line": tenant_line, "session_picker": session_picker,
            "session_info": session_info, "chatbot": chatbot, "message": message, "send_button": send,
            "stats_line": stats_line, "stats_table": stats_table, "error_line": error_line,
            "stop_button": stop, "reply_note": reply_note, "remembered": remembered,
        }  # fmt: skip
        outputs = [components[name] for name in View._fields]
        quick: dict[str, Any] = {"outputs": outputs, "api_visibility": "private", "show_progress": "hidden"}
        blocks.load(ui.on_load, inputs=[state, remembered], **quick)
        gr.on([login.click, api_key.submit], ui.login, inputs=[api_key, state, remembered], **quick)
        sign_out.click(ui.sign_out, inputs=[state], **quick)
        refresh.click(ui.refresh_sessions, inputs=[state], **quick)
        # `.input`, not `.change`: a handler setting the picker's value must not reload the history.
        session_picker.input(ui.select_session, inputs=[session_picker, state], **quick)
        chatbot.clear(ui.leave_session, inputs=[state], **quick)
        new.click(ui.new_session, inputs=[title, system_prompt, state], **quick)
        gr.on(
            [send.click, message.submit],
            ui.send,
            inputs=[message, max_new_tokens, temperature, state],
            outputs=outputs,
            api_visibility="private",
            show_progress="minimal",
            concurrency_limit=CHAT_CONCURRENCY,
            concurrency_id="chat",
        )
        # Not queued behind the chats; its only output is the button (the state is `send`'s).
        stop.click(ui.stop, inputs=[state], outputs=[stop], api_visibility="private", show_progress="hidden")
    blocks.queue(default_concurrency_limit=8)
    return blocks


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


def _slider_values(max_new_tokens: float, temperature: float) -> tuple[int, float]:
    """The sliders' values as `stream_chat` arguments (the manager checks their ranges). A client
    can send any JSON number, NaN and infinity included, which `int` cannot convert.

    Raises:
        InvalidInput: for a value that is not a finite number.
    """
    if not _finite(max_new_tokens):
        raise InvalidInput(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not _finite(temperature):
        raise InvalidInput(f"temperature must be a number >= 0, got {temperature!r}")
    return int(max_new_tokens), float(temperature)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# -- rendering -----------------------------------------------------------------------------------


def _chat(shown: Shown) -> list[dict[str, str]]:
    return [{"role": role, "content": text} for role, text in shown]


def _error_html(message: str) -> str:
    return f'<div class="chatkv-error" role="alert">{html.escape(message)}</div>'


def _note_html(message: str, kind: str | None = None) -> str:
    """A quiet line; with `kind` a note about the reply (`stopped`, `length`: its `data-note`)."""
    if kind is None:
        return f'<div class="chatkv-stats">{html.escape(message)}</div>'
    return f'<div class="chatkv-note" data-note="{kind}">{html.escape(message)}</div>'


def _length_note(reply: Reply) -> str:
    limit = len(reply.token_ids)
    return _note_html(
        f"The reply stopped at the {limit}-token limit (Max new tokens): raise it, or ask to continue.",
        kind="length",
    )


def _stop_button(visible: bool, *, interactive: bool = True) -> dict[str, Any]:
    """The Stop button: shown only while a reply streams."""
    return gr.update(visible=visible, interactive=interactive)


def _overlay(base: View, top: View) -> View:
    """`base` with every field that `top` changes (is not a bare `gr.update()`) taken from `top`."""
    return base._replace(**{name: value for name, value in top._asdict().items() if value != gr.update()})


def _remembered(tenant: Tenant, session_id: str | None) -> dict[str, str] | None:
    """What the browser keeps of the open session (`None`: none open)."""
    return None if session_id is None else {"tenant": str(tenant.id), "session": str(session_id)}


def _remembered_session(remembered: object, tenant: Tenant) -> str | None:
    """The session id the browser kept, if it was kept for `tenant` (the value comes from the
    browser: anything else is ignored)."""
    if not isinstance(remembered, dict) or remembered.get("tenant") != str(tenant.id):
        return None
    session_id = remembered.get("session")
    return session_id if isinstance(session_id, str) and session_id else None


def _ago(then: datetime, now: datetime) -> str:
    """How long ago `then` was, as a picker label says it: `just now`, `5 min ago`, `3 h ago`,
    `yesterday`, `4 days ago`, then the date (`Mar 5`, or `2024-03-05` in another year)."""
    seconds = (now - then).total_seconds()
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h ago"
    days = int(seconds // 86400)
    if days == 1:
        return "yesterday"
    if days < 7:
        return f"{days} days ago"
    return f"{then:%b} {then.day}" if then.year == now.year else f"{then:%Y-%m-%d}"


def _shorten(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


def _session_info_html(info: SessionInfo) -> str:
    parts = [f"session <code>{html.escape(str(info.id))}</code>"]
    if info.title:
        parts.append(html.escape(info.title))
    parts.append(f"{info.message_count} messages, {info.token_count} tokens, cache: {info.tier or 'none'}")
    parts.append(f"last active {info.last_active_at:%Y-%m-%d %H:%M} UTC")
    if info.system_prompt:
        prompt = info.system_prompt if len(info.system_prompt) <= 120 else info.system_prompt[:117] + "..."
        parts.append(f"system prompt: {html.escape(prompt)}")
    return " · ".join(parts)


def _source_text(stats: TurnStats) -> str:
    """Where the turn's cache came from, in words (the stats table's "cache from")."""
    source = stats.restored_from
    if source == "new":
        return "shared system prompt" if stats.base_reused_tokens else "nothing yet (first turn)"
    if source == "rebuilt":
        return "rebuilt from the transcript"
    return _SOURCE_NAMES.get(source, source)


def _restore_ms(stats: TurnStats) -> float | None:
    """Time to bring the cache back from host memory or disk; `None` for other sources."""
    return round(stats.restore_s * 1000, 1) if stats.restored_from in ("host", "disk") else None


def _stats_row(turn: int, stats: TurnStats) -> StatsRow:
    rate = stats.decode_tokens / stats.decode_s if stats.decode_s > 0 else None
    return (
        turn,
        round(stats.ttft_s * 1000, 1),
        stats.prefill_tokens,
        stats.reused_tokens,
        _source_text(stats),
        _restore_ms(stats),
        None if rate is None else round(rate, 1),
        stats.cache_tokens,
    )


def _stats_html(turn: int, stats: TurnStats) -> str:
    """One readable line; each figure carries a `data-stat` attribute for tests and scrapers (the
    cache source also a `data-value` with the `TurnStats.restored_from` value)."""
    _, ttft_ms, prefill, reused, source_text, restore_ms, rate, context = _stats_row(turn, stats)
    rate_text = "-" if rate is None else f"{rate:.1f}"
    source = html.escape(stats.restored_from)
    if stats.restored_from == "new" and stats.base_reused_tokens:
        cache = "cache: the tenant's <b>shared system prompt</b>"
    elif stats.restored_from == "new":
        cache = "<b>no cache yet</b> (first turn)"
    elif stats.restored_from == "rebuilt":
        cache = "cache <b>rebuilt</b> from the transcript"
    else:
        cache = f"cache from <b>{html.escape(source_text)}</b>"
    if restore_ms is not None:
        cache += f', restored in <b data-stat="restore_ms">{restore_ms:.1f}</b> ms'
    return (
        f'<div class="chatkv-stats">Turn <b data-stat="turn">{turn}</b>'
        f' · TTFT <b data-stat="ttft_ms">{ttft_ms:.1f}</b> ms'
        f' · prefilled <b data-stat="prefill_tokens">{prefill}</b> tokens'
        f' · reused <b data-stat="reused_tokens">{reused}</b> tokens'
        f' · <span data-stat="restored_from" data-value="{source}">{cache}</span>'
        f' · decode <b data-stat="decode_tokens_per_s">{rate_text}</b> tokens/s'
        f' · context <b data-stat="context_tokens">{context}</b> tokens</div>'
    )
