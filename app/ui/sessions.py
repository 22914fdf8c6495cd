"""The session picker: each session's label (its title or first message, or for a fork the
session it was forked from and where, and when it was last active) and the picker's choices."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import gradio as gr

from sessions import ChatKVError, SessionInfo, Tenant

if TYPE_CHECKING:
    from sessions import SessionManager

LABEL_CHARS = 40
"""Longest name of a session in the picker (its title, or its first message), in characters;
longer ones end with an ellipsis. The label adds when it was last active (`· 5 min ago`)."""
FORK_MARK = "↳"
"""Starts the label of a fork (regenerate, edit): `↳ fork of “name” at turn 3 · just now`."""
_MAX_LABELS = 10_000


class SessionLabels:
    """Labels of a manager's sessions for the picker. Caches each session's first user message
    (it never changes), so listing the sessions does not read every history again."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager
        self._first_messages: dict[tuple[str, str], str] = {}
        """(tenant id, session id) -> the session's first user message."""

    def picker(self, tenant: Tenant, selected: str | None) -> dict[str, Any]:
        """The picker's update: every session of `tenant` as `manager.list_sessions` orders them,
        `selected` chosen (raises `ChatKVError`)."""
        infos = self.manager.list_sessions(tenant)
        by_id = {str(info.id): info for info in infos}
        choices = [(self.label(tenant, info, by_id), str(info.id)) for info in infos]
        return gr.update(choices=choices, value=selected)

    def label(self, tenant: Tenant, info: SessionInfo, sessions: Mapping[str, SessionInfo]) -> str:
        """`name · 5 min ago`: the title, else the first message, else `(empty)`, shortened to
        `LABEL_CHARS` (with an ellipsis), and when the session was last active. A fork says whose
        and where instead of its name: `↳ fork of “parent's name” at turn 3`, the turn it
        diverges at, counted from 1 as the turn stats count (its parent looked up in `sessions`,
        the tenant's sessions by id; a parent not there reads `a deleted session`)."""
        now = datetime.now(UTC)
        if info.parent_id is None:
            return f"{self.name(tenant, info)} · {ago(info.last_active_at, now)}"
        parent = sessions.get(str(info.parent_id))
        whose = "a deleted session" if parent is None else f"“{self.name(tenant, parent)}”"
        return f"{FORK_MARK} fork of {whose} at turn {(info.fork_turns or 0) + 1} · {ago(info.last_active_at, now)}"

    def name(self, tenant: Tenant, info: SessionInfo) -> str:
        """The session's title, else its first message, else `(empty)`, shortened to `LABEL_CHARS`."""
        first = self._first_message(tenant, info) if info.message_count and not info.title else None
        return _shorten(info.title or first or "(empty)", LABEL_CHARS)

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


def ago(then: datetime, now: datetime) -> str:
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
