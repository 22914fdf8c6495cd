"""The home lock tells its holder from an unrelated process that was given the same pid later."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.home_lock import LOCK_FILE, HomeLock, HomeLockedError, check_unlocked, process_started, read_owner


@pytest.fixture
def other_process() -> Iterator[int]:
    """The pid of a live process that is not chatkv."""
    if process_started(os.getpid()) is None:
        pytest.skip("no /proc here: the lock compares pids only")
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()


def _write_lock(home: Path, **fields: object) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / LOCK_FILE).write_text(json.dumps({"url": "http://127.0.0.1:7999", **fields}))


def test_the_lock_records_the_holders_start_time(tmp_path: Path) -> None:
    with HomeLock(tmp_path, "http://127.0.0.1:1"):
        recorded = json.loads((tmp_path / LOCK_FILE).read_text())
    assert recorded == {"pid": os.getpid(), "url": "http://127.0.0.1:1", "started": process_started(os.getpid())}


def test_a_lock_whose_pid_now_names_another_process_is_stale(tmp_path: Path, other_process: int) -> None:
    boot_id = str(process_started(other_process)).split(":")[0]
    _write_lock(tmp_path, pid=other_process, started=f"{boot_id}:1")  # the holder started at boot + 1 tick
    assert read_owner(tmp_path) is None
    check_unlocked(tmp_path)
    with HomeLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_of_a_live_holder_holds_and_the_error_says_how_to_recover(tmp_path: Path, other_process: int) -> None:
    for started in (process_started(other_process), None):  # the holder itself, or a lock without a start time
        _write_lock(tmp_path, pid=other_process, started=started)
        with pytest.raises(HomeLockedError) as held:
            HomeLock(tmp_path).acquire()
        assert str(held.value) == (
            f"a chatkv server (pid {other_process}, http://127.0.0.1:7999) holds this home; use --server URL "
            f"(or CHATKV_SERVER) to go through its admin API "
            f"(if pid {other_process} is not a chatkv process, delete {tmp_path / LOCK_FILE})"
        )
