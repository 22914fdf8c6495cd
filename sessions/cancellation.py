"""Stopping a turn whose caller went away: `CancelToken`.

A turn's caller (an HTTP route whose client disconnected, a UI's Stop) sets the token from any
thread. The turn checks it between the steps of its preparation (restore, template, window) and,
once it has a request in the engine loop, the token cancels that request, which the loop drops at
its next step. Either way the turn raises `TurnCancelled` and stores nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from sessions.errors import TurnCancelled


class CancelToken:
    """A one-shot cancellation signal for one turn. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._callbacks: list[Callable[[TurnCancelled], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._reason is not None

    def cancel(self, reason: str = "the client went away before the reply was complete") -> None:
        """Stop the turn (idempotent): callbacks registered with `on_cancel` run here, once."""
        with self._lock:
            if self._reason is not None:
                return
            self._reason = reason
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(TurnCancelled(reason))

    def check(self) -> None:
        """Raises `TurnCancelled` once the token is cancelled."""
        if self._reason is not None:
            raise TurnCancelled(self._reason)

    def on_cancel(self, callback: Callable[[TurnCancelled], None]) -> Callable[[], None]:
        """Run `callback` with the error when the token is cancelled (at once if it already is).
        Returns a function that unregisters it."""
        with self._lock:
            reason = self._reason
            if reason is None:
                self._callbacks.append(callback)
        if reason is not None:
            callback(TurnCancelled(reason))

        def unregister() -> None:
            with self._lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)

        return unregister
