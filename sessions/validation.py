"""Checks of the text and ids a caller passes in, made before any work so that every database
behaves the same: PostgreSQL refuses a NUL character in text, and no database can store a lone
surrogate, where SQLite would store a NUL. No torch here: the admin operations use it offline.
"""

from __future__ import annotations

from sessions.errors import InvalidInput

MAX_MESSAGE_CHARS = 1_000_000
"""Longest message (and system prompt) a turn or a session takes, in characters."""


def check_text(value: object, what: str, max_chars: int) -> None:
    """Raises `InvalidInput` unless `value` is a string of at most `max_chars` characters of
    storable text: valid Unicode (no lone surrogates) without NUL characters."""
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise InvalidInput(f"{what} longer than {max_chars:,} characters")
    if "\x00" in value:
        raise InvalidInput(f"{what} contains a NUL character (U+0000), which cannot be stored")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"{what} is not valid Unicode text (it contains a lone surrogate)") from None


def valid_id(value: object) -> bool:
    """Whether `value` can name a tenant or a session at all; anything else is simply not found."""
    if not isinstance(value, str) or "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
