"""Master-key rotation: re-wrap every tenant's data key, never touching the blobs.

Crash safety: the new key is written beside the old one (`master.key.next`) before the database
commit, and moved over `master.key` after it. Start-up (`storage.keyring.load_master_key`) picks
whichever of the two the database's `master_key_id` names, so a crash at any step leaves a
readable state.
"""

from __future__ import annotations

import base64
import secrets
from typing import TYPE_CHECKING

from sessions.errors import InvalidInput, KeyMismatch
from storage.atomic_files import fsync_dir, write_atomic
from storage.keyring import (
    KEY_BYTES,
    MASTER_KEY_FILE,
    NEXT_KEY_SUFFIX,
    AuthenticationFailed,
    BadMasterKey,
    MasterKey,
    key_id,
    parse_master_key,
)

if TYPE_CHECKING:
    from sessions.manager import SessionManager


def rotate_master_key(manager: SessionManager, new_master_key: str | None) -> str:
    """See `SessionManager.rotate_master_key`. Returns the new key id.

    Raises:
        InvalidInput: if `new_master_key` is malformed, or missing while the current key comes
            from `CHATKV_MASTER_KEY`.
    """
    current = manager.keys.master
    if new_master_key is None:
        if current.from_env:
            raise InvalidInput("the master key comes from CHATKV_MASTER_KEY: pass the new key explicitly")
        raw = secrets.token_bytes(KEY_BYTES)
    elif not isinstance(new_master_key, str):
        raise InvalidInput("the new master key must be a base64 string of 32 bytes")
    else:
        try:
            raw = parse_master_key(new_master_key)
        except BadMasterKey as exc:
            raise InvalidInput(str(exc)) from None
    new = MasterKey(raw, key_id(raw), current.from_env)
    try:
        rewrapped = manager.keys.rewrap_all(new)
    except AuthenticationFailed:
        raise KeyMismatch(
            "a tenant's data key does not unwrap with the current master key; start chatkv with the key "
            "that wrapped it (CHATKV_MASTER_KEY) before rotating"
        ) from None
    home = manager.settings.home
    key_file = home / MASTER_KEY_FILE
    staged = home / (MASTER_KEY_FILE + NEXT_KEY_SUFFIX)
    if not current.from_env:
        write_atomic(staged, base64.b64encode(raw) + b"\n", mode=0o600)
    manager.metadata.set_tenant_keys(wrapped=rewrapped)
    if not current.from_env:
        staged.replace(key_file)
        fsync_dir(home)
    manager.keys.use_master(new)
    return new.id
