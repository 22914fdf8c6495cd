"""Encryption keys: a master key wraps one random AES-256 data key per tenant (envelope encryption).

- The master key comes from `CHATKV_MASTER_KEY` (base64 of 32 bytes) or from `master.key` in the
  chatkv home, created with mode 0600 on first start.
- Each tenant's data key is stored in the database wrapped (AES-256-GCM) by the master key, with
  the tenant id as associated data, so a wrapped key moved to another tenant does not unwrap.
- Blobs are sealed with the tenant's data key, a fresh 96-bit nonce each time, and associated
  data that binds tenant, cache name (session id), model fingerprint and format version.
- Rotating the master key re-wraps the data keys only; blobs are untouched. Destroying a tenant's
  wrapped data key makes its blobs unreadable wherever they are (crypto-shredding).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from storage.atomic_files import write_atomic
from storage.errors import StorageError
from storage.metadata_store import MetadataStore

KEY_BYTES = 32
NONCE_BYTES = 12
BLOB_MAGIC = b"CKVB1"
MASTER_KEY_FILE = "master.key"
NEXT_KEY_SUFFIX = ".next"


class KeyRingError(StorageError):
    """Base class of key-ring failures."""


class AuthenticationFailed(KeyRingError):
    """Ciphertext, nonce or associated data do not authenticate (tampered, moved, wrong key)."""


class NoDataKey(KeyRingError):
    """The tenant has no data key (deleted: its blobs are unreadable by design)."""


class BadMasterKey(KeyRingError, ValueError):
    """A master key that is not base64 of 32 bytes, or that does not unwrap the stored keys.

    Also a `ValueError`: it is a setting that cannot work (`CHATKV_MASTER_KEY`), and callers that
    turn a `SessionManager`'s bad settings into one message (`app/cli/home.load_manager`) catch it
    as one."""


def key_id(master_key: bytes) -> str:
    """Public identifier of a master key (not reversible): first 16 hex digits of its SHA-256."""
    return hashlib.sha256(b"chatkv-master-key-id\0" + master_key).hexdigest()[:16]


def parse_master_key(text: str) -> bytes:
    """Decode a base64 master key. Raises `BadMasterKey` unless it is 32 bytes."""
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadMasterKey("the master key must be base64 of 32 random bytes") from exc
    if len(raw) != KEY_BYTES:
        raise BadMasterKey(f"the master key must be 32 bytes, got {len(raw)}")
    return raw


def seal(key: bytes, plaintext: bytes, associated_data: bytes) -> bytes:
    """AES-256-GCM with a fresh random 96-bit nonce: `magic | nonce | ciphertext | tag`."""
    nonce = os.urandom(NONCE_BYTES)
    return BLOB_MAGIC + nonce + AESGCM(key).encrypt(nonce, plaintext, associated_data)


def open_sealed(key: bytes, blob: bytes, associated_data: bytes) -> bytes:
    """Inverse of `seal`. Raises `AuthenticationFailed` for any mismatch or truncation."""
    head = len(BLOB_MAGIC) + NONCE_BYTES
    if len(blob) < head + 16 or not blob.startswith(BLOB_MAGIC):
        raise AuthenticationFailed("not a sealed chatkv blob (bad magic or truncated)")
    view = memoryview(blob)  # slicing bytes would copy the whole ciphertext first
    try:
        return AESGCM(key).decrypt(view[len(BLOB_MAGIC) : head], view[head:], associated_data)
    except InvalidTag as exc:
        raise AuthenticationFailed("the blob does not authenticate") from exc


@dataclass(frozen=True)
class MasterKey:
    key: bytes
    id: str
    from_env: bool


def load_master_key(home: Path, env_value: str | None, in_use: set[str] | None = None) -> MasterKey:
    """The master key from `env_value` (base64), else `home/master.key`, created (0600) if absent.

    `in_use`: master key ids the database's wrapped keys name. If a rotation crashed after its
    database commit, `master.key.next` holds the key they name, and it is moved into place.

    Raises:
        BadMasterKey: if the value or file does not hold 32 base64-encoded bytes, or if there is
            neither and `in_use` is not empty: a new key would wrap nothing the database holds
            (a replica or CLI started without the deployment's `CHATKV_MASTER_KEY`, or a home
            whose key file was lost), so none is created.
    """
    if env_value:
        raw = parse_master_key(env_value)
        return MasterKey(raw, key_id(raw), True)
    path = home / MASTER_KEY_FILE
    staged = home / (MASTER_KEY_FILE + NEXT_KEY_SUFFIX)
    if staged.exists():
        staged_raw = parse_master_key(staged.read_text())
        if in_use and key_id(staged_raw) in in_use:
            staged.replace(path)
        else:
            staged.unlink()
    if not path.exists() and in_use:
        raise BadMasterKey(
            f"no master key in CHATKV_MASTER_KEY or {path}, and the database's tenants are wrapped by "
            f"master key id {', '.join(sorted(in_use))}: set CHATKV_MASTER_KEY to that key (every replica "
            "and CLI sharing the database needs it)"
        )
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            write_atomic(path, base64.b64encode(secrets.token_bytes(KEY_BYTES)) + b"\n", mode=0o600, exclusive=True)
    raw = parse_master_key(path.read_text())
    return MasterKey(raw, key_id(raw), False)


class TenantKeys:
    """Per-tenant data keys: created, unwrapped (and cached in memory), re-wrapped, destroyed."""

    def __init__(self, metadata: MetadataStore, master: MasterKey) -> None:
        self._metadata = metadata
        self._master = master
        self._cache: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @property
    def master(self) -> MasterKey:
        return self._master

    def new_wrapped_key(self, tenant_id: str) -> bytes:
        """A fresh random data key for `tenant_id`, wrapped by the master key."""
        data_key = secrets.token_bytes(KEY_BYTES)
        wrapped = seal(self._master.key, data_key, _wrap_aad(tenant_id))
        with self._lock:
            self._cache[tenant_id] = data_key
        return wrapped

    def data_key(self, tenant_id: str) -> bytes:
        """The tenant's data key. Raises `NoDataKey` (deleted tenant) or `AuthenticationFailed`
        (wrapped by another master key, or moved from another tenant)."""
        with self._lock:
            cached = self._cache.get(tenant_id)
        if cached is not None:
            return cached
        record = self._metadata.get_tenant(tenant_id=tenant_id)
        if record is None or record.wrapped_data_key is None:
            raise NoDataKey(f"tenant {tenant_id} has no data key")
        data_key = open_sealed(self._master.key, record.wrapped_data_key, _wrap_aad(tenant_id))
        with self._lock:
            self._cache[tenant_id] = data_key
        return data_key

    def forget(self, tenant_id: str) -> None:
        with self._lock:
            self._cache.pop(tenant_id, None)

    def rewrap_all(self, new_master: MasterKey) -> dict[str, tuple[bytes, str]]:
        """Every tenant's data key wrapped by `new_master` (nothing is written here).

        Raises:
            AuthenticationFailed: if a stored key does not unwrap with the current master key.
        """
        rewrapped: dict[str, tuple[bytes, str]] = {}
        for record in self._metadata.list_tenants():
            if record.wrapped_data_key is None:
                continue
            data_key = open_sealed(self._master.key, record.wrapped_data_key, _wrap_aad(record.id))
            rewrapped[record.id] = (seal(new_master.key, data_key, _wrap_aad(record.id)), new_master.id)
        return rewrapped

    def use_master(self, new_master: MasterKey) -> None:
        self._master = new_master


def _wrap_aad(tenant_id: str) -> bytes:
    return f"chatkv-data-key|tenant={tenant_id}".encode()


def blob_aad(tenant_id: str, name: str, model_fingerprint: str, format_version: int) -> bytes:
    """Associated data of a cache blob: what it belongs to, so a moved or stale blob fails."""
    return f"chatkv-cache|v={format_version}|tenant={tenant_id}|name={name}|model={model_fingerprint}".encode()
