"""chatkv's public API: `SessionManager`, its `Settings`, the records it returns and its errors."""

from sessions.errors import (
    ChatKVError,
    ContextTooLong,
    InvalidInput,
    ModelUnavailable,
    SessionBusy,
    SessionNotFound,
    TenantExists,
    TenantNotFound,
)
from sessions.manager import SessionDetail, SessionManager
from sessions.records import Message, Reply, SessionInfo, Tenant, TurnStats
from sessions.settings import Settings

__all__ = [
    "ChatKVError",
    "ContextTooLong",
    "InvalidInput",
    "Message",
    "ModelUnavailable",
    "Reply",
    "SessionBusy",
    "SessionDetail",
    "SessionInfo",
    "SessionManager",
    "SessionNotFound",
    "Settings",
    "Tenant",
    "TenantExists",
    "TenantNotFound",
    "TurnStats",
]
