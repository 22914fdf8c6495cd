"""The Gradio chat UI: sign in with a tenant API key (or run as the single `local` tenant), pick or
start a session, chat with streaming output, and see what each turn cost (TTFT, tokens prefilled
vs reused, where the cache came from, decode speed).

Every page action is a `SessionManager` call made with the tenant of this browser tab. The tenant
and the API key it signed in with live in a `gr.State`, which Gradio keeps server-side per tab (a
client cannot set it); a module global here would show one tenant's sessions on another tenant's
page. The key is checked again on every event that touches the tenant's data, so rotating or
deleting a tenant's key (or the tenant) signs out the tabs that use it.

A turn goes through the door like every face's (`SessionManager.run_turn` with a `TurnTarget`):
to the open session, to a new one for a message sent with none open, to a fork for regenerate and
edit; a session made for a turn is kept only if the turn completes. It runs to completion in a
worker thread whether or not its tab is still there: reloading or closing the page mid-reply still
stores the message and the whole reply. The Stop button is the one way to cancel a reply: the
worker closes its turn, which cancels it at the engine's next step and stores nothing, so the
partial reply is discarded (the note under the chat says so) and the session takes the next
message at once.

Regenerate (the retry button on the last reply) and edit (the pencil on a user message; replies
are not editable) are forks (`app.ui.forks`): a new session holding the turns before the one redone,
warm from the original's cache, becomes the open session and runs the turn; the original stays as
it was, in the picker, where forks are a tree under their parents, each named by what it changed
(`↳ fork at turn 3: “edited”`, `app.ui.sessions`). At Temperature 0 a fork whose turn equals one
stored already is not kept: that session opens instead (`app.ui.forks.same_turn`). A regenerated
or edited turn that fails or is stopped deletes its fork and opens the original again.

Delete session… under the picker asks first (`app.ui.deletion`): the question names the open
session (a fork by its own line) and what stays (its parent, its forks), and only its "Delete for
good" deletes it (`SessionManager.delete_session`: transcript and caches in every tier), then the
picker is refreshed. The chat's clear button (a bin icon, its
tooltip `CLEAR_LABEL`) deletes nothing: it only starts a new conversation.

The open session is remembered in the browser (`gr.BrowserState`, the browser's local storage), so
a page reload opens it again once the same tenant is signed in.

The event handlers are methods of `ChatUI` and return a `View` (one field per output component), so
tests call them directly without a browser.

Where things live: this module builds the page (`build_ui`) and holds what the server mounts it
with; the handlers are `app.ui.handlers.ChatUI`, a turn's worker thread is `app.ui.turns`, where
a fork starts `app.ui.forks`, the picker's labels `app.ui.sessions`, deleting a session
`app.ui.deletion`, the view values `app.ui.view` and their HTML `app.ui.render`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import gradio as gr

from app.ui.handlers import (
    EMPTY_KEY_MESSAGE,
    LOCAL_TENANT,
    STOPPED_NOTE,
    UNKNOWN_KEY_MESSAGE,
    ChatUI,
    local_tenant,
)
from app.ui.render import STATS_COLUMN_WIDTHS, STATS_HEADERS, STATS_TABLE_LABEL
from app.ui.sessions import LABEL_CHARS
from app.ui.view import REMEMBERED_KEY, View, ViewState

if TYPE_CHECKING:
    from sessions import SessionManager

__all__ = [
    "CHAT_CONCURRENCY",
    "CLEAR_LABEL",
    "EMPTY_KEY_MESSAGE",
    "KEY_HELP",
    "LABEL_CHARS",
    "LOCAL_TENANT",
    "STOPPED_NOTE",
    "UI_CSS",
    "UI_TRANSLATIONS",
    "UNKNOWN_KEY_MESSAGE",
    "ChatUI",
    "View",
    "ViewState",
    "build_ui",
    "local_tenant",
]

CHAT_CONCURRENCY = 16
"""Turns streamed at once across all tabs; the engine loop batches them into each forward pass."""
CLEAR_LABEL = "New conversation (this one stays in the Session list)"
"""Tooltip of the chat's clear button, which leaves the session on screen without deleting it."""
KEY_HELP = (
    "A key (`ckv_...`) belongs to one tenant and comes from whoever runs this server: "
    "`chatkv tenants create <name>` prints a new tenant's key once, and "
    "`chatkv tenants rotate-api-key <name>` issues a new one (the old one stops working). "
    "Ask your administrator for yours."
)
"""Under the sign-in box: where API keys come from."""
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


def build_ui(manager: SessionManager, *, local: bool, chat_ui: ChatUI | None = None) -> gr.Blocks:
    """The chat page over `manager`. `local`: single-tenant mode as the `local` tenant, no API key.
    `chat_ui`: the handlers to use (default: new ones; the server keeps them to wait for turns in
    flight at shutdown).

    Stable element ids (for users' CSS and for tests): `api-key`, `login`, `login-message`,
    `login-help`, `tenant-line`, `session-picker`, `refresh-sessions`, `delete-session` (asks
    first: `delete-panel` holds the question `delete-question` and its answers `confirm-delete`
    and `cancel-delete`), `new-title`, `new-system-prompt`,
    `new-session`, `max-new-tokens`, `temperature`, `sign-out`, `session-info`, `chat`,
    `reply-note` (a note about the last reply: `[data-note=stopped]` after Stop, `[data-note=length]`
    when it reached Max new tokens, `[data-note=same]` when a regenerated reply is the one it
    replaced), `message`, `send`, `stop` (shown while a reply streams), `chat-error`,
    `turn-stats` (figures in `[data-stat=...]`: `turn`, `ttft_ms`, `prefill_tokens`,
    `reused_tokens`, `restored_from` (its `data-value` is the `TurnStats` value: new, device,
    host, disk, redis or rebuilt), `restore_ms` (only for host, disk and redis),
    `decode_tokens_per_s`, `context_tokens`) and `stats-table`.
    """
    # Over 60 lines: Gradio declares a page as one block of components and their events; split,
    # the pieces would only pass the components to each other.
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
            gr.Markdown(KEY_HELP, elem_id="login-help")
        with gr.Row(visible=False, elem_id="main-panel") as main_panel:
            with gr.Column(scale=1, min_width=280):
                tenant_line = gr.HTML(elem_id="tenant-line")
                session_picker = gr.Dropdown(
                    label="Session", choices=[], value=None, interactive=True, elem_id="session-picker"
                )
                with gr.Row():
                    refresh = gr.Button("Refresh list", size="sm", elem_id="refresh-sessions")
                    delete = gr.Button("Delete session…", size="sm", elem_id="delete-session")
                with gr.Column(visible=False, elem_id="delete-panel") as delete_panel:
                    delete_question = gr.HTML(elem_id="delete-question")
                    with gr.Row():
                        confirm_delete = gr.Button(
                            "Delete for good", variant="stop", size="sm", elem_id="confirm-delete"
                        )
                        cancel_delete = gr.Button("Keep it", size="sm", elem_id="cancel-delete")
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
                    editable="user",
                    placeholder=(
                        "Pick a session or just type: a new session starts with your first message. "
                        "The bin icon at the top right of the chat starts a new conversation: it deletes nothing. "
                        "To delete a session, use Delete session… under the Session list (it asks first). "
                        "Stop cancels a reply and discards it. Retry on the last reply regenerates it "
                        "and the pencil on your message edits it: each makes a fork, and the original "
                        "stays in the Session list."
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
                        # Wrapped, the eight columns fit the box at any page width.
                        wrap=True,
                        column_widths=STATS_COLUMN_WIDTHS,
                    )
        components = {
            "state": state, "login_panel": login_panel, "main_panel": main_panel, "login_message": login_message,
            "api_key": api_key, "tenant_line": tenant_line, "session_picker": session_picker,
            "session_info": session_info, "chatbot": chatbot, "message": message, "send_button": send,
            "stats_line": stats_line, "stats_table": stats_table, "error_line": error_line,
            "stop_button": stop, "reply_note": reply_note, "remembered": remembered,
            "delete_panel": delete_panel, "delete_question": delete_question,
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
        delete.click(ui.ask_delete, inputs=[state], **quick)
        confirm_delete.click(ui.confirm_delete, inputs=[state], **quick)
        cancel_delete.click(ui.cancel_delete, inputs=[state], **quick)
        new.click(ui.new_session, inputs=[title, system_prompt, state], **quick)
        # The turns: a send, and the forks (regenerate: the retry button on the last reply; edit:
        # the pencil on a user message), all queued together.
        turns: dict[str, Any] = {
            "outputs": outputs,
            "api_visibility": "private",
            "show_progress": "minimal",
            "concurrency_limit": CHAT_CONCURRENCY,
            "concurrency_id": "chat",
        }
        gr.on([send.click, message.submit], ui.send, inputs=[message, max_new_tokens, temperature, state], **turns)
        chatbot.retry(ui.regenerate, inputs=[max_new_tokens, temperature, state], **turns)
        chatbot.edit(ui.edit, inputs=[max_new_tokens, temperature, state], **turns)
        # Not queued behind the chats; its only output is the button (the state is `send`'s).
        stop.click(ui.stop, inputs=[state], outputs=[stop], api_visibility="private", show_progress="hidden")
    blocks.queue(default_concurrency_limit=8)
    return blocks
