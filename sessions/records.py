"""Value objects returned by the public API: tenants, sessions, messages, replies and turn statistics."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from cache.ids import SessionId, TenantId

Role = Literal["system", "user", "assistant"]
RestoreSource = Literal["new", "device", "host", "disk", "redis", "rebuilt"]
"""Where a turn found the session cache: `new` (first turn), a tier, or `rebuilt` by prefill from the
transcript (no cache stored, the stored cache failed authentication, or another model fingerprint)."""
FinishReason = Literal["stop", "length"]
TIERS = ("device", "host", "disk")
"""The tiers of a process that hold a session's cache: `cache.tiers.Tier`'s local values (not
imported: `cache` imports torch). A Redis copy is shared among replicas (`RestoreSource`)."""
EVICT_TARGETS = ("host", "disk", "drop")
"""Where `SessionManager.evict_session` moves an idle session's cache: a lower tier, or away."""


@dataclass(frozen=True)
class Tenant:
    id: TenantId
    name: str
    created_at: datetime


@dataclass(frozen=True)
class SessionInfo:
    id: SessionId
    tenant_id: TenantId
    title: str | None
    system_prompt: str | None
    model_fingerprint: str
    token_count: int
    """Tokens in the conversation stream (every message, including turns demoted out of the window)."""
    message_count: int
    created_at: datetime
    last_active_at: datetime
    tier: str | None = None
    """`device`, `host`, `disk`, or `None` when no cache is stored (it is rebuilt on the next turn)."""
    name: str | None = None
    """The id its client chose (`X-Session-ID` the tenant had not used), if it chose one."""
    parent_id: SessionId | None = None
    """The session it was forked from (regenerate, edit, retry, a branch), if it is a fork."""
    fork_turns: int | None = None
    """How many of the parent's turns the fork started with."""
    origin: str = "explicit"
    """`explicit`, `implicit` (made for a posted history), `named` or `fork`: implicit sessions and
    forks nobody continued expire after an idle TTL (`Settings.implicit_retention_s`)."""


@dataclass(frozen=True)
class Message:
    index: int
    role: Role
    text: str
    token_ids: tuple[int, ...]
    """Exact ids. Assistant: the generated ids, stop token included (a reply cut by a stop string,
    or one posted in a history: its text's ids and a stop token). User: the stream ids from the
    end of the previous turn's fed tokens up to the generation prompt (the previous reply's unfed
    tokens and closing, the template's framing and the message; the first turn's include the
    system prompt's rendering)."""
    created_at: datetime


@dataclass(frozen=True)
class TurnStats:
    """What one turn cost. Token counts are tokens; times are seconds of wall clock."""

    prefill_tokens: int
    """Tokens run through the model before the first new token."""
    reused_tokens: int
    """Tokens served from cache (session cache plus shared base layer)."""
    ttft_s: float
    """From the call to the first sampled token: restore, tokenisation and prefill included."""
    decode_tokens: int
    decode_s: float
    restored_from: RestoreSource = "new"
    restore_s: float = 0.0
    base_reused_tokens: int = 0
    """Part of `reused_tokens` served by the shared base layer of the prefix pool."""
    demoted_tokens: int = 0
    """Tokens of turn layers demoted out of the context window before this turn."""
    cache_tokens: int = 0
    """Tokens held in the session cache after the turn (window size); 0 when the turn kept none
    (a stop string cut the reply inside a token: the next turn rebuilds)."""
    peak_tokens: int = 0
    """Most tokens one working buffer of the turn held at once, from preparing its window to its
    last token: a rebuild's kept past (under `attention`/`agnostic`, chunk by chunk: at most the
    budget plus `window_rebuild_chunk_tokens`), an evicting turn's full cache with its prefill,
    or the turn's own buffer (cache, prefill and reply)."""
    queue_s: float = 0.0
    """From submitting the turn to the engine loop to the first step that ran it (part of `ttft_s`)."""
    restore_choice: Literal["restore", "recompute"] | None = None
    """For a cache found in a lower tier (host, disk, Redis): restored, or its tokens prefilled
    again because that was estimated cheaper (`sessions.turn.costs`); `None` otherwise."""
    restore_estimate_s: float | None = None
    """The estimated restore time the choice compared (`None`: not measured enough yet)."""
    recompute_estimate_s: float | None = None
    """The estimated time to prefill the cached tokens again (`None`: not measured enough yet)."""


@dataclass(frozen=True)
class Reply:
    text: str
    """The reply as returned: the text of `token_ids`, cut before the first stop string when one
    of the turn's `stop` strings ended it (the streamed pieces joined equal it)."""
    token_ids: tuple[int, ...]
    """Generated ids, the stop token included when generation stopped on one."""
    stats: TurnStats
    finish_reason: FinishReason = "stop"
    """`stop`: a stop token or stop string ended the reply; `length`: `max_new_tokens` did."""
    generated_text: str | None = None
    """The whole text of `token_ids` when a stop string cut `text` short, else `None`."""

    @property
    def stored_text(self) -> str:
        """The text the transcript stores: the reply as returned (`text`). A reply cut by a stop
        string is stored cut, with its text's ids and a stop token rather than `token_ids`, as a
        posted history of it would be, so the session answers next as a fresh post of it does."""
        return self.text


@dataclass(frozen=True)
class RestoreResult:
    """Outcome of `SessionManager.restore_session` (pre-warming a cache onto the device)."""

    tier: str | None
    """Where the cache is now (`None`: nothing stored, the next turn rebuilds it)."""
    restored_from: str | None
    """The tier it came from, `None` if nothing usable was stored."""
    restore_s: float
    rejected: bool
    """A stored blob failed authentication or decoding and was discarded."""
