"""The shared model cache: one converted copy of a model per machine, which every home reads, and
a conversion that two processes can start at once."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from sessions.errors import ModelUnavailable
from sessions.model_cache import COMPLETE_MARKER, lock_path, old_home_copy, publish_once
from sessions.model_source import load_model
from sessions.settings import Settings
from tests.conftest import MASTER_KEY, MODEL_CACHE, REPO
from tests.sessions.model_cache_worker import WEIGHT_FILES


def test_homes_share_one_model_cache_outside_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHATKV_MODEL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    first = Settings(home=tmp_path / "first", master_key=MASTER_KEY)
    second = Settings(home=tmp_path / "second", master_key=MASTER_KEY)
    assert first.resolved_model_cache_dir == tmp_path / "xdg-cache" / "chatkv" / "models"
    assert second.resolved_model_cache_dir == first.resolved_model_cache_dir

    monkeypatch.setenv("CHATKV_MODEL_CACHE_DIR", str(tmp_path / "own"))
    assert Settings(home=tmp_path / "third").resolved_model_cache_dir == tmp_path / "own"
    assert Settings(home=tmp_path / "third", model_cache_dir=tmp_path / "kw").resolved_model_cache_dir == (
        tmp_path / "kw"
    )


@pytest.mark.real_model
def test_a_second_home_loads_the_converted_model_without_converting(
    smollm_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before = {path: path.stat().st_mtime_ns for path in smollm_dir.iterdir()}
    settings = Settings(home=tmp_path / "another-home", model_cache_dir=MODEL_CACHE, master_key=MASTER_KEY)
    config = settings.model_config()
    with caplog.at_level(logging.INFO, logger="sessions"):
        loaded = load_model(config.model, config.model_cache_dir, "cpu", "float32")
    assert loaded.path == smollm_dir
    assert [r.getMessage() for r in caplog.records if "converting" in r.getMessage()] == []
    assert {path: path.stat().st_mtime_ns for path in smollm_dir.iterdir()} == before


def test_two_processes_converting_at_once_both_succeed_with_one_copy(tmp_path: Path) -> None:
    cache = tmp_path / "models"
    target, go, build_log = cache / "some-model", tmp_path / "go", tmp_path / "builds.log"
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.sessions.model_cache_worker", str(target), str(go), str(build_log)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    go.touch()
    results = [worker.communicate(timeout=120) for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], [err for _, err in results]
    outcomes = sorted(json.loads(out)["built"] for out, _ in results)
    assert outcomes == [False, True]  # one converted, the other waited and read its copy
    assert len(build_log.read_text().splitlines()) == 1
    assert sorted(p.name for p in target.iterdir()) == sorted([*WEIGHT_FILES, COMPLETE_MARKER])
    for name in WEIGHT_FILES:
        assert (target / name).read_bytes() == name.encode() * 1000
    # Only the target and its lock file: no staging folder left behind.
    assert sorted(p.name for p in cache.iterdir()) == [".some-model.lock", "some-model"]


def test_a_failed_conversion_leaves_no_target_and_the_next_one_builds(tmp_path: Path) -> None:
    target = tmp_path / "models" / "some-model"

    def broken(staging: Path) -> str:
        (staging / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        publish_once(target, broken)
    assert not target.exists()
    assert publish_once(target, lambda staging: "{}") is True
    assert publish_once(target, lambda staging: pytest.fail("built twice")) is False


def test_a_build_killed_before_its_rename_leaves_nothing_after_the_next_build(tmp_path: Path) -> None:
    target = tmp_path / "cache" / "model"
    killed = tmp_path / "cache" / ".model-k1ll3d_0"  # a dead process's staging folder (SIGKILL, OOM)
    (killed / "part").mkdir(parents=True)
    (killed / "part" / "model.safetensors").write_bytes(b"half")
    other = tmp_path / "cache" / ".model-v2-abcd1234"  # another target's build: not ours to remove
    other.mkdir()
    assert publish_once(target, lambda staging: "{}") is True
    assert sorted(p.name for p in target.parent.iterdir() if p.is_dir()) == [".model-v2-abcd1234", "model"]


def test_a_conversion_held_too_long_by_another_process_is_a_typed_error(tmp_path: Path) -> None:
    target = tmp_path / "models" / "some-model"
    target.parent.mkdir()
    with FileLock(lock_path(target)), pytest.raises(ModelUnavailable, match="another process has been converting"):
        publish_once(target, lambda staging: pytest.fail("built under another's lock"), wait_s=0.2)
    assert not target.exists()


def test_a_copy_left_in_the_home_by_older_versions_is_pointed_out(tmp_path: Path) -> None:
    home, cache = tmp_path / "home", tmp_path / "cache"
    assert old_home_copy(home, cache) is None
    publish_once(home / "models" / "smollm2-135m-instruct", lambda staging: "{}")
    assert old_home_copy(home, cache) == home / "models"
    assert old_home_copy(home, home / "models") is None  # the home's own cache, set on purpose
