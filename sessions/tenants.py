"""Tenants and their keys: creation with a fresh data key, API keys, crypto-shredding deletion and
master-key rotation. Lookups go through the registry (`sessions.registry`), where the rules that
name a tenant live.

Master-key rotation re-wraps every tenant's data key and never touches the blobs. Crash safety:
the new key is written beside the old one (`master.key.next`) before the database commit, and
moved over `master.key` after it; start-up (`storage.keyring.load_master_key`) picks whichever of
the two the database's `master_key_id` names, so a crash at any step leaves a readable state.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Engine as Database

from cache.ids import TenantId
from sessions.errors import InvalidInput, KeyMismatch, TenantExists, TenantNotFound
from sessions.records import Tenant
from sessions.registry import TENANT_ID_PREFIX, Registry, TenantRef, check_tenant_name, tenant_of
from storage.atomic_files import fsync_dir, write_atomic
from storage.database import secure_erase_freed_pages
from storage.errors import AlreadyExists
from storage.keyring import (
    KEY_BYTES,
    MASTER_KEY_FILE,
    NEXT_KEY_SUFFIX,
    AuthenticationFailed,
    BadMasterKey,
    MasterKey,
    TenantKeys,
    key_id,
    parse_master_key,
)
from storage.metadata_store import MetadataStore

API_KEY_PREFIX = "ckv_"
_API_KEY = re.compile(rf"{API_KEY_PREFIX}({TENANT_ID_PREFIX}[0-9a-f]+)_([A-Za-z0-9_-]+)")


class Tenants:
    """Tenant lifecycle and keys. Thread-safe.

    Args:
        registry: tenant lookups.
        metadata: the metadata database (tenant rows, wrapped keys, API key hashes).
        keys: the tenants' data keys under the master key.
        database: the SQLAlchemy engine of `metadata` (freed pages are erased after a deletion).
        home: the chatkv home (the master key file lives there unless it comes from the environment).
        forget_caches: drops everything a tenant has beside its rows (turns in flight cancelled,
            caches in every tier, transcripts); called before and after the rows are deleted, so
            a turn that committed in between is forgotten too.
        remove_files: removes the tenant's folder of disk blobs, once its rows are gone.
    """

    def __init__(
        self,
        *,
        registry: Registry,
        metadata: MetadataStore,
        keys: TenantKeys,
        database: Database,
        home: Path,
        forget_caches: Callable[[TenantId], None],
        remove_files: Callable[[TenantId], None],
    ) -> None:
        self._registry = registry
        self._metadata = metadata
        self.keys = keys
        self._database = database
        self._home = home
        self._forget_caches = forget_caches
        self._remove_files = remove_files
        # A rotation must not re-wrap keys while a new tenant's key is being wrapped.
        self._key_lock = threading.Lock()

    def create(self, name: str) -> Tenant:
        """Create a tenant with a fresh data-encryption key.

        Raises:
            InvalidInput: if the name is not 1-64 of `A-Z a-z 0-9 _ . -` (starting alphanumeric).
            TenantExists: if the name is taken.
        """
        check_tenant_name(name)
        tenant_id = TenantId(TENANT_ID_PREFIX + secrets.token_hex(8))
        with self._key_lock:
            wrapped = self.keys.new_wrapped_key(tenant_id)
            try:
                record = self._metadata.create_tenant(
                    tenant_id=tenant_id, name=name, wrapped_data_key=wrapped, master_key_id=self.keys.master.id
                )
            except AlreadyExists:
                self.keys.forget(tenant_id)
                raise TenantExists(f"tenant exists: {name}") from None
        return tenant_of(record)

    def delete(self, tenant: TenantRef) -> None:
        """Crypto-shred, then delete: the data key is destroyed first, so blobs that survive
        anywhere are unreadable; then caches, files and rows go."""
        tenant_id = self._registry.tenant_id(tenant)
        self._metadata.set_tenant_key(tenant_id=tenant_id, wrapped_data_key=None, master_key_id=None)
        self.keys.forget(tenant_id)
        self._forget_caches(tenant_id)
        self._metadata.delete_tenant(tenant_id=tenant_id)
        secure_erase_freed_pages(self._database)
        self._forget_caches(tenant_id)  # a turn that committed in between
        self._remove_files(tenant_id)

    def issue_api_key(self, tenant: TenantRef) -> str:
        """A new API key for the tenant (shown once; only a salted hash is stored). Replaces the old one."""
        tenant_id = self._registry.tenant_id(tenant)
        secret = secrets.token_urlsafe(24)
        salt = secrets.token_bytes(16)
        self._metadata.set_api_key(tenant_id=tenant_id, salt=salt, digest=_api_key_digest(salt, secret))
        return f"{API_KEY_PREFIX}{tenant_id}_{secret}"

    def for_api_key(self, api_key: str) -> Tenant:
        """The tenant an API key belongs to. Raises `TenantNotFound` for any wrong or unknown key
        (the same error and message either way, and the same work: a hash is always computed)."""
        match = _API_KEY.fullmatch(api_key if isinstance(api_key, str) else "")
        record = self._metadata.get_tenant(tenant_id=match.group(1)) if match else None
        secret = match.group(2) if match else ""
        salt = record.api_key_salt if record and record.api_key_salt else b"\0" * 16
        expected = record.api_key_hash if record and record.api_key_hash else b""
        if not hmac.compare_digest(_api_key_digest(salt, secret), expected) or record is None:
            raise TenantNotFound()
        return tenant_of(record)

    def rotate_master_key(self, new_master_key: str | None = None) -> str:
        """Re-wrap every tenant's data key under a new master key; blobs are untouched.

        Args:
            new_master_key: base64 of 32 bytes; required when the current key comes from
                `CHATKV_MASTER_KEY` (set the variable to it before the next start), else generated
                and written to `master.key`.

        Returns:
            The new key's id.

        Raises:
            InvalidInput: if `new_master_key` is malformed, or missing while the current key comes
                from `CHATKV_MASTER_KEY`.
            KeyMismatch: if a tenant's data key does not unwrap with the current master key.
        """
        with self._key_lock:
            current = self.keys.master
            raw = _new_master_key_bytes(new_master_key, current)
            new = MasterKey(raw, key_id(raw), current.from_env)
            try:
                rewrapped = self.keys.rewrap_all(new)
            except AuthenticationFailed:
                raise KeyMismatch(
                    "a tenant's data key does not unwrap with the current master key; start chatkv with the key "
                    "that wrapped it (CHATKV_MASTER_KEY) before rotating"
                ) from None
            key_file = self._home / MASTER_KEY_FILE
            staged = self._home / (MASTER_KEY_FILE + NEXT_KEY_SUFFIX)
            if not current.from_env:
                write_atomic(staged, base64.b64encode(raw) + b"\n", mode=0o600)
            self._metadata.set_tenant_keys(wrapped=rewrapped)
            if not current.from_env:
                staged.replace(key_file)
                fsync_dir(self._home)
            self.keys.use_master(new)
            return new.id


def _new_master_key_bytes(new_master_key: str | None, current: MasterKey) -> bytes:
    """The raw bytes of the key to rotate to. Raises `InvalidInput`."""
    if new_master_key is None:
        if current.from_env:
            raise InvalidInput("the master key comes from CHATKV_MASTER_KEY: pass the new key explicitly")
        return secrets.token_bytes(KEY_BYTES)
    if not isinstance(new_master_key, str):
        raise InvalidInput("the new master key must be a base64 string of 32 bytes")
    try:
        return parse_master_key(new_master_key)
    except BadMasterKey as exc:
        raise InvalidInput(str(exc)) from None


def _api_key_digest(salt: bytes, secret: str) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", secret.encode(), salt, 10_000)
