"""Where a turn goes, and where it was decided to run: the two values of the turn's door
(`sessions.turn_door`). Torch-free: a face builds a `TurnTarget` while it reads its request.

    face (HTTP route, chat page, CLI, embedder)   TurnTarget   what the request says
    SessionManager.plan_turn                      TurnPlan     session, action, route (one lookup)
    SessionManager.run_turn                       PlannedTurn  the reply's pieces, then the Reply
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from sessions.errors import InvalidInput

if TYPE_CHECKING:
    from sessions.replicas.routing import Route

Action = Literal["continue", "fork", "new"]


@dataclass(frozen=True)
class TurnTarget:
    """Where a turn goes: at most one of `session`, `previous_response`, `conversation`,
    `new_session` (none: the posted history decides), with the conversation as its client posted it.

    Attributes:
        system_prompt: the posted system prompt (with `previous_response`: new instructions,
            `None` keeps the session's).
        history: earlier turns as `(user text, reply text as returned)`.
        session: a session the client names (an id or its chosen name).
        previous_response: a stored response the turn follows (the Responses API).
        conversation: a conversation whose items are `history` (the Conversations API).
        create: a `session` name not used yet starts a session under it, holding the posted
            history (the OpenAI routes' `X-Session-ID`); off, it is `SessionNotFound`.
        store: `False`: the turn runs on a session made for it, which its client deletes after
            the reply (deleted and erased here if the turn does not complete).
        fork_turns: with `session`: the turn runs on a new fork of it holding its first
            `fork_turns` turns (the chat page's regenerate and edit), listed as
            `SessionManager.fork`'s forks are.
        new_session: a new session of the client's own (`explicit`: kept until deleted) holding
            `system_prompt` and `history`, never one found by its history (the first message of
            the chat page and of `chatkv chat`).

    Raises:
        InvalidInput: for more than one of `session`, `previous_response`, `conversation`,
            `new_session`; `fork_turns` without `session`, with `create`, or with a posted
            `history` or `system_prompt`.
    """

    system_prompt: str | None = None
    history: Sequence[tuple[str, str]] = ()
    """Kept as a tuple."""
    session: str | None = None
    previous_response: str | None = None
    conversation: str | None = None
    create: bool = False
    store: bool = True
    fork_turns: int | None = None
    new_session: bool = False

    def __post_init__(self) -> None:
        named = [n for n in (self.session, self.previous_response, self.conversation) if n is not None]
        if len(named) + self.new_session > 1:
            raise InvalidInput("a turn goes to one session, previous response or conversation, not several")
        if self.fork_turns is not None and (self.session is None or self.create):
            raise InvalidInput("fork_turns forks the session a turn names, which must exist")
        if self.fork_turns is not None and (self.history or self.system_prompt is not None):
            # The fork holds the parent's turns and system prompt: posted ones would be dropped unread.
            raise InvalidInput("fork_turns keeps the parent's turns and system prompt: post neither")
        object.__setattr__(self, "history", tuple(self.history))  # its texts are checked where stored


@dataclass(frozen=True)
class Continue:
    """Run on `session_id` if it still has `expected_turns` turns (`None`: any) and is idle.
    `found=False`: no such session when planned; running the step raises `SessionNotFound` (after
    a face has answered an idempotent retry from its record)."""

    session_id: str
    expected_turns: int | None
    found: bool = True


@dataclass(frozen=True)
class Fork:
    """Run on a new fork of `parent_id` after its first `turns` turns."""

    parent_id: str
    turns: int
    origin: str


@dataclass(frozen=True)
class New:
    """Run on a new session holding `system_prompt` and `history`."""

    system_prompt: str | None
    history: tuple[tuple[str, str], ...]
    origin: str
    name: str | None = None


Step = Continue | Fork | New


@dataclass(frozen=True)
class TurnPlan:
    """Where a turn runs, decided once (`SessionManager.plan_turn`): the first step to try, the
    steps to fall back on (a session busy, or moved on, meanwhile), and the route among replicas.

    Attributes:
        steps: `Continue` steps tried in order, then at most one `Fork` or `New`; a plan without
            one ends in the last `Continue`'s refusal (`SessionBusy`).
        route: where the turn runs (`Route.kind`: `local`, `forward` to its owner, `handover`).
        erase: a session made for the turn is erased from the database files when it goes.
    """

    target: TurnTarget
    steps: tuple[Step, ...]
    route: Route
    erase: bool = False

    @property
    def action(self) -> Action:
        """What the first step does: `continue`, `fork` or `new`."""
        first = self.steps[0]
        return "continue" if isinstance(first, Continue) else "fork" if isinstance(first, Fork) else "new"

    @property
    def session_id(self) -> str | None:
        """The session the first step continues, or forks; `None` for a new session."""
        first = self.steps[0]
        return first.session_id if isinstance(first, Continue) else first.parent_id if isinstance(first, Fork) else None

    @property
    def expected_turns(self) -> int | None:
        first = self.steps[0]
        return first.expected_turns if isinstance(first, Continue) else None
