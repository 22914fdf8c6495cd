"""Regenerate and edit on the chat page are forks (`SessionManager.fork`): which turn a fork keeps
and what it sends, read off the messages on screen, and the lines the page shows about them.

    on screen     u0 a0 | u1 a1 | u2 a2          (turns 0, 1, 2; `Shown` indices 0..5)
    regenerate    fork(S, 2), then u2 again      the fork: u0 a0 | u1 a1 | u2 a2'
    edit u1 (2)   fork(S, 1), then u1'           the fork: u0 a0 | u1' a1'

The parent S stays as it was; the fork becomes the open session.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.ui.view import Shown

FORK_STOPPED_NOTE = "Stopped. The partial reply was discarded and the fork was not kept; the conversation is as it was."
"""Shown after Stop on a regenerated or edited turn: its fork is deleted, the original open again."""
SAME_REPLY_NOTE = "The same reply again: at Temperature 0 (greedy) it always is. Raise Temperature for another one."
"""Shown when a regenerated reply equals the one it replaces."""
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
