"""The registry of tenants and sessions: their records as the public API shows them, and the rules
that find them. Torch-free, so the admin commands read a home through it without loading a model,
and the manager reads through the same object: tenant isolation is decided here, once.

    tenant reference   a `Tenant`, a tenant id (`tn_...`) or a tenant name
    session lookup     by tenant id AND session id: another tenant's session is not found,
                       with the same error and message as a missing one (invariant 2)

Every method reads the metadata database; `placement` says where a session's cache is (the live
tier manager's answer in a manager, what the database's blob rows say offline).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import cast

from cache.ids import SessionId, TenantId
from sessions.errors import InvalidInput, SessionNotFound, TenantNotFound
from sessions.records import Message, Role, SessionInfo, Tenant
from sessions.validation import valid_id
from storage.history_digest import history_digest
from storage.metadata_store import MessageRecord, MetadataStore, SessionRecord, TenantRecord

TenantRef = Tenant | str
"""A tenant as callers name it: the `Tenant` record, its id or its name."""
Placement = Callable[[TenantId, SessionId], str | None]
"""Where a session's cache is now (`device`, `host`, `disk`, or `None`)."""

TENANT_ID_PREFIX = "tn_"
SESSION_ID_PREFIX = "s_"
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
SESSION_NAME_RULE = "1-128 of A-Z a-z 0-9 _ . : - starting with a letter or digit, not starting 's_'"


def check_tenant_name(name: object) -> str:
    """A new tenant's name. Raises `InvalidInput` unless it is 1-64 of `A-Z a-z 0-9 _ . -`,
    starting alphanumeric, and not starting with the id prefix (so names and ids never clash)."""
    if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name) or name.startswith(TENANT_ID_PREFIX):
        raise InvalidInput(f"invalid tenant name {name!r}: use 1-64 of A-Z a-z 0-9 _ . - (not starting 'tn_')")
    return name


def check_session_name(name: object) -> str:
    """A client-chosen session id (`X-Session-ID` a tenant has not used). Raises `InvalidInput`
    unless it follows `SESSION_NAME_RULE` (the `s_` prefix is chatkv's own ids')."""
    if not isinstance(name, str) or not _SESSION_NAME.fullmatch(name) or name.startswith(SESSION_ID_PREFIX):
        raise InvalidInput(f"invalid session id {name!r}: a new session id must be {SESSION_NAME_RULE}")
    return name


class Registry:
    """Tenants and sessions as records (see the module docstring). Thread-safe: one database
    transaction per call.

    Args:
        metadata: the metadata database.
        placement: where a session's cache is; default: nowhere (no tier is reported).
    """

    def __init__(self, metadata: MetadataStore, placement: Placement | None = None) -> None:
        self.metadata = metadata
        self.placement: Placement = placement or (lambda tenant_id, session_id: None)

    # -- tenants -------------------------------------------------------------------------------

    def tenant_record(self, tenant: TenantRef) -> TenantRecord:
        """Raises `TenantNotFound` (`InvalidInput` for a reference that is not a tenant at all)."""
        if isinstance(tenant, Tenant):
            record = self.metadata.get_tenant(tenant_id=tenant.id)
        elif isinstance(tenant, str):
            if not valid_id(tenant):
                raise TenantNotFound(repr(tenant))
            record = self.metadata.get_tenant(tenant_id=tenant) if tenant.startswith(TENANT_ID_PREFIX) else None
            record = record or self.metadata.get_tenant(name=tenant)
        else:
            raise InvalidInput(f"tenant must be a Tenant, a tenant id or a name, got {type(tenant).__name__}")
        if record is None:
            raise TenantNotFound(tenant.name if isinstance(tenant, Tenant) else str(tenant))
        return record

    def tenant_id(self, tenant: TenantRef) -> TenantId:
        return TenantId(self.tenant_record(tenant).id)

    def tenant(self, tenant: TenantRef) -> Tenant:
        return tenant_of(self.tenant_record(tenant))

    def tenants(self) -> list[Tenant]:
        return [tenant_of(record) for record in self.metadata.list_tenants()]

    # -- sessions ------------------------------------------------------------------------------

    def session_record(self, tenant_id: TenantId, session_id: str) -> SessionRecord:
        """The tenant's session, by its id or the name its client chose. Raises `SessionNotFound`
        (for another tenant's id too)."""
        if not valid_id(session_id):
            raise SessionNotFound(repr(session_id))
        record = self.metadata.get_session(tenant_id=tenant_id, session_id=str(session_id))
        if record is None:
            raise SessionNotFound(str(session_id))
        return record

    def last_active(self, tenant_id: TenantId, session_id: SessionId) -> datetime | None:
        """When the session last ran a turn (or was made); `None` once it is gone."""
        record = self.metadata.get_session(tenant_id=tenant_id, session_id=session_id)
        return None if record is None else record.last_active_at

    def info(self, record: SessionRecord) -> SessionInfo:
        """The public record of a session, with where its cache is now."""
        return SessionInfo(
            id=SessionId(record.id),
            tenant_id=TenantId(record.tenant_id),
            title=record.title,
            system_prompt=record.system_prompt,
            model_fingerprint=record.model_fingerprint,
            token_count=record.token_count,
            message_count=record.message_count,
            created_at=record.created_at,
            last_active_at=record.last_active_at,
            tier=self.placement(TenantId(record.tenant_id), SessionId(record.id)),
            name=record.name,
            parent_id=SessionId(record.parent_id) if record.parent_id else None,
            fork_turns=record.fork_turns,
            origin=record.origin,
        )

    def sessions(self, tenant_id: TenantId | None = None, idle_before: datetime | None = None) -> list[SessionInfo]:
        """Sessions, most recently active first: the tenant's (`None`: every tenant's, for
        operators), optionally only those idle since before `idle_before`."""
        return [self.info(r) for r in self.metadata.list_sessions(tenant_id=tenant_id, idle_before=idle_before)]

    def message_records(self, tenant_id: TenantId, session_id: str) -> list[MessageRecord]:
        """The transcript in order. Raises `SessionNotFound`."""
        record = self.session_record(tenant_id, session_id)
        records = self.metadata.messages(tenant_id=tenant_id, session_id=record.id)
        if records is None:  # deleted since the read above
            raise SessionNotFound(str(session_id))
        return records

    def messages(self, tenant_id: TenantId, session_id: str) -> list[Message]:
        """The transcript as public records. Raises `SessionNotFound`."""
        return [message_of(record) for record in self.message_records(tenant_id, session_id)]

    def find_by_history(
        self, tenant_id: TenantId, system_prompt: str | None, turns: Sequence[tuple[str, str]]
    ) -> list[SessionId]:
        """The tenant's sessions whose history as their client saw it is exactly `system_prompt`
        and `turns` (user text, reply text as returned), most recently active first: one keyed
        query on the history digest (`storage.history_digest`). Without turns nothing is found."""
        if not turns:
            return []
        digest = history_digest(system_prompt, turns)
        return [SessionId(s) for s in self.metadata.sessions_by_history(tenant_id=tenant_id, history_digest=digest)]


def tenant_of(record: TenantRecord) -> Tenant:
    return Tenant(id=TenantId(record.id), name=record.name, created_at=record.created_at)


def message_of(record: MessageRecord) -> Message:
    return Message(
        index=record.index,
        role=cast(Role, record.role),
        text=record.text,
        token_ids=record.token_ids,
        created_at=record.created_at,
    )
