"""The lock a process holds on its chatkv home (any `SessionManager`, and the server), so another
process (admin commands without `--server`, a second server or embedded manager) refuses to touch
stores a running process owns.

The lock file (`server.lock`, JSON with pid, URL and the process's start time) is created
exclusively; a lock whose process is gone is stale and is taken over. A pid alone does not name a
process: after a crash and a restart (of the machine, or of a container, where pids start again
at 1) the recorded pid can belong to an unrelated live process. So the lock also records the
process's start time (field 22 of `/proc/<pid>/stat`, clock ticks since boot) with the boot id,
and a lock whose pid now has another start time is stale too. Without `/proc` (or for a lock
written without a start time) only the pid is compared, and the error says how to recover.

The lock also names what the holder runs (`chatkv serve`, `gunicorn`, `python -m uvicorn`: see
`program_name`), so the error can say who holds the home; each layer adds its own advice (the CLI:
`--server`; `SessionManager`: the holder's HTTP API).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from storage.errors import StorageError

LOCK_FILE = "server.lock"


class HomeLockedError(StorageError):
    """Another live process holds the home. `holder` names it in words (`describe_owner`),
    `recovery` says what to do if it is not a chatkv process; the callers add their own advice."""

    def __init__(self, owner: LockOwner, home: Path) -> None:
        self.owner = owner
        self.holder = describe_owner(owner)
        self.recovery = recovery_hint(home, owner)
        super().__init__(f"{self.holder} holds this home ({self.recovery})")


@dataclass(frozen=True)
class LockOwner:
    pid: int
    url: str | None
    """The server's URL; `None` for a process that only has a `SessionManager` open (embedded)."""
    started: str | None = None
    """`<boot id>:<start time in clock ticks>` of the process, `None` where unknown."""
    program: str | None = None
    """What the process runs (`program_name`), `None` for a lock written without it."""


def describe_owner(owner: LockOwner) -> str:
    """The holder in words: `the chatkv server at http://127.0.0.1:7860 (pid 12, chatkv serve)`,
    `process 12 (gunicorn) with an open SessionManager`, or `another process` when the lock could
    not be read."""
    if owner.pid < 0:
        return "another process"
    if owner.url:
        what = f"pid {owner.pid}, {owner.program}" if owner.program else f"pid {owner.pid}"
        return f"the chatkv server at {owner.url} ({what})"
    program = f" ({owner.program})" if owner.program else ""
    return f"process {owner.pid}{program} with an open SessionManager"


def recovery_hint(home: Path, owner: LockOwner) -> str:
    """What to do when the lock's pid is not a chatkv process (a lock this process cannot tell is stale)."""
    return f"if pid {owner.pid} is not a chatkv process, delete {home / LOCK_FILE}"


_WORD = re.compile(r"[a-z][a-z0-9_-]{0,31}")


def program_name(argv: Sequence[str] | None = None) -> str:
    """What a process runs, in a few words, from its command line (default: this process's):
    `chatkv serve`, `gunicorn`, `python -m uvicorn`, `worker.py`, `python -c`. Only the program and
    a subcommand-like word are kept: the rest of a command line may hold secrets (tokens, keys)."""
    args = list(sys.orig_argv if argv is None else argv)
    if not args:
        return "python"
    words, rest = [Path(args[0]).name], args[1:]
    if words[0].startswith("python"):
        if rest[:1] == ["-c"]:
            return f"{words[0]} -c"
        if rest[:1] == ["-m"] and len(rest) > 1:
            words, rest = [words[0], "-m", rest[1]], rest[2:]
        elif rest and not rest[0].startswith("-"):
            words, rest = [Path(rest[0]).name], rest[1:]
    if rest and _WORD.fullmatch(rest[0]):
        words.append(rest[0])
    return " ".join(words)


def process_started(pid: int) -> str | None:
    """`<boot id>:<start time>` of a process (see the module docstring); `None` without `/proc`, or
    once the process is gone."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 (the command name) is in parentheses and may hold spaces and ')'; field 3 follows the last ')'.
    fields = stat[stat.rindex(")") + 1 :].split()
    return f"{boot_id}:{fields[22 - 3]}"


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
        pid = int(data["pid"])
        program = data.get("program") if isinstance(data.get("program"), str) else None
        owner = LockOwner(pid, data.get("url"), data.get("started"), program)
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    return owner if owner.pid != os.getpid() and _holds(owner) else None


def _holds(owner: LockOwner) -> bool:
    """Whether the process that wrote the lock still runs: its pid is alive and, where both start
    times are known, it is the same process (not a later one that was given the same pid)."""
    if not _alive(owner.pid):
        return False
    started = process_started(owner.pid)
    return owner.started is None or started is None or owner.started == started


def check_unlocked(home: Path) -> None:
    """Raises `HomeLockedError` if another live process (a server, or one with a `SessionManager`
    open) holds `home`."""
    owner = read_owner(home)
    if owner is not None:
        raise HomeLockedError(owner, home)


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
        pid = os.getpid()
        payload = {"pid": pid, "url": self.url, "started": process_started(pid), "program": program_name()}
        return json.dumps(payload).encode()

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
        raise HomeLockedError(owner or LockOwner(-1, None), self.path.parent)

    def __enter__(self) -> HomeLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
