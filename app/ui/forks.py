"""Regenerate and edit on the chat page are forks (a turn to `TurnTarget(session=S,
fork_turns=k)`, forked by the door as any face's forks): which turn a fork keeps and what it
sends, read off the messages on screen, and the lines the page shows about them.

    on screen     u0 a0 | u1 a1 | u2 a2          (turns 0, 1, 2; `Shown` indices 0..5)
    regenerate    fork(S, 2), then u2 again      the fork: u0 a0 | u1 a1 | u2 a2'
    edit u1 (2)   fork(S, 1), then u1'           the fork: u0 a0 | u1' a1'

The parent S stays as it was; the fork becomes the open session.

At Temperature 0 (greedy) the same turn gives the same reply, so a fork whose turn ends up exactly
like one already stored is not kept (`same_turn`): the page opens that one instead, and a retry
clicked ten times leaves no ten identical forks behind. The turn runs first all the same: the
reply it replaces may have been sampled at a higher temperature or cut at another Max new tokens,
so only the run tells. Above 0 every retry is a new branch, as a user asking for another reply
expects.

    the fork's turn k (message, reply) equals   the page opens          the fork
    S's own turn k                              S                       deleted
    turn k of another fork of S at turn k       that fork               deleted
    neither, or Temperature above 0             the fork                kept
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.ui.view import Shown
from sessions import ChatKVError

if TYPE_CHECKING:
    from sessions import SessionManager, Tenant

FORK_STOPPED_NOTE = "Stopped. The partial reply was discarded and the fork was not kept; the conversation is as it was."
"""Shown after Stop on a regenerated or edited turn: its fork is deleted, the original open again."""
SAME_REPLY_NOTE = (
    "The same reply again: at Temperature 0 (greedy) it always is, so no new fork was kept. "
    "Raise Temperature for another one."
)
"""Shown when a fork's turn at Temperature 0 equals the one on screen before (`same_turn`)."""
SAME_FORK_NOTE = (
    "The same reply as this fork's, made before: at Temperature 0 (greedy) it always is, so no new fork "
    "was kept and this one is open. Raise Temperature for another one."
)
"""Shown when a fork's turn at Temperature 0 equals another fork's (`same_turn`), now open."""
NOTHING_TO_REGENERATE = "there is no reply to regenerate"
NO_SUCH_MESSAGE = "that message is not in this conversation (any more)"
REPLY_NOT_EDITABLE = (
    "replies cannot be edited, only your messages: a changed reply is not something the model said, "
    "so there is no cache to keep warm for it"
)
EMPTY_EDIT = "type a message first"
"""The same line as an empty send."""


@dataclass(frozen=True)
class ForkPoint:
    """Where a regenerate or an edit forks: the fork keeps the first `turns` turns (`shown`, the
    messages on screen before the fork turn) and sends `text` as its next user message."""

    turns: int
    text: str
    shown: Shown


def regenerate_point(shown: Shown) -> ForkPoint | str:
    """The fork that regenerates the last reply on screen: every turn but the last, then the last
    user message again. A string says why there is none."""
    if not shown or shown[-1][0] != "assistant":
        return NOTHING_TO_REGENERATE
    last_user = max(i for i, (role, _) in enumerate(shown) if role == "user")
    return _point(shown, last_user, shown[last_user][1])


def edit_point(shown: Shown, index: int, text: str) -> ForkPoint | str:
    """The fork that edits the user message at `index` of `shown` (the chatbot's message index)
    to `text`: the turns before it, then `text`. A string says why there is none (no such
    message, a reply, an empty text)."""
    if isinstance(index, bool) or not 0 <= index < len(shown):
        return NO_SUCH_MESSAGE
    if shown[index][0] != "user":
        return REPLY_NOT_EDITABLE
    if not text.strip():
        return EMPTY_EDIT
    return _point(shown, index, text)


def _point(shown: Shown, index: int, text: str) -> ForkPoint:
    """The fork before the user message at `index`: the turns before it are its user messages."""
    turns = sum(1 for role, _ in shown[:index] if role == "user")
    return ForkPoint(turns, text, shown[:index])


def same_turn(
    manager: SessionManager, tenant: Tenant, parent: str, fork: str, point: ForkPoint, reply: str
) -> str | None:
    """The session that already holds the turn just stored on `fork` (made from `parent` at
    `point`; `reply` its reply's text): `parent` when its turn `point.turns` is that message and
    reply, else another fork of `parent` at that turn holding them, else `None`. Sessions deleted
    meanwhile are skipped (raises `ChatKVError` if the tenant's sessions cannot be listed)."""
    siblings = [
        str(info.id)
        for info in manager.list_sessions(tenant)
        if info.parent_id == parent and info.fork_turns == point.turns and info.id != fork
    ]
    index = 2 * point.turns
    for session_id in (parent, *siblings):
        try:
            history = manager.history(tenant, session_id)
        except ChatKVError:
            continue
        if len(history) > index + 1 and (history[index].text, history[index + 1].text) == (point.text, reply):
            return session_id
    return None
