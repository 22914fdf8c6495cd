"""A chatkv home as the faces see it: who holds it, and the files a server keeps there. One
process owns a home at a time (`storage.home_lock`); the CLI refuses to open a home a live server
holds and names that server, and `chatkv serve` holds the home's lock while it runs.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from storage.atomic_files import write_atomic
from storage.home_lock import (
    HomeLock,
    HomeLockedError,
    LockOwner,
    check_unlocked,
    describe_owner,
    read_owner,
    recovery_hint,
)

ADMIN_TOKEN_FILE = "admin.token"

__all__ = [
    "ADMIN_TOKEN_FILE",
    "HomeLock",
    "HomeLockedError",
    "LockOwner",
    "admin_token",
    "check_unlocked",
    "describe_owner",
    "read_owner",
    "recovery_hint",
]


def admin_token(home: Path, configured: str | None) -> str:
    """The admin token: `configured` (`CHATKV_ADMIN_TOKEN`), else `home/admin.token`, generated with
    mode 0600 on first start."""
    if configured:
        return configured
    path = home / ADMIN_TOKEN_FILE
    if not path.exists():
        write_atomic(path, secrets.token_urlsafe(32).encode() + b"\n", mode=0o600)
    return path.read_text().strip()
