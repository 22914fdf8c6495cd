"""Turns of the chat page run in worker threads: `Turn` runs one to completion whether or not its
tab is still there, `TurnThreads` tracks the ones in flight (for Stop, and for the server's
shutdown), and `slider_options` checks the sliders' values before a turn starts."""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from sessions import ChatKVError, InvalidInput, Reply, Tenant, TurnOptions

if TYPE_CHECKING:
    from sessions import SessionManager, TurnTarget

log = logging.getLogger(__name__)


class Turn:
    """One turn run to completion in a worker thread, through the door (`SessionManager.run_turn`
    with `target`); its reply pieces, then the `Reply` (or the exception it failed with), then
    `Turn.END`, arrive on `items`. Nobody has to read them: the turn is stored when it completes
    even if its tab went away. `stop()` (the Stop button) is what ends it early: then `stopped` is
    set and no `Reply` comes.

    A turn on a session made for it (`made`: a new session, or a fork) that fails or is stopped
    leaves no session behind (the door deletes it). `session_id` is the target's session, or the
    one made for the turn once `placed` is set (set also when the turn ended before one was made).

    The reader takes the reply as it grows from `partial_replies()`; once that ends, `reply` is
    the stored turn's `Reply`, or `failure` the exception the turn failed with, or `stopped` is set.
    """

    END = object()

    def __init__(
        self, manager: SessionManager, tenant: Tenant, target: TurnTarget, text: str, options: TurnOptions
    ) -> None:
        self.manager = manager
        self.tenant = tenant
        self.target = target
        self.text = text
        self.options = options
        self.session_id = target.session if target.fork_turns is None else None
        self.made = False
        """The turn runs on a session made for it (kept only if the turn completes)."""
        self.placed = threading.Event()
        if self.session_id is not None:
            self.placed.set()
        self.reply: Reply | None = None
        self.failure: Exception | None = None
        self.items: queue.Queue[object] = queue.Queue()
        self.stopped = False
        self._stop = threading.Event()

    def stop(self) -> None:
        """Ask the worker to cancel the turn: it closes the stream when the next piece arrives (one
        per engine step while the reply decodes; a turn still queued or prefilling stops at its
        first token), unless the reply is complete and stored by then."""
        self._stop.set()

    def run(self, before_end: Callable[[], None] | None = None) -> None:
        """Run the turn to its end, queueing what it yields (the worker thread's body). `END` is
        queued only once the turn is closed, so a stopped turn's session is free (or, made for it,
        deleted) by then, and after `before_end` has run (`TurnThreads` forgets the turn there: a
        tab that has seen the stored reply must find the session free, e.g. to delete it at once)."""
        try:
            # Inside the try: bad input (a message over the length limit) or a closed manager
            # raises at the call, and the tab must still get the error and `END`.
            turn = self.manager.run_turn(self.tenant, self.target, self.text, self.options)
            turn.on_made = self._made
            # Closing the turn cancels it at the engine's next step; nothing is stored.
            with contextlib.closing(turn):
                for item in turn:
                    if self._stop.is_set() and not isinstance(item, Reply):  # a Reply is stored already
                        self.stopped = True
                        break
                    self.items.put(item)
        # A thread boundary: whatever the turn raises must reach the tab's generator, which is
        # waiting on this queue (a ChatKVError is shown to the user, anything else is logged too).
        except Exception as exc:
            if not isinstance(exc, ChatKVError):
                log.exception("turn on session %s failed", self.session_id)
            self.items.put(exc)
        finally:
            self.placed.set()
            if before_end is not None:
                before_end()
            self.items.put(Turn.END)

    def _made(self, session_id: str) -> None:
        self.session_id, self.made = session_id, True
        self.placed.set()

    def next_items(self) -> list[object]:
        """Wait for the next item, then take every item already queued (a slow reader gets the
        pieces in batches instead of falling behind)."""
        items = [self.items.get()]
        with contextlib.suppress(queue.Empty):
            while items[-1] is not Turn.END:
                items.append(self.items.get_nowait())
        return items

    def partial_replies(self) -> Iterator[str]:
        """The reply so far, after each batch of new pieces, until the turn ends (then `reply`,
        `failure` or `stopped` says how). One reader only."""
        pieces: list[str] = []
        while True:
            streamed = len(pieces)
            done = False
            for item in self.next_items():
                if item is Turn.END:
                    done = True
                elif isinstance(item, Reply):
                    self.reply = item
                elif isinstance(item, Exception):
                    self.failure = item
                elif isinstance(item, str):
                    pieces.append(item)
            if done:
                return
            if len(pieces) > streamed:
                yield "".join(pieces)


class TurnThreads:
    """The worker threads of the turns in flight, of any tab (also of tabs that went away)."""

    def __init__(self) -> None:
        self._threads: set[threading.Thread] = set()
        self._streaming: set[Turn] = set()
        """The turns in flight (one at most on a session: its lease)."""
        self._lock = threading.Lock()

    def find(self, tenant_id: str, session_id: str) -> Turn | None:
        """The turn in flight on the tenant's session, if any."""
        with self._lock:
            return next(
                (t for t in self._streaming if str(t.tenant.id) == tenant_id and t.session_id == session_id), None
            )

    def start(self, turn: Turn) -> Turn:
        """Run `turn` in a worker thread, tracked until it ends (see `wait`), and wait until it
        has its session (made for it: a few milliseconds, before its prefill)."""

        def forget() -> None:
            with self._lock:
                self._streaming.discard(turn)

        def work() -> None:
            try:
                turn.run(before_end=forget)
            finally:
                forget()
                with self._lock:
                    self._threads.discard(thread)

        thread = threading.Thread(target=work, name="chatkv-turn", daemon=True)
        with self._lock:
            self._threads.add(thread)
            self._streaming.add(turn)
        thread.start()
        turn.placed.wait()
        return turn

    def wait(self, timeout_s: float) -> bool:
        """Wait until the turns in flight are stored; `False` if some are still running after
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                running = list(self._threads)
            if not running:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            running[0].join(remaining)


def slider_options(max_new_tokens: float, temperature: float) -> TurnOptions:
    """The sliders' values as a turn's options. A client can send any JSON number, NaN and
    infinity included, which `int` cannot convert.

    Raises:
        InvalidInput: for a value that is not a finite number, or out of its range (`TurnOptions`).
    """
    if not _finite(max_new_tokens):
        raise InvalidInput(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not _finite(temperature):
        raise InvalidInput(f"temperature must be a number >= 0, got {temperature!r}")
    return TurnOptions(max_new_tokens=int(max_new_tokens), temperature=float(temperature))


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
