"""The session picker: the tenant's sessions as a tree, each fork under the session it was forked
from, and each session's label (a session's title or first message; a fork's own line: the turn
it forks at and what differs there) with when it was last active.

    Hello there · 5 min ago                                        a session
     ↳ fork at turn 2: new reply “Blue is a colour” · 2 min ago     a retry of its turn 2
      ↳ fork at turn 3: “Name a shape.” · just now                 an edit, in that fork
    ↳ fork at turn 2 of a deleted session: “And then?” · 1 h ago   its parent deleted

Each level is one em space (`INDENT`) before the mark.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import gradio as gr

from sessions import ChatKVError, Message, SessionInfo, Tenant

if TYPE_CHECKING:
    from sessions import SessionManager

LABEL_CHARS = 40
"""Longest name of a session in the picker (its title, or its first message; a fork's message at
its fork turn), in characters; longer ones end with an ellipsis. The label adds when it was last
active (`· 5 min ago`)."""
FORK_MARK = "↳"
"""Starts the label of a fork (retry, edit): `↳ fork at turn 3: “Name a shape.” · just now`."""
INDENT = "\u2003"
"""One level of the tree, before a fork's mark: an em space, which HTML does not collapse."""
NO_TURN_YET = "(no turn yet)"
"""A fork's own name while it holds nothing past its fork turn (its turn is still running)."""
_MAX_LABELS = 10_000


@dataclass(frozen=True)
class Listed:
    """A session as the picker lists it: `depth` levels under a session that is no fork or whose
    parent is deleted (depth 0), and its `parent` (`None`: no fork, or the parent is deleted)."""

    info: SessionInfo
    depth: int
    parent: SessionInfo | None


def session_tree(infos: Sequence[SessionInfo]) -> list[Listed]:
    """`infos` in the picker's order: each fork right under its parent (forks of one parent by
    fork turn, then age), and the top-level sessions most recently active first, a session
    counting as active when one of its forks is (so the conversation in use stays on top)."""
    by_id = {str(info.id): info for info in infos}
    children: dict[str, list[SessionInfo]] = {}
    roots: list[SessionInfo] = []
    for info in infos:
        if info.parent_id is not None and str(info.parent_id) in by_id:
            children.setdefault(str(info.parent_id), []).append(info)
        else:
            roots.append(info)
    for forks in children.values():
        forks.sort(key=lambda fork: (fork.fork_turns or 0, fork.created_at))

    def family(info: SessionInfo, depth: int, parent: SessionInfo | None) -> list[Listed]:
        rows = [Listed(info, depth, parent)]
        for fork in children.get(str(info.id), []):
            rows.extend(family(fork, depth + 1, info))
        return rows

    families = [family(root, 0, None) for root in roots]
    families.sort(key=lambda rows: max(row.info.last_active_at for row in rows), reverse=True)
    return [row for rows in families for row in rows]


class SessionLabels:
    """Labels of a manager's sessions for the picker. Caches each session's first user message
    and each fork's own name (neither ever changes), so listing the sessions does not read every
    history again."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager
        self._names: dict[tuple[str, str], str] = {}
        """(tenant id, session id) -> its first user message, or a fork's own name."""

    def picker(self, tenant: Tenant, selected: str | None) -> dict[str, Any]:
        """The picker's update: every session of `tenant` in `session_tree` order, `selected`
        chosen (raises `ChatKVError`)."""
        rows = session_tree(self.manager.list_sessions(tenant))
        return gr.update(choices=[(self.label(tenant, row), str(row.info.id)) for row in rows], value=selected)

    def label(self, tenant: Tenant, row: Listed) -> str:
        """`name · 5 min ago` for a session that is no fork (`name`); for a fork, indented one em
        space per level, `↳ fork at turn 3: own · 5 min ago` (`fork_line`)."""
        when = ago(row.info.last_active_at, datetime.now(UTC))
        if row.info.parent_id is None:
            return f"{self.name(tenant, row.info)} · {when}"
        return f"{INDENT * row.depth}{FORK_MARK} {self.fork_line(tenant, row.info, row.parent)} · {when}"

    def name(self, tenant: Tenant, info: SessionInfo) -> str:
        """The session's title, else its first message, else `(empty)`, shortened to `LABEL_CHARS`."""
        first = self._first_message(tenant, info) if info.message_count and not info.title else None
        return _shorten(info.title or first or "(empty)", LABEL_CHARS)

    def fork_line(self, tenant: Tenant, info: SessionInfo, parent: SessionInfo | None) -> str:
        """A fork's line without its mark: `fork at turn 3: own` (`own_name`), the turn counted
        from 1 as the turn stats count; `fork at turn 3 of a deleted session: own` when its
        parent (`None`) is gone."""
        where = f"fork at turn {(info.fork_turns or 0) + 1}"
        return f"{where}{'' if parent is not None else ' of a deleted session'}: {self.own_name(tenant, info)}"

    def own_name(self, tenant: Tenant, info: SessionInfo) -> str:
        """What a fork holds that its parent does not, at its fork turn: `“the edited message”`,
        or `new reply “the reply”` when the message is the parent's (a retry), or `NO_TURN_YET`.
        A fork's title is its parent's (copied when forked), so it never names the fork. With the
        parent deleted a retry is no longer told from an edit: the message is its name."""
        key = (str(tenant.id), str(info.id))
        cached = self._names.get(key)
        if cached is not None:
            return cached
        index = 2 * (info.fork_turns or 0)
        mine = self._history(tenant, str(info.id))
        if len(mine) <= index + 1:
            return NO_TURN_YET
        parents = self._history(tenant, str(info.parent_id))
        message, reply = mine[index].text, mine[index + 1].text
        if len(parents) > index and parents[index].text == message:
            own = f"new reply “{_shorten(reply, LABEL_CHARS)}”"
        else:
            own = f"“{_shorten(message, LABEL_CHARS)}”"
        if parents:  # told apart for good: cache it
            self._remember(key, own)
        return own

    def _first_message(self, tenant: Tenant, info: SessionInfo) -> str | None:
        key = (str(tenant.id), str(info.id))
        first = self._names.get(key)
        if first is None:
            first = next((m.text for m in self._history(tenant, str(info.id)) if m.role == "user"), None)
            if first is not None:
                self._remember(key, first)
        return first

    def _history(self, tenant: Tenant, session_id: str) -> list[Message]:
        try:
            return self.manager.history(tenant, session_id)
        except ChatKVError:  # deleted since it was listed
            return []

    def _remember(self, key: tuple[str, str], name: str) -> None:
        if len(self._names) >= _MAX_LABELS:
            self._names.clear()
        self._names[key] = name


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
