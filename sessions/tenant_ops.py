"""Tenants of a `SessionManager`: creation with a fresh data key, lookup by id or name, API keys,
crypto-shredding deletion and master-key rotation. `TenantOps` is a base class of
`SessionManager` (sessions/manager.py), which sets the attributes it declares."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, cast

from sqlalchemy import Engine as DatabaseEngine

from cache.ids import SessionId, TenantId
from cache.tier_manager import TierManager
from cache.tiers import CacheKey
from sessions.errors import InvalidInput, ManagerClosed, TenantExists, TenantNotFound
from sessions.records import Tenant
from sessions.settings import Settings
from sessions.turn.runner import TurnRunner
from sessions.turn.transcript import Transcript
from sessions.validation import valid_id
from storage.blob_stores import DiskBlobStore
from storage.database import secure_erase_freed_pages
from storage.errors import AlreadyExists
from storage.keyring import TenantKeys
from storage.metadata_store import MetadataStore, TenantRecord

if TYPE_CHECKING:  # the manager derives from this class
    from sessions.manager import SessionManager

TenantRef = Tenant | str
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_ID_PREFIX_TENANT = "tn_"
_API_KEY_PREFIX = "ckv_"


class TenantOps:
    """Tenant operations of `SessionManager`."""

    settings: Settings
    metadata: MetadataStore
    keys: TenantKeys
    tiers: TierManager
    runner: TurnRunner
    disk_store: DiskBlobStore[CacheKey]
    _db: DatabaseEngine
    _lock: threading.Lock
    _key_lock: threading.Lock
    _closed: bool
    _transcripts: OrderedDict[tuple[TenantId, SessionId], Transcript]

    # -- tenants -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosed("the chatkv manager is closed")

    def create_tenant(self, name: str) -> Tenant:
        """Create a tenant with a fresh data-encryption key.

        Raises:
            InvalidInput: if the name is not 1-64 of `A-Z a-z 0-9 _ . -` (starting alphanumeric).
            TenantExists: if the name is taken.
        """
        self._check_open()
        if not isinstance(name, str) or not _TENANT_NAME.fullmatch(name) or name.startswith(_ID_PREFIX_TENANT):
            raise InvalidInput(f"invalid tenant name {name!r}: use 1-64 of A-Z a-z 0-9 _ . - (not starting 'tn_')")
        tenant_id = TenantId(_ID_PREFIX_TENANT + secrets.token_hex(8))
        with self._key_lock:  # a rotation must not re-wrap keys while a new one is wrapped
            wrapped = self.keys.new_wrapped_key(tenant_id)
            try:
                record = self.metadata.create_tenant(
                    tenant_id=tenant_id, name=name, wrapped_data_key=wrapped, master_key_id=self.keys.master.id
                )
            except AlreadyExists:
                self.keys.forget(tenant_id)
                raise TenantExists(f"tenant exists: {name}") from None
        return _tenant(record)

    def list_tenants(self) -> list[Tenant]:
        return [_tenant(record) for record in self.metadata.list_tenants()]

    def get_tenant(self, tenant: TenantRef) -> Tenant:
        """Resolve a `Tenant`, tenant id or tenant name. Raises `TenantNotFound`."""
        return _tenant(self._tenant_record(tenant))

    def _tenant_record(self, tenant: TenantRef) -> TenantRecord:
        if isinstance(tenant, Tenant):
            record = self.metadata.get_tenant(tenant_id=tenant.id)
        elif isinstance(tenant, str):
            if not valid_id(tenant):
                raise TenantNotFound(repr(tenant))
            record = self.metadata.get_tenant(tenant_id=tenant) if tenant.startswith(_ID_PREFIX_TENANT) else None
            record = record or self.metadata.get_tenant(name=tenant)
        else:
            raise InvalidInput(f"tenant must be a Tenant, a tenant id or a name, got {type(tenant).__name__}")
        if record is None:
            raise TenantNotFound(tenant.name if isinstance(tenant, Tenant) else str(tenant))
        return record

    def _tenant_id(self, tenant: TenantRef) -> TenantId:
        return TenantId(self._tenant_record(tenant).id)

    def delete_tenant(self, tenant: TenantRef) -> None:
        """Crypto-shred, then delete: the data key is destroyed first, so blobs that survive
        anywhere are unreadable; then caches, files and rows go."""
        tenant_id = self._tenant_id(tenant)
        self.metadata.set_tenant_key(tenant_id=tenant_id, wrapped_data_key=None, master_key_id=None)
        self.keys.forget(tenant_id)
        self.runner.cancel_requests(tenant_id)
        self.tiers.forget_tenant(tenant_id)
        with self._lock:
            for key in [k for k in self._transcripts if k[0] == tenant_id]:
                del self._transcripts[key]
        self.metadata.delete_tenant(tenant_id=tenant_id)
        secure_erase_freed_pages(self._db)
        self.tiers.forget_tenant(tenant_id)  # a turn that committed in between
        self.disk_store.remove_tenant_folder(tenant_id)

    def issue_api_key(self, tenant: TenantRef) -> str:
        """A new API key for the tenant (shown once; only a salted hash is stored). Replaces the old one."""
        tenant_id = self._tenant_id(tenant)
        secret = secrets.token_urlsafe(24)
        salt = secrets.token_bytes(16)
        self.metadata.set_api_key(tenant_id=tenant_id, salt=salt, digest=_api_key_digest(salt, secret))
        return f"{_API_KEY_PREFIX}{tenant_id}_{secret}"

    def tenant_for_api_key(self, api_key: str) -> Tenant:
        """The tenant an API key belongs to. Raises `TenantNotFound` for any wrong or unknown key
        (the same error and message either way)."""
        text = api_key if isinstance(api_key, str) else ""
        match = re.fullmatch(rf"{_API_KEY_PREFIX}({_ID_PREFIX_TENANT}[0-9a-f]+)_([A-Za-z0-9_-]+)", text)
        record = self.metadata.get_tenant(tenant_id=match.group(1)) if match else None
        secret = match.group(2) if match else ""
        salt = record.api_key_salt if record and record.api_key_salt else b"\0" * 16
        expected = record.api_key_hash if record and record.api_key_hash else b""
        if not hmac.compare_digest(_api_key_digest(salt, secret), expected) or record is None:
            raise TenantNotFound()
        return _tenant(record)

    def rotate_master_key(self, new_master_key: str | None = None) -> str:
        """Re-wrap every tenant's data key under a new master key; blobs are untouched.

        Args:
            new_master_key: base64 of 32 bytes; required when the current key comes from
                `CHATKV_MASTER_KEY` (set the variable to it before the next start), else generated
                and written to `master.key`.

        Returns:
            The new key's id.
        """
        from sessions.key_rotation import rotate_master_key

        with self._key_lock:
            return rotate_master_key(cast("SessionManager", self), new_master_key)


def _tenant(record: TenantRecord) -> Tenant:
    return Tenant(id=TenantId(record.id), name=record.name, created_at=record.created_at)


def _api_key_digest(salt: bytes, secret: str) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", secret.encode(), salt, 10_000)
