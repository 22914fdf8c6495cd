"""The shared model cache: models converted once per machine, not once per chatkv home.

A converted model (the bundled GGUF dequantised into a safetensors directory, about 0.5 GB for
SmolLM2-135M-Instruct in float32) lives in one directory that every home on the machine reads
(`Settings.model_cache_dir`, default `~/.cache/chatkv/models`, like `HF_HOME` for the hub's files).
Two processes may start at once on a cold cache (two replicas, a server and a CLI command): the
conversion holds a file lock beside its target, and the result is built in a temporary sibling and
renamed into place, so the second process waits and then reads the first one's copy, and a crash
never leaves a half-written directory where a complete one is expected.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

from sessions.errors import ModelUnavailable

log = logging.getLogger(__name__)

COMPLETE_MARKER = "chatkv-converted.json"
"""Written last into a converted directory (before its rename): its presence means complete."""

CONVERSION_WAIT_S = 900.0
"""How long a process waits for another one's conversion of the same model before giving up."""


def lock_path(target: Path) -> Path:
    """The lock file guarding the conversion into `target` (a hidden sibling)."""
    return target.parent / f".{target.name}.lock"


def is_complete(target: Path) -> bool:
    return (target / COMPLETE_MARKER).is_file()


def old_home_copy(home: Path, model_cache_dir: Path) -> Path | None:
    """A converted model left in `home/models` by versions before the shared cache (about 0.5 GB
    each), when this home now reads another cache; `None` if there is none."""
    old = home / "models"
    if old.resolve() == model_cache_dir.resolve() or not old.is_dir():
        return None
    return old if any(is_complete(entry) for entry in old.iterdir() if entry.is_dir()) else None


STAGING_SUFFIX_CHARS = 8
"""`tempfile.mkdtemp` names its folders prefix + 8 random characters."""


def publish_once(target: Path, build: Callable[[Path], str], *, wait_s: float = CONVERSION_WAIT_S) -> bool:
    """Make the directory `target` with `build` unless a complete one is already there.

    `build(staging)` writes the directory's files into the empty folder `staging` and returns the
    text of its completion marker (JSON saying what it was made from). It runs at most once at a
    time per target across processes (a file lock); a process that waited finds the target complete
    and does not build again.

    Returns:
        True if this call built the target, False if it was already complete.

    Raises:
        ModelUnavailable: if another process held the lock longer than `wait_s` seconds.
        Whatever `build` raises (the target is then left as it was).
    """
    if is_complete(target):
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(lock_path(target), timeout=wait_s):
            if is_complete(target):
                return False
            if target.exists():  # an incomplete copy (made by hand, or by a version without the marker)
                shutil.rmtree(target)
            # Staging folders of builds killed before their rename (an OOM kill mid-conversion):
            # holding the lock, no build of this target is running, so they are garbage.
            # The length check keeps another target's ("model-v2": ".model-v2-xxxxxxxx") apart.
            prefix = f".{target.name}-"
            for stale in target.parent.glob(f"{prefix}*"):
                if stale.is_dir() and len(stale.name) == len(prefix) + STAGING_SUFFIX_CHARS:
                    shutil.rmtree(stale, ignore_errors=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
            try:
                marker = build(staging)
                (staging / COMPLETE_MARKER).write_text(marker)
                staging.rename(target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except Timeout:
        raise ModelUnavailable(
            f"another process has been converting the model into {target} for over {wait_s:.0f} s "
            f"(its lock: {lock_path(target)}); if none is running, remove that lock file"
        ) from None
    return True
