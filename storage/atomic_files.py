"""Crash-safe file writes: temp file in the same folder, fsync, rename, fsync of the folder.

A crash at any point leaves either the old file or the new one, never a torn one; leftovers are
temp files (prefix `.tmp-`) that start-up removes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

TEMP_PREFIX = ".tmp-"


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | bytearray, mode: int = 0o600, exclusive: bool = False) -> None:
    """Write `data` to `path` atomically with permissions `mode`.

    `exclusive`: fail with `FileExistsError` if `path` exists (first writer wins).
    """
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=folder)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if exclusive:
            os.link(temp, path)
        else:
            os.replace(temp, path)
        fsync_dir(folder)
    finally:
        # After a rename the temp name is gone; after a failure (or a hard link) it is removed.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def remove_temp_files(folder: Path) -> list[Path]:
    """Remove temp files a crash left directly in `folder` (e.g. a half-written key file)."""
    removed = []
    for path in folder.glob(TEMP_PREFIX + "*"):
        if path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
