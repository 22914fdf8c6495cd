"""chatkv's public API: `SessionManager`, its `Settings`, the records it returns and its errors.

`SessionManager` (and with it torch and transformers) is imported on first use, so a tool that
only needs settings or error types (the admin CLI talking to a server) starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sessions.cancellation import CancelToken
from sessions.errors import (
    ChatKVError,
    ContextTooLong,
    HistoryTooLong,
    HomeLocked,
    InvalidInput,
    ModelUnavailable,
    SessionBusy,
    SessionNotFound,
    TenantExists,
    TenantNotFound,
    TurnCancelled,
)
from sessions.records import Message, Reply, RestoreResult, SessionInfo, Tenant, TurnStats
from sessions.settings import Settings

if TYPE_CHECKING:
    from sessions.catalogue import SessionDetail
    from sessions.manager import SessionManager


def __getattr__(name: str) -> Any:
    if name == "SessionManager":
        from sessions import manager

        return manager.SessionManager
    if name == "SessionDetail":
        from sessions import catalogue

        return catalogue.SessionDetail
    raise AttributeError(f"module 'sessions' has no attribute {name!r}")


__all__ = [
    "CancelToken",
    "ChatKVError",
    "ContextTooLong",
    "HistoryTooLong",
    "HomeLocked",
    "InvalidInput",
    "Message",
    "ModelUnavailable",
    "Reply",
    "RestoreResult",
    "SessionBusy",
    "SessionDetail",
    "SessionInfo",
    "SessionManager",
    "SessionNotFound",
    "Settings",
    "Tenant",
    "TenantExists",
    "TenantNotFound",
    "TurnCancelled",
    "TurnStats",
]
