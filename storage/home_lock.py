"""The lock a server process holds on its chatkv home, so admin commands without `--server`
refuse to change stores a running process owns.

The lock file (`server.lock`, JSON with pid and URL) is created exclusively; a lock whose pid is
no longer alive is stale and is taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = "server.lock"


class HomeLockedError(Exception):
    """Another live process holds the home."""

    def __init__(self, owner: LockOwner) -> None:
        super().__init__(
            f"a chatkv server (pid {owner.pid}, {owner.url or 'no URL'}) holds this home; "
            "use --server URL (or CHATKV_SERVER) to go through its admin API"
        )
        self.owner = owner


@dataclass(frozen=True)
class LockOwner:
    pid: int
    url: str | None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_owner(home: Path) -> LockOwner | None:
    """The live owner of `home`, or `None` (no lock, or a stale one)."""
    path = home / LOCK_FILE
    try:
        data = json.loads(path.read_text())
        owner = LockOwner(int(data["pid"]), data.get("url"))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    return owner if owner.pid != os.getpid() and _alive(owner.pid) else None


def check_unlocked(home: Path) -> None:
    """Raises `HomeLockedError` if a live server holds `home`."""
    owner = read_owner(home)
    if owner is not None:
        raise HomeLockedError(owner)


class HomeLock:
    """Hold `home` for this process (a context manager). Raises `HomeLockedError` if held."""

    def __init__(self, home: Path, url: str | None = None) -> None:
        self.path = home / LOCK_FILE
        self.url = url

    def __enter__(self) -> HomeLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = json.dumps({"pid": os.getpid(), "url": self.url}).encode()
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                check_unlocked(self.path.parent)
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()  # stale: its owner is gone
                continue
            with os.fdopen(fd, "wb") as handle:
                handle.write(payload)
            return self
        owner = read_owner(self.path.parent)
        raise HomeLockedError(owner or LockOwner(-1, None))

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(FileNotFoundError):
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
