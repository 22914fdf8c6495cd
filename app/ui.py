"""The Gradio chat UI: sign in with a tenant API key (or run as the single `local` tenant), pick or
start a session, chat with streaming output, and see what each turn cost (TTFT, tokens prefilled
vs reused, where the cache came from, decode speed).

Every page action is a `SessionManager` call made with the tenant of this browser tab. The tenant
lives in a `gr.State`, which Gradio keeps server-side per tab (a client cannot set it); a module
global here would show one tenant's sessions on another tenant's page.

The event handlers are methods of `ChatUI` and return a `View` (one field per output component), so
tests call them directly without a browser.
"""

from __future__ import annotations

import contextlib
import html
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import gradio as gr

from sessions.errors import ChatKVError, TenantExists, TenantNotFound
from sessions.manager import SessionManager
from sessions.records import Reply, SessionInfo, Tenant, TurnStats

LOCAL_TENANT = "local"
UNKNOWN_KEY_MESSAGE = "unknown API key"
"""The one answer to a wrong key and to a key of an unknown tenant (they must look the same)."""
CHAT_CONCURRENCY = 4
"""Turns streamed at once across all tabs; the engine interleaves their model calls token by token."""
STATS_HEADERS = [
    "turn",
    "TTFT (ms)",
    "prefilled tokens",
    "reused tokens",
    "cache from",
    "decode tokens/s",
    "context tokens",
]
UI_CSS = """
#turn-stats .chatkv-stats { font-size: 0.9em; opacity: 0.85; padding: 2px 4px; }
#turn-stats b { font-variant-numeric: tabular-nums; }
.chatkv-error { color: #b91c1c; font-weight: 600; padding: 2px 4px; }
#session-info { font-size: 0.85em; opacity: 0.8; }
"""
"""Passed to `gr.mount_gradio_app` (Gradio 6 takes CSS at mount/launch, not in `gr.Blocks`)."""

Shown = tuple[tuple[str, str], ...]
"""Messages on screen as `(role, text)` pairs, roles `user` / `assistant`."""
StatsRow = tuple[int, float, int, int, str, float | None, int]


@dataclass(frozen=True)
class ViewState:
    """What one browser tab holds (in a `gr.State`): its tenant, the open session, the messages on
    screen and the stats of the turns run in this tab."""

    tenant: Tenant | None = None
    session_id: str | None = None
    shown: Shown = ()
    stats_rows: tuple[StatsRow, ...] = ()


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
    stats_line: Any
    stats_table: Any
    error_line: Any


def _view(state: ViewState, **changes: Any) -> View:
    values: dict[str, Any] = {name: gr.update() for name in View._fields}
    values.update(changes, state=state)
    return View(**values)


class ChatUI:
    """Event handlers of the chat page over one manager. Holds no per-user data: that is in `ViewState`."""

    def __init__(self, manager: SessionManager, *, local: bool) -> None:
        self.manager = manager
        self.local = local

    # -- signing in ----------------------------------------------------------------------------

    def on_load(self, state: ViewState) -> View:
        """Page opened: local mode signs in as the `local` tenant (created if missing)."""
        if not self.local:
            return self._signed_out()
        try:
            tenant = local_tenant(self.manager)
        except ChatKVError as exc:
            return _view(ViewState(), main_panel=gr.update(visible=True), error_line=_error_html(str(exc)))
        return self._signed_in(tenant)

    def login(self, api_key: str, state: ViewState) -> View:
        """Resolve a tenant API key; any wrong or unknown key gets `UNKNOWN_KEY_MESSAGE`."""
        try:
            tenant = self.manager.tenant_for_api_key((api_key or "").strip())
        except TenantNotFound:
            return self._signed_out(message=_error_html(UNKNOWN_KEY_MESSAGE))
        return self._signed_in(tenant)

    def sign_out(self, state: ViewState) -> View:
        return self._signed_out()

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
            message="",
            stats_line="",
            stats_table=[],
            error_line="",
        )

    def _signed_in(self, tenant: Tenant) -> View:
        state = ViewState(tenant=tenant)
        return _view(
            state,
            login_panel=gr.update(visible=False),
            main_panel=gr.update(visible=True),
            login_message="",
            api_key="",
            tenant_line=f"Tenant <b>{html.escape(tenant.name)}</b> · model {html.escape(self.manager.model_name)}",
            session_picker=self._picker(tenant, None),
            session_info="",
            chatbot=[],
            message="",
            stats_line="",
            stats_table=[],
            error_line="",
        )

    # -- sessions ------------------------------------------------------------------------------

    def refresh_sessions(self, state: ViewState) -> View:
        if state.tenant is None:
            return _view(state, error_line=_error_html("sign in first"))
        try:
            return _view(state, session_picker=self._picker(state.tenant, state.session_id), error_line="")
        except ChatKVError as exc:
            return _view(state, error_line=_error_html(str(exc)))

    def select_session(self, session_id: str | None, state: ViewState) -> View:
        """Open one of the tenant's sessions and show its history."""
        if state.tenant is None:
            return _view(state, error_line=_error_html("sign in first"))
        if not session_id:
            return _view(replace(state, session_id=None, shown=(), stats_rows=()), chatbot=[], session_info="")
        try:
            info = self.manager.session_info(state.tenant, session_id)
            history = self.manager.history(state.tenant, session_id)
        except ChatKVError as exc:
            return _view(state, error_line=_error_html(str(exc)))
        shown = tuple((m.role, m.text) for m in history if m.role in ("user", "assistant"))
        state = replace(state, session_id=info.id, shown=shown, stats_rows=())
        return _view(
            state,
            session_info=_session_info_html(info),
            chatbot=_chat(shown),
            stats_line="",
            stats_table=[],
            error_line="",
        )

    def new_session(self, title: str, system_prompt: str, state: ViewState) -> View:
        """Start a session (empty title / system prompt: none) and switch to it."""
        if state.tenant is None:
            return _view(state, error_line=_error_html("sign in first"))
        try:
            session_id = self.manager.open_session(
                state.tenant, system_prompt=system_prompt.strip() or None, title=title.strip() or None
            )
            info = self.manager.session_info(state.tenant, session_id)
            picker = self._picker(state.tenant, session_id)
        except ChatKVError as exc:
            return _view(state, error_line=_error_html(str(exc)))
        return _view(
            ViewState(tenant=state.tenant, session_id=session_id),
            session_picker=picker,
            session_info=_session_info_html(info),
            chatbot=[],
            stats_line="",
            stats_table=[],
            error_line="",
        )

    def leave_session(self, state: ViewState) -> View:
        """The chat's clear button: close the session on screen (it stays stored and listed); the
        next message starts a new one."""
        return _view(
            ViewState(tenant=state.tenant),
            session_picker=gr.update(value=None),
            session_info="",
            chatbot=[],
            stats_line="",
            stats_table=[],
            error_line="",
        )

    def _picker(self, tenant: Tenant, selected: str | None) -> dict[str, Any]:
        choices = [(_session_label(info), str(info.id)) for info in self.manager.list_sessions(tenant)]
        return gr.update(choices=choices, value=selected)

    # -- turns ---------------------------------------------------------------------------------

    def send(self, message: str, max_new_tokens: float, temperature: float, state: ViewState) -> Iterator[View]:
        """Stream one turn: the reply grows on screen, then the turn's stats appear. Without an open
        session a new untitled one is started. An error restores the message box and shows one line.

        Args:
            max_new_tokens: most tokens of the reply (a slider's float).
            temperature: 0 for greedy decoding.
        """
        text = message or ""
        tenant = state.tenant
        if tenant is None:
            yield _view(state, error_line=_error_html("sign in first"))
            return
        if not text.strip():
            yield _view(state, error_line=_error_html("type a message first"))
            return
        picker: Any = gr.update()
        session_id = state.session_id
        if session_id is None:
            try:
                session_id = self.manager.open_session(tenant)
                picker = self._picker(tenant, session_id)
            except ChatKVError as exc:
                yield _view(state, error_line=_error_html(str(exc)))
                return
            state = replace(state, session_id=session_id)
        shown = (*state.shown, ("user", text))
        yield _view(state, chatbot=_chat(shown), message="", session_picker=picker, error_line="")
        # Closing the generator when this tab goes away releases the session's lease at once.
        stream = self.manager.stream_chat(
            tenant, session_id, text, max_new_tokens=int(max_new_tokens), temperature=float(temperature)
        )
        pieces: list[str] = []
        reply: Reply | None = None
        try:
            with contextlib.closing(stream):
                for item in stream:
                    if isinstance(item, Reply):
                        reply = item
                    else:
                        pieces.append(item)
                        yield _view(state, chatbot=_chat((*shown, ("assistant", "".join(pieces)))))
        except ChatKVError as exc:
            yield _view(state, chatbot=_chat(state.shown), message=text, error_line=_error_html(str(exc)))
            return
        if reply is None:
            raise RuntimeError("bug: stream_chat ended without a Reply")
        yield self._after_turn(state, tenant, session_id, text, reply)

    def _after_turn(self, state: ViewState, tenant: Tenant, session_id: str, text: str, reply: Reply) -> View:
        shown = (*state.shown, ("user", text), ("assistant", reply.text))
        turn = sum(1 for role, _ in shown if role == "user")
        row = _stats_row(turn, reply.stats)
        state = replace(state, shown=shown, stats_rows=(*state.stats_rows, row))
        view = _view(
            state,
            chatbot=_chat(shown),
            stats_line=_stats_html(row),
            stats_table=[list(r) for r in state.stats_rows],
        )
        try:
            info = self.manager.session_info(tenant, session_id)
            return view._replace(session_info=_session_info_html(info), session_picker=self._picker(tenant, session_id))
        except ChatKVError as exc:  # e.g. the session was deleted by an operator just now
            return view._replace(error_line=_error_html(str(exc)))


def build_ui(manager: SessionManager, *, local: bool) -> gr.Blocks:
    """The chat page over `manager`. `local`: single-tenant mode as the `local` tenant, no API key.

    Stable element ids (for users' CSS and for tests): `api-key`, `login`, `login-message`,
    `tenant-line`, `session-picker`, `refresh-sessions`, `new-title`, `new-system-prompt`,
    `new-session`, `max-new-tokens`, `temperature`, `sign-out`, `session-info`, `chat`, `message`,
    `send`, `chat-error`, `turn-stats` (figures in `[data-stat=...]`: `turn`, `ttft_ms`,
    `prefill_tokens`, `reused_tokens`, `restored_from`, `decode_tokens_per_s`, `context_tokens`)
    and `stats-table`.
    """
    ui = ChatUI(manager, local=local)
    max_tokens_limit = max(1, min(2048, manager.context_budget_tokens // 2))
    with gr.Blocks(title="chatkv", analytics_enabled=False) as blocks:
        state = gr.State(ViewState())
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
                    placeholder="Pick a session or just type: a new session starts with your first message.",
                )
                with gr.Row():
                    message = gr.Textbox(
                        label="Message", placeholder="Type a message, Enter to send", scale=5, elem_id="message"
                    )
                    send = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="send")
                error_line = gr.HTML(elem_id="chat-error")
                stats_line = gr.HTML(elem_id="turn-stats")
                with gr.Accordion("Turn stats", open=False):
                    stats_table = gr.Dataframe(
                        headers=STATS_HEADERS, value=[], interactive=False, elem_id="stats-table"
                    )
        components = {
            "state": state, "login_panel": login_panel, "main_panel": main_panel, "login_message": login_message,
            "api_key": api_key, "tenant_line": tenant_line, "session_picker": session_picker,
            "session_info": session_info, "chatbot": chatbot, "message": message, "stats_line": stats_line,
            "stats_table": stats_table, "error_line": error_line,
        }  # fmt: skip
        outputs = [components[name] for name in View._fields]
        quick: dict[str, Any] = {"outputs": outputs, "api_visibility": "private", "show_progress": "hidden"}
        blocks.load(ui.on_load, inputs=[state], **quick)
        gr.on([login.click, api_key.submit], ui.login, inputs=[api_key, state], **quick)
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


# -- rendering -----------------------------------------------------------------------------------


def _chat(shown: Shown) -> list[dict[str, str]]:
    return [{"role": role, "content": text} for role, text in shown]


def _error_html(message: str) -> str:
    return f'<div class="chatkv-error" role="alert">{html.escape(message)}</div>'


def _session_label(info: SessionInfo) -> str:
    name = info.title or str(info.id)
    return f"{name} · {info.last_active_at:%Y-%m-%d %H:%M}"


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


def _stats_row(turn: int, stats: TurnStats) -> StatsRow:
    rate = stats.decode_tokens / stats.decode_s if stats.decode_s > 0 else None
    return (
        turn,
        round(stats.ttft_s * 1000, 1),
        stats.prefill_tokens,
        stats.reused_tokens,
        stats.restored_from,
        None if rate is None else round(rate, 1),
        stats.cache_tokens,
    )


def _stats_html(row: StatsRow) -> str:
    """One readable line; each figure carries a `data-stat` attribute for tests and scrapers."""
    turn, ttft_ms, prefill, reused, source, rate, context = row
    rate_text = "-" if rate is None else f"{rate:.1f}"
    return (
        f'<div class="chatkv-stats">Turn <b data-stat="turn">{turn}</b>'
        f' · TTFT <b data-stat="ttft_ms">{ttft_ms:.1f}</b> ms'
        f' · prefilled <b data-stat="prefill_tokens">{prefill}</b> tokens'
        f' · reused <b data-stat="reused_tokens">{reused}</b> tokens'
        f' · cache from <b data-stat="restored_from">{html.escape(source)}</b>'
        f' · decode <b data-stat="decode_tokens_per_s">{rate_text}</b> tokens/s'
        f' · context <b data-stat="context_tokens">{context}</b> tokens</div>'
    )
