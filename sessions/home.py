"""A chatkv home as the faces see it: who holds it, and the files a server keeps there. One
process owns a home at a time (`storage.home_lock`); the CLI refuses to open a home a live server
holds and names that server, and `chatkv serve` holds the home's lock while it runs.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from sessions.errors import HomeLocked
from storage import home_lock
from storage.atomic_files import write_atomic
from storage.home_lock import HomeLockedError, LockOwner, describe_owner, read_owner, recovery_hint

ADMIN_TOKEN_FILE = "admin.token"

__all__ = [
    "ADMIN_TOKEN_FILE",
    "HomeLock",
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


def check_unlocked(home: Path) -> None:
    """Raises `HomeLocked` if another live process (a server, or one with a `SessionManager` open)
    holds `home`."""
    try:
        home_lock.check_unlocked(home)
    except HomeLockedError as exc:
        raise HomeLocked(exc.holder, exc.owner.url, exc.recovery) from None


class HomeLock(home_lock.HomeLock):
    """`storage.home_lock.HomeLock`, refusing a home another live process holds with `HomeLocked`."""

    def acquire(self) -> HomeLock:
        try:
            super().acquire()
        except HomeLockedError as exc:
            raise HomeLocked(exc.holder, exc.owner.url, exc.recovery) from None
        return self
