"""Warm resume across real processes on the real model: a session whose cache is on disk continues
in a new process with `restored_from == "disk"`, prefilling only the new turn, and replies exactly
as a session that never left the device. Also after the first process is SIGKILLed once its
write-back has reached the disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cache.ids import SessionId, TenantId
from cache.tiers import BlobRejected, CacheKey
from sessions.engine import Engine
from sessions.offload import EncryptedCacheSealer
from storage.database import open_database
from storage.keyring import TenantKeys, load_master_key
from storage.metadata_store import MetadataStore
from tests.conftest import MASTER_KEY, MODEL_CACHE, REPO
from tests.sessions.offload_helpers import new_turn_tokens, one_torch_thread, open_manager
from tests.sessions.resume_worker import MAX_NEW_TOKENS, SYSTEM

pytestmark = pytest.mark.real_model

FIRST = ["What is the capital of France?", "And of Germany?"]
NEXT = "Which of the two cities is bigger?"


def worker_env(home: Path, persist: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "CHATKV_HOME": str(home),
        "CHATKV_MODEL": "default",
        "CHATKV_MODEL_CACHE_DIR": str(MODEL_CACHE),
        "CHATKV_MASTER_KEY": MASTER_KEY,
        "CHATKV_PERSIST": persist,
        "CHATKV_THREADS": "1",  # see `one_torch_thread`
    }


def worker_args(session: str | None, messages: list[str], hang: bool = False) -> list[str]:
    payload = json.dumps({"session": session, "messages": messages, "hang": hang})
    return [sys.executable, "-m", "tests.sessions.resume_worker", payload]


def run_worker(home: Path, persist: str, session: str | None, messages: list[str]) -> dict:
    done = subprocess.run(
        worker_args(session, messages),
        cwd=REPO,
        env=worker_env(home, persist),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def never_left(tmp_path_factory: pytest.TempPathFactory, real_engine: Engine) -> dict:
    """The same conversation in this process, its cache on the device throughout."""
    home = tmp_path_factory.mktemp("never-left") / "home"
    with one_torch_thread(), open_manager(home, real_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        first = [manager.chat(tenant, sid, m, max_new_tokens=MAX_NEW_TOKENS) for m in FIRST]
        expected_prefill = new_turn_tokens(manager, tenant.id, sid, NEXT)
        last = manager.chat(tenant, sid, NEXT, max_new_tokens=MAX_NEW_TOKENS)
    assert [r.stats.restored_from for r in (*first, last)] == ["new", "device", "device"]
    assert last.stats.prefill_tokens == expected_prefill
    return {"first": [list(r.token_ids) for r in first], "next": list(last.token_ids), "prefill": expected_prefill}


def assert_resumed_from_disk(result: dict, never_left: dict) -> None:
    (reply,) = result["replies"]
    assert reply["restored_from"] == "disk"
    assert reply["prefill_tokens"] == never_left["prefill"]
    assert reply["ids"] == never_left["next"]


def test_a_session_resumes_from_disk_in_a_new_process(tmp_path: Path, never_left: dict) -> None:
    home = tmp_path / "home"
    first = run_worker(home, "on_evict", None, FIRST)
    assert [r["restored_from"] for r in first["replies"]] == ["new", "device"]
    assert [r["ids"] for r in first["replies"]] == never_left["first"]
    assert sorted(p.name.split("-")[0] for p in (home / "blobs").rglob("*.ckv")) == ["base", f"{first['session']}.ckv"]
    second = run_worker(home, "on_evict", first["session"], [NEXT])
    assert_resumed_from_disk(second, never_left)


def blob_is_current(home: Path, fingerprint: str, tenant_id: str, session_id: str) -> bool:
    """Whether the session's disk blob holds its cache up to the last committed turn (opened with
    the real key ring, as a restart would) and its base layer's blob is on disk too."""
    engine = open_database(f"sqlite:///{home / 'chatkv.db'}")
    try:
        metadata = MetadataStore(engine)
        session = metadata.get_session(tenant_id=tenant_id, session_id=session_id)
        path = home / "blobs" / tenant_id / f"{session_id}.ckv"
        if session is None or not path.is_file():
            return False
        names = [r.name for r in metadata.list_blobs(tenant_id=tenant_id)]
        # The base layer's blob is written by its own write-back: until it lands, a restart
        # restores the session's turns but prefills the system prompt again.
        if session_id not in names or not any(name.startswith("base-") for name in names):
            return False
        if not any(p.name.startswith("base-") for p in (home / "blobs" / tenant_id).glob("*.ckv")):
            return False
        sealer = EncryptedCacheSealer(
            TenantKeys(metadata, load_master_key(home, MASTER_KEY)),
            fingerprint,
            torch.device("cpu"),
            max_payload_bytes=path.stat().st_size,
        )
        key = CacheKey.for_session(TenantId(tenant_id), SessionId(session_id))
        try:
            cache = sealer.open_session(key, path.read_bytes())
        except BlobRejected:
            return False
        return cache.next_original_index == session.token_count
    finally:
        engine.dispose()


def test_a_session_resumes_after_the_process_is_killed_once_its_write_back_landed(
    tmp_path: Path, never_left: dict, real_engine: Engine
) -> None:
    home = tmp_path / "home"
    process = subprocess.Popen(
        worker_args(None, FIRST, hang=True),
        cwd=REPO,
        env=worker_env(home, "write_back"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line, process.stderr.read() if process.stderr else ""
        first = json.loads(line)
        assert [r["ids"] for r in first["replies"]] == never_left["first"]
        deadline = time.monotonic() + 120
        while not blob_is_current(home, real_engine.fingerprint, first["tenant"], first["session"]):
            assert process.poll() is None, "the worker exited before it was killed"
            assert time.monotonic() < deadline, "the write-back never reached the disk"
            time.sleep(0.1)
    finally:
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    second = run_worker(home, "write_back", first["session"], [NEXT])
    assert_resumed_from_disk(second, never_left)
