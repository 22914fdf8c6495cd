"""The home lock tells its holder from an unrelated process that was given the same pid later."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.home_lock import (
    LOCK_FILE,
    HomeLock,
    HomeLockedError,
    LockOwner,
    check_unlocked,
    describe_owner,
    process_started,
    program_name,
    read_owner,
)


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


def test_the_lock_records_the_holders_start_time_and_program(tmp_path: Path) -> None:
    with HomeLock(tmp_path, "http://127.0.0.1:1"):
        recorded = json.loads((tmp_path / LOCK_FILE).read_text())
    assert recorded == {
        "pid": os.getpid(),
        "url": "http://127.0.0.1:1",
        "started": process_started(os.getpid()),
        "program": program_name(sys.orig_argv),
    }


@pytest.mark.parametrize(
    ("argv", "program"),
    [
        (["/srv/venv/bin/chatkv", "serve", "--port", "7860"], "chatkv serve"),
        (["/srv/venv/bin/chatkv", "--admin-token", "s3cret", "stats"], "chatkv"),
        (["/srv/venv/bin/gunicorn", "-w", "4", "bot.app:app"], "gunicorn"),
        (["/usr/bin/python3.11", "-m", "uvicorn", "bot.app:app", "--port", "8000"], "python3.11 -m uvicorn"),
        (["python", "worker.py", "--token", "s3cret"], "worker.py"),
        (["python", "-c", "import secrets; print(1)"], "python -c"),
        ([], "python"),
    ],
)
def test_the_program_name_keeps_no_arguments_that_could_be_secrets(argv: list[str], program: str) -> None:
    assert program_name(argv) == program


def test_the_holder_is_named_a_server_with_its_url_or_a_process_with_its_program() -> None:
    assert describe_owner(LockOwner(12, "http://127.0.0.1:7860", None, "chatkv serve")) == (
        "the chatkv server at http://127.0.0.1:7860 (pid 12, chatkv serve)"
    )
    assert describe_owner(LockOwner(12, None, None, "gunicorn")) == "process 12 (gunicorn) with an open SessionManager"
    assert describe_owner(LockOwner(12, None)) == "process 12 with an open SessionManager"  # a lock of an older chatkv
    assert describe_owner(LockOwner(-1, None)) == "another process"


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
            f"the chatkv server at http://127.0.0.1:7999 (pid {other_process}) holds this home "
            f"(if pid {other_process} is not a chatkv process, delete {tmp_path / LOCK_FILE})"
        )
