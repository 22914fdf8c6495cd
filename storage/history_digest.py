"""The digest of a conversation as its client saw it: the key by which a stateless client's posted
history finds the session that holds its KV cache (`MetadataStore.sessions_by_history`).

A stock OpenAI client sends the whole conversation with every request. The session to continue is
the tenant's session whose history is exactly the posted one minus its last user message: the
system prompt, every user text and every reply text *as it was returned* (cut before a stop
string, where one ended the reply; the transcript stores it so too). The digest is a SHA-256
chain, so a turn extends it without reading the transcript:

    d0 = H("chatkv-history-v1", system prompt or none)
    dn = H(dn-1, user text n, reply text n as returned)

Every text is length-prefixed, so no two different histories concatenate to the same bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

_VERSION = b"chatkv-history-v1"


def _field(text: str) -> bytes:
    # Lone surrogates cannot be stored, so they never match; they must not crash a lookup either.
    data = text.encode("utf-8", "surrogatepass")
    return len(data).to_bytes(8, "big") + data


def start_digest(system_prompt: str | None) -> str:
    """The digest of a conversation with no turn yet."""
    marker = b"\1" + _field(system_prompt) if system_prompt is not None else b"\0"
    return hashlib.sha256(_VERSION + marker).hexdigest()


def extend_digest(previous: str, user_text: str, reply_text: str) -> str:
    """The digest after one more turn (`reply_text` as the client received it)."""
    return hashlib.sha256(previous.encode() + b"\0" + _field(user_text) + _field(reply_text)).hexdigest()


def history_digest(system_prompt: str | None, turns: Iterable[tuple[str, str]]) -> str:
    """The digest of a whole history: `turns` are `(user text, reply text as returned)`."""
    digest = start_digest(system_prompt)
    for user_text, reply_text in turns:
        digest = extend_digest(digest, user_text, reply_text)
    return digest


def digest_chain(system_prompt: str | None, turns: Iterable[tuple[str, str]]) -> list[str]:
    """The digest after each turn: `[d1, ..., dn]` (see the module docstring)."""
    chain, digest = [], start_digest(system_prompt)
    for user_text, reply_text in turns:
        digest = extend_digest(digest, user_text, reply_text)
        chain.append(digest)
    return chain
