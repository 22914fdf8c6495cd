"""What the chat page shows, as values: `ViewState` (what one browser tab holds) and `View` (one
value per output component of `app.ui.build_ui`), with the small `gr.update` helpers the event
handlers (`app.ui.handlers`) build views from."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import gradio as gr

from sessions import Tenant

REMEMBERED_KEY = "chatkv-open-session"
"""Local-storage key of the open session (`{"tenant": id, "session": id}`). Not a secret: a
remembered session opens only for its own tenant, whose key the tab signed in with."""

Shown = tuple[tuple[str, str], ...]
"""Messages on screen as `(role, text)` pairs, roles `user` / `assistant`."""
StatsRow = tuple[int, float, int, int, str, float | None, float | None, int]


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
    deleting: str | None = None
    """The session the delete question on screen names (`app.ui.deletion`); `None`: no question."""


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
    delete_panel: Any
    """The delete question and its two buttons: shown only while a deletion waits for its answer."""
    delete_question: Any


def make_view(state: ViewState, **changes: Any) -> View:
    values: dict[str, Any] = {name: gr.update() for name in View._fields}
    values.update(changes, state=state)
    return View(**values)


def unchanged_view() -> View:
    """A view that changes nothing, the tab's state included (`gr.update()` keeps a `gr.State`):
    for an event that comes after others may have changed the state it was sent with."""
    return View._make(gr.update() for _ in View._fields)


DELETE_HIDDEN: dict[str, Any] = {"delete_panel": gr.update(visible=False), "delete_question": ""}
"""The outputs that put the delete question away."""


def no_session_view(state: ViewState, note: str) -> View:
    """The tab with no session open and the chat empty, `note` (HTML) in the session line: the
    next message starts a new session."""
    return make_view(
        replace(state, session_id=None, shown=(), stats_rows=(), deleting=None),
        session_picker=gr.update(value=None),
        session_info=note,
        chatbot=[],
        stats_line="",
        stats_table=[],
        error_line="",
        reply_note="",
        remembered=None,
        **DELETE_HIDDEN,
    )


def no_session_shown() -> dict[str, Any]:
    """The session components of a tab that shows no session yet (after sign-in or sign-out)."""
    return {
        "session_info": "",
        "chatbot": [],
        "message": input_update(True, value=""),
        "send_button": input_update(True),
        "stats_line": "",
        "stats_table": [],
        "error_line": "",
        "stop_button": stop_button_update(False),
        "reply_note": "",
        **DELETE_HIDDEN,
    }


def input_update(enabled: bool, **value: Any) -> dict[str, Any]:
    """The message box or the Send button: usable or not (while a reply streams)."""
    return gr.update(interactive=enabled, **value)


def stop_button_update(visible: bool, *, interactive: bool = True) -> dict[str, Any]:
    """The Stop button: shown only while a reply streams."""
    return gr.update(visible=visible, interactive=interactive)


def overlay(base: View, top: View) -> View:
    """`base` with every field that `top` changes (is not a bare `gr.update()`) taken from `top`."""
    return base._replace(**{name: value for name, value in top._asdict().items() if value != gr.update()})


def remembered_value(tenant: Tenant, session_id: str | None) -> dict[str, str] | None:
    """What the browser keeps of the open session (`None`: none open)."""
    return None if session_id is None else {"tenant": str(tenant.id), "session": str(session_id)}


def remembered_session(remembered: object, tenant: Tenant) -> str | None:
    """The session id the browser kept, if it was kept for `tenant` (the value comes from the
    browser: anything else is ignored)."""
    if not isinstance(remembered, dict) or remembered.get("tenant") != str(tenant.id):
        return None
    session_id = remembered.get("session")
    return session_id if isinstance(session_id, str) and session_id else None
