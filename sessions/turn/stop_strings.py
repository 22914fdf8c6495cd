"""Stop strings: end a reply once its text contains one of them, as OpenAI's `stop` does.

The text returned is the reply up to the first stop string (the string itself excluded). While a
reply streams, text that could be the start of a stop string is held back until the next pieces
tell whether it is one, so a streamed reply never shows a stop string and its pieces joined equal
the returned text:

    reply text so far     "Hello wor"        stop "world"
    released              "Hello "           ("wor" could start "world": held back)
    next piece "ld!"      stop found at 6    released "" ; the returned text is "Hello "

The turn is stored as its client saw it: the returned text, with its own ids and a stop token
(what a posted history of that text stores), and the session's cache is cropped to end there, or
not kept when no cache ends there (`sessions.turn.completion`). `Reply.token_ids` stays what was
generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sessions.errors import InvalidInput
from sessions.validation import check_text

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 1000


@dataclass(frozen=True)
class StopStrings:
    """Up to `MAX_STOP_STRINGS` non-empty strings that end a reply.

    Raises:
        InvalidInput: for too many strings, an empty one, or one that is not storable text.
    """

    strings: Sequence[str] = ()
    """Kept as a tuple."""

    def __post_init__(self) -> None:
        if isinstance(self.strings, str) or not isinstance(self.strings, Sequence):
            raise InvalidInput(f"stop must be a list of strings, got {type(self.strings).__name__}")
        if len(self.strings) > MAX_STOP_STRINGS:
            raise InvalidInput(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.strings)}")
        for text in self.strings:
            check_text(text, "a stop string", MAX_STOP_CHARS)
            if not text:
                raise InvalidInput("a stop string must not be empty")
        object.__setattr__(self, "strings", tuple(self.strings))

    def __bool__(self) -> bool:
        return bool(self.strings)

    def find(self, text: str, start: int = 0) -> int | None:
        """Index in `text` of the earliest stop string that ends after `start`, or `None`."""
        # An occurrence at i ends at i + len(s): it ends after `start` exactly when i > start - len(s).
        found = [i for i in (text.find(s, max(0, start - len(s) + 1)) for s in self.strings) if i >= 0]
        return min(found) if found else None

    def safe_end(self, text: str) -> int:
        """How much of `text` can be released: all but a tail that could begin a stop string."""
        for size in range(min(len(text), max((len(s) for s in self.strings), default=1) - 1), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self.strings):
                return len(text) - size
        return len(text)


NO_STOP = StopStrings()


class StopScanner:
    """Follows a reply's growing text; says what to release and where a stop string cuts it.

    A scanner made with `armed=False` (a turn with `min_new_tokens`) looks for no stop string until
    `arm(length)`; then only stop strings ending after the first `length` characters cut the reply,
    as vLLM applies `min_tokens` to stop strings. Text that could begin a stop string is held back
    all the same, so a stop string across the boundary cuts text that was never released.
    """

    def __init__(self, stop: StopStrings, *, armed: bool = True) -> None:
        self._stop = stop
        self.armed = armed
        self.released = 0
        """Characters of the text released so far."""
        self.cut: int | None = None
        """Where the returned text ends (the first stop string's index), once one was found."""
        self._scanned = 0

    def push(self, text: str) -> str:
        """`text` is the whole reply so far (it only grows). Returns the newly releasable piece
        (possibly empty); sets `cut` when a stop string appears."""
        if self.cut is not None:
            return ""
        end = len(text)
        if self._stop:
            if self.armed:
                self.cut = self._stop.find(text, self._scanned)
                self._scanned = len(text)
            end = self.cut if self.cut is not None else self._stop.safe_end(text)
        return self._release(text, end)

    def arm(self, length: int) -> None:
        """Look for stop strings from now on, those ending after the first `length` characters."""
        if not self.armed:
            self.armed = True
            self._scanned = length

    def finish(self, text: str) -> str:
        """The rest of the returned text once the reply ended (the held-back tail, if no stop)."""
        piece = self.push(text)
        return piece + self._release(text, self.cut if self.cut is not None else len(text))

    def _release(self, text: str, end: int) -> str:
        piece = text[self.released : max(end, self.released)]
        self.released = max(end, self.released)
        return piece
