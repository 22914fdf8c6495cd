"""Typed errors of the public API.

Every error a caller can provoke with bad input derives from `ChatKVError`; the CLI maps them to exit
code 2 and the HTTP routes to a 4xx. A session id of another tenant raises the same `SessionNotFound`
as a missing id, with the same message, so the two cannot be told apart (invariant 2).
"""

from __future__ import annotations


class ChatKVError(Exception):
    """Base class of errors caused by the caller's input or by the state of the service."""

    http_status = 400


class InvalidInput(ChatKVError, ValueError):
    """An argument is malformed (empty message, bad name, out-of-range sampling parameter)."""


class TenantNotFound(ChatKVError):
    """No tenant with this id or name, or an API key that matches none (same message either way)."""

    http_status = 404

    def __init__(self, tenant: str = "") -> None:
        super().__init__(f"tenant not found: {tenant}" if tenant else "tenant not found")


class TenantExists(ChatKVError):
    """A tenant with this name exists already."""

    http_status = 409


class SessionNotFound(ChatKVError):
    """No session with this id for this tenant (also raised for another tenant's session id)."""

    http_status = 404

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session not found: {session_id}")


class ResponseNotFound(ChatKVError):
    """No stored response with this id for this tenant (also raised for another tenant's id, and
    for a response created with `store: false` or deleted)."""

    http_status = 404

    def __init__(self, response_id: str) -> None:
        super().__init__(f"response not found: {response_id}")


class ConversationNotFound(ChatKVError):
    """No conversation with this id for this tenant (also raised for another tenant's id)."""

    http_status = 404

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"conversation not found: {conversation_id}")


class ConversationTooLarge(ChatKVError):
    """Adding the items would take a conversation past its caps (`sessions.conversations`:
    `MAX_CONVERSATION_ITEMS` items, `MAX_CONVERSATION_BYTES` bytes); nothing was added."""

    http_status = 400


class SessionExists(ChatKVError):
    """A client-chosen session id the tenant uses already (a new named session must be new)."""

    http_status = 409


class SessionBusy(ChatKVError):
    """A turn is already in flight on this session; turns of one session run one at a time."""

    http_status = 409


class SessionOwnedElsewhere(SessionBusy):
    """Another live replica owns the session and did not hand it over within
    `Settings.ownership_wait_s` (it is running turns on it). `owner_url` is where that replica
    serves, if it registered one: send the request there, or retry later."""

    def __init__(self, session_id: str, owner_id: str | None, owner_url: str | None, waited_s: float) -> None:
        self.owner_id, self.owner_url = owner_id, owner_url
        where = f" at {owner_url}" if owner_url else ""
        super().__init__(
            f"session {session_id} is owned by replica {owner_id}{where}, which did not hand it over "
            f"within {waited_s:g} s; send the request there or retry"
        )


class SessionMoved(SessionBusy):
    """This replica lost the session's ownership lease while the turn ran (the lease expired and
    another replica took the session over): the turn was not stored. Retry it."""


class ReplicaRetired(ChatKVError):
    """Another process took this replica's id over while this one stalled (its heartbeat stopped
    for a lease): this process runs no more turns. Send the request to another replica, and
    restart this one (each process needs its own `CHATKV_REPLICA_ID`)."""

    http_status = 503


class ReplicaNotFound(ChatKVError):
    """No replica is registered under this id (`chatkv replicas` lists them)."""

    http_status = 404

    def __init__(self, replica_id: str) -> None:
        super().__init__(f"replica not found: {replica_id}")


class ContextTooLong(ChatKVError):
    """The new message (plus `max_new_tokens`) cannot fit in the model's context, even after the
    context window has demoted every unpinned turn; or a system prompt leaves no room for a turn.
    Nothing is stored. `what` names the culprit in the message (`message`, `system prompt`).

    With `reply_tokens` (the turn's `max_new_tokens`, part of `needed_tokens`), the message splits
    the need as vLLM's does, prompt tokens (system prompt, pinned turns, the new message) plus the
    reply's, and says which part to cut: max tokens when the prompt alone fits (and to how many;
    the message then reads `reply too long for the context`, since a short message with a large
    `max_tokens` is not too long), else the message.
    """

    http_status = 413

    def __init__(self, needed_tokens: int, limit_tokens: int, what: str = "message", reply_tokens: int = 0) -> None:
        self.needed_tokens = needed_tokens
        self.limit_tokens = limit_tokens
        self.reply_tokens = reply_tokens
        self.what = what
        super().__init__(self._describe(what))

    @property
    def prompt_tokens(self) -> int:
        """Tokens of context the turn needs before its reply."""
        return self.needed_tokens - self.reply_tokens

    def _describe(self, what: str) -> str:
        if not self.reply_tokens:
            return f"{what} too long: needs {self.needed_tokens} tokens of context, the limit is {self.limit_tokens}"
        need = (
            f"the turn needs {self.needed_tokens} tokens of context ({self.prompt_tokens} in the "
            f"prompt, up to {self.reply_tokens} in the reply), the limit is {self.limit_tokens}"
        )
        if self.prompt_tokens < self.limit_tokens:  # the reply's room is what is over: not the message's fault
            room = self.limit_tokens - self.prompt_tokens
            return f"reply too long for the context: {need}: lower max tokens to {room} or less"
        return f"{what} too long: {need}: the prompt alone is over it, shorten the {what}"


class HistoryTooLong(ChatKVError):
    """A history a client brings along (a stateless request's earlier turns) is over the limit of
    turns or tokens (`SessionManager.open_session`); refused before anything is stored, rendered
    or prefilled."""

    http_status = 413


class TurnCancelled(ChatKVError):
    """The caller stopped waiting for the turn (an HTTP client went away) before its reply was
    complete: the turn was cancelled and nothing was stored."""

    http_status = 499  # nginx's "client closed request": nobody reads it, logs do


class InvalidSettings(ChatKVError, ValueError):
    """Settings or a home that cannot work, found at start-up: a malformed master key, a replica id
    that another live process uses. The message names the culprit."""


class BackendUnavailable(ChatKVError):
    """A service the manager needs did not work at start-up: the key ring (a master key that cannot
    be read or written), or a Redis Cluster that does not answer (its slot map is needed). The
    message says which ("key ring: ...", "redis: ...")."""

    http_status = 503


class ModelUnavailable(ChatKVError):
    """The configured model cannot be found or loaded (missing directory, missing bundled package)."""

    http_status = 503


class ModelNotFound(ModelUnavailable):
    """The model named (`Settings.model`, `--model`) is not there: no such folder or GGUF file, a
    folder that is not a Hugging Face model, a GGUF file transformers cannot read, or a hub id that
    the hub could not be reached for (or does not have) and that is not in the local Hugging Face
    cache. Bad input: the CLI exits 2."""


class UnsupportedModel(ModelUnavailable):
    """The model loads, but chatkv cannot reuse its cache exactly (`sessions.engine.attention_kinds`:
    latent-compressed KV, recurrent or linear-attention layers, encoder-decoder, an attention
    argument the packed attention does not implement). Refused at load, before any turn; the
    message names what is unsupported. Bad input: the CLI exits 2."""

    def __init__(self, reason: str) -> None:
        super().__init__(f'unsupported model: {reason} (see "Supported models" in the README)')
        self.reason = reason


class HomeLocked(ChatKVError):
    """Another process holds the chatkv home: a running server, or a process with its own
    `SessionManager` open (one process owns a home). `holder` names it in words, `url` is its
    server's (`None`: an embedding process without one), `recovery` says what to do about a stale
    lock; the message says how to reach the holder instead (`advice`)."""

    http_status = 409

    def __init__(self, holder: str, url: str | None, recovery: str, advice: str = "") -> None:
        super().__init__(f"{holder} holds this home{'; ' + advice if advice else ''} ({recovery})")
        self.holder, self.url, self.recovery = holder, url, recovery

    @classmethod
    def held_by(cls, holder: str, url: str | None, recovery: str) -> HomeLocked:
        """The error for a `SessionManager` refused a home."""
        if url:
            advice = (
                f"use its HTTP API at {url} from this process instead "
                f"(POST {url.rstrip('/')}/v1/chat/completions with a tenant API key)"
            )
        else:
            advice = (
                "share that process's manager, or run `chatkv serve` on this home and have every "
                "process use its HTTP API (POST /v1/chat/completions)"
            )
        return cls(holder, url, recovery, f"a second SessionManager cannot open it: {advice}")


class KeyMismatch(ChatKVError):
    """The master key in use did not wrap the stored tenant keys (rotation refused)."""

    http_status = 409


class EngineStopped(ChatKVError):
    """The engine that runs the model was closed (by the manager that loaded it, while another
    manager shared it): no turn runs on it any more, and turns in flight on it were failed."""

    http_status = 503


class ManagerClosed(ChatKVError):
    """The `SessionManager` was closed: it takes no new turns, and turns in flight were cancelled."""

    http_status = 503
