"""The stored conversation as a turn needs it: the transcript (system prompt, past turns with their
exact reply ids, pins, the stream position) and its chained digest, which every session cache
records so a cache computed from another transcript is never reused."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from sessions.turn.chat_template import PastTurn


@dataclass
class Transcript:
    """What a turn needs of the stored conversation (cached in memory per session).

    `token_count`: tokens of the conversation stream fed so far (demoted turns included); it is the
    stream index at which the next turn's prefill starts.
    """

    system_prompt: str | None
    turns: list[PastTurn] = field(default_factory=list)
    pinned: set[int] = field(default_factory=set)
    token_count: int = 0
    digest: str = ""
    """Chained digest of the system prompt and every turn (`transcript_digest`)."""

    def __post_init__(self) -> None:
        if not self.digest:
            digest = transcript_digest("", None, self.system_prompt)
            for turn in self.turns:
                digest = transcript_digest(digest, turn, None)
            self.digest = digest

    def append(self, turn: PastTurn, token_count: int) -> None:
        self.turns.append(turn)
        self.token_count = token_count
        self.digest = transcript_digest(self.digest, turn, None)


def transcript_digest(previous: str, turn: PastTurn | None, system_prompt: str | None) -> str:
    """SHA-256 chain over the transcript: the system prompt first, then each turn's texts and
    exact reply ids. A cache records the digest of the transcript it was computed from."""
    digest = hashlib.sha256(previous.encode())
    if turn is None:
        digest.update(b"system\0" + (b"\1" + system_prompt.encode() if system_prompt is not None else b"\0"))
    else:
        digest.update(b"turn\0" + turn.user_text.encode() + b"\0" + turn.assistant_text.encode() + b"\0")
        digest.update(",".join(str(i) for i in turn.assistant_ids).encode())
    return digest.hexdigest()
