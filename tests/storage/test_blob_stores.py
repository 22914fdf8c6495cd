"""Blob stores: the host store in memory, the disk store's files and `cache_blobs` rows, start-up
reconciliation, names that cannot leave the folder, and a real writer process killed mid-write."""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.atomic_files import TEMP_PREFIX, write_atomic
from storage.blob_stores import BlobNotFound, DiskBlobStore, HostBlobStore
from storage.errors import StorageError
from storage.metadata_store import MetadataStore
from tests.conftest import REPO
from tests.storage.conftest import BASE, OTHER, S1, S2, Key, add_session
from tests.storage.crash_writer import blob_for


def disk_store(root: Path, metadata: MetadataStore, fingerprint: str = "fp-a") -> DiskBlobStore[Key]:
    return DiskBlobStore(root, metadata, fingerprint, Key)


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


# -- host ------------------------------------------------------------------------------------------


def test_host_store_keeps_bytes_by_key() -> None:
    store: HostBlobStore[Key] = HostBlobStore()
    store.put(S1, b"x" * 10)
    store.put(S2, b"y" * 5)
    store.put(S1, b"z" * 7)
    assert (store.get(S1), store.get(S2)) == (b"z" * 7, b"y" * 5)
    assert (store.nbytes(S1), store.nbytes(OTHER), store.used_bytes()) == (7, 0, 12)
    assert set(store.keys()) == {S1, S2}
    store.delete(S1)
    store.delete(S1)
    assert not store.contains(S1)
    with pytest.raises(BlobNotFound):
        store.get(S1)


def test_both_stores_report_an_absent_blob_as_blob_not_found(tmp_path: Path, rows: MetadataStore) -> None:
    stores: list[HostBlobStore[Key] | DiskBlobStore[Key]] = [HostBlobStore(), disk_store(tmp_path / "blobs", rows)]
    for store in stores:
        with pytest.raises(BlobNotFound) as raised:
            store.get(S1)
        assert (raised.value.tenant_id, raised.value.name, str(raised.value)) == ("tn_a", "s_1", "no blob tn_a/s_1")
        assert isinstance(raised.value, StorageError) and not isinstance(raised.value, KeyError)


# -- disk ------------------------------------------------------------------------------------------


def test_disk_store_writes_files_and_rows(tmp_path: Path, rows: MetadataStore) -> None:
    root = tmp_path / "blobs"
    store = disk_store(root, rows)
    store.put(S1, b"one" * 100)
    store.put(BASE, b"base" * 10)
    store.put(S1, b"uno" * 50)
    assert store.get(S1) == b"uno" * 50
    assert (store.nbytes(S1), store.nbytes(BASE), store.used_bytes()) == (150, 40, 190)
    assert files_under(root) == {"tn_a/s_1.ckv", "tn_a/base-0123abcd.ckv"}
    assert stat.S_IMODE((root / "tn_a" / "s_1.ckv").stat().st_mode) == 0o600
    recorded = {(r.name, r.session_id, r.path, r.nbytes, r.checksum, r.model_fingerprint) for r in rows.list_blobs()}
    assert recorded == {
        ("s_1", "s_1", "tn_a/s_1.ckv", 150, hashlib.sha256(b"uno" * 50).hexdigest(), "fp-a"),
        ("base-0123abcd", None, "tn_a/base-0123abcd.ckv", 40, hashlib.sha256(b"base" * 10).hexdigest(), "fp-a"),
    }
    store.delete(S1)
    assert not store.contains(S1) and files_under(root) == {"tn_a/base-0123abcd.ckv"}
    assert [r.name for r in rows.list_blobs()] == ["base-0123abcd"]
    with pytest.raises(BlobNotFound):
        store.get(S1)


def test_a_file_deleted_behind_the_store_reads_as_absent(tmp_path: Path, rows: MetadataStore) -> None:
    store = disk_store(tmp_path / "blobs", rows)
    store.put(S1, b"data")
    (tmp_path / "blobs" / "tn_a" / "s_1.ckv").unlink()
    with pytest.raises(BlobNotFound):
        store.get(S1)
    assert not store.contains(S1)


def test_reconcile_makes_folder_and_table_agree(tmp_path: Path, rows: MetadataStore) -> None:
    root = tmp_path / "blobs"
    store = disk_store(root, rows)
    for key, size in ((S1, 10), (S2, 20), (BASE, 30), (OTHER, 40)):
        store.put(key, b"k" * size)
    (root / "tn_a" / "s_2.ckv").unlink()  # row without file
    (root / "tn_a" / "base-0123abcd.ckv").write_bytes(b"k" * 29)  # size differs from the row
    (root / "tn_a" / "orphan.ckv").write_bytes(b"no row")
    (root / "tn_b" / f"{TEMP_PREFIX}abc123").write_bytes(b"half a write")
    (root / "tn_c").mkdir()
    (root / "tn_c" / "stray.ckv").write_bytes(b"no row")

    restarted = disk_store(root, rows)
    kept = restarted.reconcile()
    # A file whose row says another size is kept (its AES-GCM tag decides at restore) with a
    # corrected row; files of no existing session or tenant, rows without files and temp files go.
    assert kept == [S1, BASE, OTHER]  # oldest first
    assert files_under(root) == {"tn_a/s_1.ckv", "tn_a/base-0123abcd.ckv", "tn_b/s_3.ckv"}
    assert sorted((r.name, r.nbytes) for r in rows.list_blobs()) == [("base-0123abcd", 29), ("s_1", 10), ("s_3", 40)]
    assert (restarted.used_bytes(), restarted.get(OTHER)) == (79, b"k" * 40)
    assert restarted.damaged_at_start == 0


def test_reconcile_invalidates_blobs_of_another_model(tmp_path: Path, rows: MetadataStore) -> None:
    root = tmp_path / "blobs"
    disk_store(root, rows, "fp-a").put(S1, b"made by model a")
    other_model = disk_store(root, rows, "fp-b")
    assert other_model.reconcile() == []
    assert files_under(root) == set()
    assert rows.list_blobs() == []


def test_reconcile_never_touches_a_file_a_row_points_outside_the_folder(tmp_path: Path, rows: MetadataStore) -> None:
    root = tmp_path / "blobs"
    outside = tmp_path / "precious.txt"
    outside.write_bytes(b"not ours")
    rows.put_blob(
        tenant_id="tn_a",
        session_id="s_1",
        name="s_1",
        tier="disk",
        path="../precious.txt",
        nbytes=8,
        checksum="0" * 64,
        model_fingerprint="fp-a",
    )
    store = disk_store(root, rows)
    assert store.reconcile() == []
    assert outside.read_bytes() == b"not ours"
    assert rows.list_blobs() == []
    with pytest.raises(BlobNotFound):
        store.get(S1)


@pytest.mark.parametrize(
    "key",
    [
        Key("tn_a", "../escape"),
        Key("tn_a", ".."),
        Key("tn_a", "a/b"),
        Key("tn_a", "/etc/passwd"),
        Key("tn_a", ""),
        Key("tn_a", ".hidden"),
        Key("tn_a", "a..b"),
        Key("tn_a", "x" * 121),
        Key("..", "s_1"),
        Key("tn_a/../../x", "s_1"),
        Key("", "s_1"),
    ],
)
def test_unsafe_names_are_refused_and_nothing_is_written(tmp_path: Path, key: Key) -> None:
    rows = _sqlite_metadata(f"sqlite:///{tmp_path / 'db' / 'chatkv.db'}")
    root = tmp_path / "home" / "blobs"
    store = disk_store(root, rows)
    with pytest.raises(ValueError, match="unsafe blob name"):
        store.put(key, b"payload")
    with pytest.raises(ValueError, match="unsafe blob name"):
        store.path_for(key)
    assert [p for p in tmp_path.rglob("*") if p.is_file() and "db" not in p.parts] == []
    assert rows.list_blobs() == []


def test_remove_tenant_folder(tmp_path: Path, rows: MetadataStore) -> None:
    root = tmp_path / "blobs"
    store = disk_store(root, rows)
    store.put(S1, b"a")
    store.put(OTHER, b"b")
    (root / "tn_a" / f"{TEMP_PREFIX}left").write_bytes(b"x")
    store.remove_tenant_folder("tn_a")
    assert files_under(root) == {"tn_b/s_3.ckv"}
    assert not (root / "tn_a").exists()
    assert store.keys() == [OTHER]


def test_write_atomic_replaces_whole_files_and_honours_exclusive(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "file"
    write_atomic(path, b"first", mode=0o640)
    assert path.read_bytes() == b"first" and stat.S_IMODE(path.stat().st_mode) == 0o640
    write_atomic(path, b"second")
    with pytest.raises(FileExistsError):
        write_atomic(path, b"third", exclusive=True)
    assert path.read_bytes() == b"second"
    assert sorted(p.name for p in path.parent.iterdir()) == ["file"]


# -- a writer process killed mid-write ---------------------------------------------------------------

SIZES = [8 * 2**20, 8 * 2**20 + 4096]


def start_writer(root: Path, url: str, pause: str, sizes: list[int]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.storage.crash_writer", str(root), url, "tn_a", "s_1", pause, *map(str, sizes)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(process: subprocess.Popen[str], expected: str) -> None:
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if line != expected:
        process.kill()
        _, err = process.communicate(timeout=30)
        pytest.fail(f"writer said {line!r}, expected {expected!r}; stderr: {err}")


def kill(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=30)
    assert process.returncode == -signal.SIGKILL


def assert_consistent(root: Path, metadata: MetadataStore, allowed: list[bytes]) -> bytes | None:
    """After a restart's reconcile: no temp file; files and rows name the same blobs, of the sizes the
    rows say; the blob is one of `allowed` in full (never torn) or absent. Returns the blob."""
    store = disk_store(root, metadata)
    kept = store.reconcile()
    assert not any(p.name.startswith(TEMP_PREFIX) for p in root.rglob("*"))
    records = metadata.list_blobs()
    assert {r.path for r in records} == files_under(root)
    for record in records:
        assert (root / record.path).stat().st_size == record.nbytes
    assert kept == [S1] * len(records)
    if not kept:
        return None
    blob = store.get(S1)
    assert blob in allowed
    return blob


def test_kill_before_the_rename_leaves_the_old_blob(tmp_path: Path) -> None:
    root, url = tmp_path / "blobs", f"sqlite:///{tmp_path / 'chatkv.db'}"
    metadata = _sqlite_metadata(url)
    old = blob_for(0, SIZES)
    disk_store(root, metadata).put(S1, old)
    writer = start_writer(root, url, "before-rename", SIZES)
    wait_for_line(writer, "before-rename")
    temps = [p for p in (root / "tn_a").iterdir() if p.name.startswith(TEMP_PREFIX)]
    assert [p.stat().st_size for p in temps] == [SIZES[0]]  # the new blob, written in full to the temp file
    kill(writer)
    assert (root / "tn_a" / "s_1.ckv").read_bytes() == old
    assert assert_consistent(root, metadata, [old]) == old
    assert [r.checksum for r in metadata.list_blobs()] == [hashlib.sha256(old).hexdigest()]


def test_kill_after_the_rename_before_the_row_leaves_no_torn_blob(tmp_path: Path) -> None:
    root, url = tmp_path / "blobs", f"sqlite:///{tmp_path / 'chatkv.db'}"
    metadata = _sqlite_metadata(url)
    old = blob_for(1, SIZES)  # the writer's first blob has the other size
    disk_store(root, metadata).put(S1, old)
    writer = start_writer(root, url, "before-row", SIZES)
    wait_for_line(writer, "before-row")
    kill(writer)
    new = blob_for(0, SIZES)
    assert (root / "tn_a" / "s_1.ckv").read_bytes() == new
    # The row still describes the old blob; the new, complete file is kept with a corrected row
    # (authentication at restore decides whether it is used), never thrown away as damaged.
    assert assert_consistent(root, metadata, [old, new]) == new


@pytest.mark.parametrize("delay_s", [0.02, 0.11, 0.29])
def test_kill_at_a_random_moment_of_a_write_loop_leaves_a_whole_blob_or_none(tmp_path: Path, delay_s: float) -> None:
    root, url = tmp_path / "blobs", f"sqlite:///{tmp_path / 'chatkv.db'}"
    metadata = _sqlite_metadata(url)
    disk_store(root, metadata).put(S1, blob_for(0, SIZES))
    writer = start_writer(root, url, "none", SIZES)
    wait_for_line(writer, "writing")
    time.sleep(delay_s)
    kill(writer)
    assert_consistent(root, metadata, [blob_for(0, SIZES), blob_for(1, SIZES)])


def _sqlite_metadata(url: str) -> MetadataStore:
    from storage.database import open_database, upgrade

    engine = open_database(url)
    upgrade(url, engine)
    metadata = MetadataStore(engine)
    add_session(metadata, "tn_a", "s_1")
    return metadata
