"""chatkv's public API: `SessionManager`, its `Settings`, the records it returns and its errors, and
what the faces (`app/`: CLI, chat page, HTTP API) need beside them: `open_services` hands them
the manager with the services beside it (`Services`). `app/` imports from here only
(`from sessions import ...`); nothing under `sessions.` is its door.

`SessionManager`, `Services`, `open_services`, `SessionDetail`, `PlannedTurn` and `Route` (and torch and
transformers) are imported on first use, so a tool that only needs settings, records, error types
or the admin operations (the admin CLI, offline or talking to a server) starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cache.ids import SessionId, TenantId
from sessions.admin import AdminOps, Json
from sessions.cancellation import CancelToken
from sessions.conversations import ConversationRecord, ConversationRecords
from sessions.database import database_revision, head_revision, open_database, upgrade_database
from sessions.errors import (
    BackendUnavailable,
    ChatKVError,
    ContextTooLong,
    ConversationNotFound,
    ConversationTooLarge,
    EngineStopped,
    HistoryTooLong,
    HomeLocked,
    InvalidInput,
    InvalidSettings,
    KeyMismatch,
    ManagerClosed,
    ModelNotFound,
    ModelUnavailable,
    ReplicaRetired,
    ResponseNotFound,
    SessionBusy,
    SessionExists,
    SessionMoved,
    SessionNotFound,
    SessionOwnedElsewhere,
    TenantExists,
    TenantNotFound,
    TurnCancelled,
    UnsupportedModel,
)
from sessions.home import (
    ADMIN_TOKEN_FILE,
    HomeLock,
    admin_token,
    check_unlocked,
    describe_owner,
    read_owner,
    recovery_hint,
)
from sessions.idempotency import Claimed, IdempotentRequests, InProgress, KeyReused, Replay
from sessions.records import (
    EVICT_TARGETS,
    TIERS,
    Message,
    Reply,
    RestoreResult,
    RestoreSource,
    SessionInfo,
    Tenant,
    TurnStats,
)
from sessions.registry import SESSION_NAME_RULE
from sessions.settings import Settings, default_home, parse_duration_s
from sessions.turn_options import TurnOptions
from sessions.turn_target import TurnPlan, TurnTarget
from sessions.validation import MAX_MESSAGE_CHARS, check_text

if TYPE_CHECKING:
    from sessions.catalogue import SessionDetail
    from sessions.manager import Services, SessionManager, open_services
    from sessions.replicas.routing import Route
    from sessions.turn_door import PlannedTurn

_LAZY = {
    "SessionManager": "sessions.manager",
    "Services": "sessions.manager",
    "open_services": "sessions.manager",
    "SessionDetail": "sessions.catalogue",
    "PlannedTurn": "sessions.turn_door",
    "Route": "sessions.replicas.routing",
}

if not TYPE_CHECKING:  # a module `__getattr__` would let the type checker accept any name from here

    def __getattr__(name: str) -> Any:
        if name in _LAZY:
            import importlib

            return getattr(importlib.import_module(_LAZY[name]), name)
        raise AttributeError(f"module 'sessions' has no attribute {name!r}")


__all__ = [
    "ADMIN_TOKEN_FILE",
    "EVICT_TARGETS",
    "MAX_MESSAGE_CHARS",
    "SESSION_NAME_RULE",
    "TIERS",
    "AdminOps",
    "BackendUnavailable",
    "CancelToken",
    "ChatKVError",
    "Claimed",
    "ContextTooLong",
    "ConversationNotFound",
    "ConversationRecord",
    "ConversationRecords",
    "ConversationTooLarge",
    "EngineStopped",
    "HistoryTooLong",
    "HomeLock",
    "HomeLocked",
    "IdempotentRequests",
    "InProgress",
    "InvalidInput",
    "InvalidSettings",
    "Json",
    "KeyMismatch",
    "KeyReused",
    "ManagerClosed",
    "Message",
    "ModelNotFound",
    "ModelUnavailable",
    "PlannedTurn",
    "Replay",
    "ReplicaRetired",
    "Reply",
    "ResponseNotFound",
    "RestoreResult",
    "RestoreSource",
    "Route",
    "Services",
    "SessionBusy",
    "SessionDetail",
    "SessionExists",
    "SessionId",
    "SessionInfo",
    "SessionManager",
    "SessionMoved",
    "SessionNotFound",
    "SessionOwnedElsewhere",
    "Settings",
    "Tenant",
    "TenantExists",
    "TenantId",
    "TenantNotFound",
    "TurnCancelled",
    "TurnOptions",
    "TurnPlan",
    "TurnStats",
    "TurnTarget",
    "UnsupportedModel",
    "admin_token",
    "check_text",
    "check_unlocked",
    "database_revision",
    "default_home",
    "describe_owner",
    "head_revision",
    "open_database",
    "open_services",
    "parse_duration_s",
    "read_owner",
    "recovery_hint",
    "upgrade_database",
]
