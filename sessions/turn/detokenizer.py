"""Streaming detokenisation that never splits a character.

Byte-level BPE tokens can end in the middle of a multi-byte UTF-8 character (CJK, emoji); decoding
such a prefix yields U+FFFD. A piece is released only when the decoded text does not end in U+FFFD,
so the pieces joined are exactly the text of all the ids.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated ids into text pieces. `text` is the concatenation of the pieces released."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self.text = ""

    def _decode(self) -> str:
        return str(self._tokenizer.decode(self._ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def push(self, token_id: int) -> str:
        """Add a token; return the newly complete text (possibly empty)."""
        self._ids.append(token_id)
        decoded = self._decode()
        if decoded.endswith(REPLACEMENT) or not decoded.startswith(self.text):
            return ""
        piece = decoded[len(self.text) :]
        self.text = decoded
        return piece

    def finish(self) -> str:
        """Release what is left (an incomplete character at the very end stays as U+FFFD)."""
        decoded = self._decode()
        if not decoded.startswith(self.text):
            raise RuntimeError("bug: the tokenizer decoded a prefix differently from the whole")
        piece = decoded[len(self.text) :]
        self.text = decoded
        return piece
