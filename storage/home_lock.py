"""The lock a process holds on its chatkv home (any `SessionManager`, and the server), so another
process (admin commands without `--server`, a second server or embedded manager) refuses to touch
stores a running process owns.

The lock file (`server.lock`, JSON with pid and URL) is created exclusively; a lock whose pid is
no longer alive is stale and is taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
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


_held: dict[Path, int] = {}
"""Homes this process holds, with how many holders (managers, a server) hold each."""
_held_lock = threading.Lock()


class HomeLock:
    """Hold `home` for this process (re-entrant within it: managers and the server of one process
    share the lock; the file goes when the last holder releases it). A context manager.

    Raises:
        HomeLockedError: if another live process holds the home.
    """

    def __init__(self, home: Path, url: str | None = None) -> None:
        self.path = home / LOCK_FILE
        self.url = url
        self._key = home.expanduser().resolve()
        self._held = False

    def acquire(self) -> HomeLock:
        with _held_lock:
            if _held.get(self._key):
                _held[self._key] += 1
                if self.url:
                    self._write_owner()  # the server names its URL in the lock this process holds
            else:
                self._create()
                _held[self._key] = 1
        self._held = True
        return self

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        with _held_lock:
            _held[self._key] -= 1
            if _held[self._key] > 0:
                return
            del _held[self._key]
            with contextlib.suppress(FileNotFoundError, ValueError):
                if json.loads(self.path.read_text()).get("pid") == os.getpid():
                    self.path.unlink()

    def _payload(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "url": self.url}).encode()

    def _write_owner(self) -> None:
        self.path.write_bytes(self._payload())

    def _create(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                check_unlocked(self.path.parent)
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()  # stale (its owner is gone) or this process's own leftover
                continue
            with os.fdopen(fd, "wb") as handle:
                handle.write(self._payload())
            return
        owner = read_owner(self.path.parent)
        raise HomeLockedError(owner or LockOwner(-1, None))

    def __enter__(self) -> HomeLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
