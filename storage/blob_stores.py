"""Blob stores of the host and disk tiers: sealed bytes by key (tenant id, name).

Both implement the `cache.tiers.BlobStore` protocol structurally (this package does not import
`cache`). Keys are objects with `tenant_id` and `name` attributes; the disk store rebuilds them
with the `key_factory` it is given. An absent blob raises this module's `BlobNotFound`, which
`sessions/offload.py` turns into `cache.tiers.BlobMissing` for the tier manager.

Disk layout: `<root>/<tenant id>/<name>.ckv`, one file per blob, written atomically; a row in
`cache_blobs` per file records tier, path, bytes, SHA-256 and model fingerprint. `reconcile()` at
start-up makes folder and table agree.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from storage.atomic_files import TEMP_PREFIX, write_atomic
from storage.errors import StorageError
from storage.metadata_store import MetadataStore

log = logging.getLogger(__name__)

BLOB_SUFFIX = ".ckv"
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,119}")


class KeyLike(Protocol, Hashable):
    @property
    def tenant_id(self) -> str: ...

    @property
    def name(self) -> str: ...


K = TypeVar("K", bound=KeyLike)


class BlobNotFound(StorageError):
    """The store holds no blob for the key (never stored, deleted, or its file removed behind the
    store). Not a `KeyError`, so a `KeyError` from a bug is never mistaken for an absent blob."""

    def __init__(self, tenant_id: str, name: str) -> None:
        super().__init__(f"no blob {tenant_id}/{name}")
        self.tenant_id, self.name = tenant_id, name


def _check_name(part: str) -> str:
    """Names become path components: refuse anything that could leave the store's folder."""
    if not _SAFE_NAME.fullmatch(part) or ".." in part:
        raise ValueError(f"unsafe blob name component: {part!r}")
    return part


class HostBlobStore(Generic[K]):
    """Sealed blobs in process memory (the `host` tier). Thread-safe."""

    def __init__(self) -> None:
        self._blobs: dict[K, bytes] = {}
        self._lock = threading.Lock()

    def put(self, key: K, blob: bytes | bytearray) -> None:
        with self._lock:
            self._blobs[key] = bytes(blob)  # a sealer's frame (a `bytearray`) is copied: kept immutable

    def get(self, key: K) -> bytes:
        """Raises `BlobNotFound` if absent."""
        with self._lock:
            blob = self._blobs.get(key)
        if blob is None:
            raise BlobNotFound(key.tenant_id, key.name)
        return blob

    def delete(self, key: K) -> None:
        with self._lock:
            self._blobs.pop(key, None)

    def contains(self, key: K) -> bool:
        with self._lock:
            return key in self._blobs

    def nbytes(self, key: K) -> int:
        with self._lock:
            blob = self._blobs.get(key)
            return len(blob) if blob is not None else 0

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._blobs)

    def used_bytes(self) -> int:
        with self._lock:
            return sum(len(blob) for blob in self._blobs.values())


class DiskBlobStore(Generic[K]):
    """Sealed blobs as files under `root` (the `disk` tier), indexed in `cache_blobs`.

    Args:
        root: folder of the blobs (inside the chatkv home); created if absent.
        metadata: the database holding the `cache_blobs` rows.
        model_fingerprint: recorded with each row; rows of other fingerprints are invalidated by
            `reconcile`.
        key_factory: builds a key from `(tenant_id, name)`.
        location: whose disk this is in `cache_blobs` (a replica's id; `""` for a single
            process): `reconcile` looks only at this location's rows, so replicas sharing one
            database never drop each other's.
    """

    def __init__(
        self,
        root: Path,
        metadata: MetadataStore,
        model_fingerprint: str,
        key_factory: Callable[[str, str], K],
        location: str = "",
    ) -> None:
        self.root = root
        self.location = location
        self._metadata = metadata
        self._fingerprint = model_fingerprint
        self._key_factory = key_factory
        self._sizes: dict[K, int] = {}
        self.damaged_at_start = 0
        """Blobs `reconcile` found damaged (truncated, replaced, outside the folder): integrity failures."""
        self._lock = threading.RLock()
        root.mkdir(parents=True, exist_ok=True)

    def path_for(self, key: K) -> Path:
        return self.root / _check_name(key.tenant_id) / (_check_name(key.name) + BLOB_SUFFIX)

    def put(self, key: K, blob: bytes | bytearray) -> None:
        """Write atomically and record the row; if the owning session or tenant is gone, the file
        is removed again and the store does not hold the key."""
        path = self.path_for(key)
        with self._lock:
            write_atomic(path, blob)
            session_id = None if key.name.startswith("base-") else key.name
            recorded = self._metadata.put_blob(
                tenant_id=key.tenant_id,
                session_id=session_id,
                name=key.name,
                tier="disk",
                path=str(path.relative_to(self.root)),
                nbytes=len(blob),
                checksum=hashlib.sha256(blob).hexdigest(),
                model_fingerprint=self._fingerprint,
                location=self.location,
            )
            if not recorded:
                # Its session or tenant was deleted meanwhile: the blob is not wanted any more.
                path.unlink(missing_ok=True)
                self._sizes.pop(key, None)
                log.debug("dropped blob %s/%s: its owner is gone", key.tenant_id, key.name)
                return
            self._sizes[key] = len(blob)

    def get(self, key: K) -> bytes:
        """Raises `BlobNotFound` if absent, or if its file was removed behind the store."""
        with self._lock:
            if key not in self._sizes:
                raise BlobNotFound(key.tenant_id, key.name)
            try:
                return self.path_for(key).read_bytes()
            except FileNotFoundError:
                self._sizes.pop(key, None)
                raise BlobNotFound(key.tenant_id, key.name) from None

    def delete(self, key: K) -> None:
        with self._lock:
            if self._sizes.pop(key, None) is None and not self.path_for(key).exists():
                return
            with contextlib.suppress(FileNotFoundError):
                self.path_for(key).unlink()
            self._metadata.delete_blob(tenant_id=key.tenant_id, name=key.name, location=self.location)

    def contains(self, key: K) -> bool:
        with self._lock:
            return key in self._sizes

    def nbytes(self, key: K) -> int:
        with self._lock:
            return self._sizes.get(key, 0)

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._sizes)

    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def reconcile(self) -> list[K]:
        """Make folder and table agree; return the keys of usable blobs, oldest first.

        Removes temp files left by a crash, rows whose file is missing, blobs of another model
        fingerprint (invalidated), and files that belong to no existing session or tenant. A file
        whose size disagrees with its row (a write interrupted between the rename and the row
        update, or a tampered file), or a session's file without a row (interrupted before its
        first row), is kept with a corrected row: its AES-GCM tag decides when it is next used,
        and a blob that does not authenticate is rejected and counted then. A row pointing outside
        the folder is dropped and counted in `damaged_at_start`.
        """
        with self._lock:
            rows = {(r.tenant_id, r.name): r for r in self._metadata.list_blobs(location=self.location)}
            self._sizes.clear()
            self.damaged_at_start = 0
            kept: list[K] = []
            for (tenant_id, name), row in rows.items():
                key = self._key_factory(tenant_id, name)
                problem = self._row_problem(row.path, row.model_fingerprint)
                if problem is not None:
                    harmless = problem in ("another model", "file missing")
                    self.damaged_at_start += 0 if harmless else 1
                    log.log(
                        logging.INFO if harmless else logging.WARNING,
                        "invalidating disk blob %s/%s: %s",
                        tenant_id,
                        name,
                        problem,
                    )
                    with contextlib.suppress(FileNotFoundError, ValueError):
                        self.path_for(key).unlink()
                    self._metadata.delete_blob(tenant_id=tenant_id, name=name, location=self.location)
                    continue
                size = (self.root / row.path).stat().st_size
                if size != row.nbytes:
                    log.info(
                        "disk blob %s/%s holds %d bytes, its row says %d (an interrupted write, or "
                        "tampering): kept until it is authenticated",
                        tenant_id,
                        name,
                        size,
                        row.nbytes,
                    )
                    self._record(key, self.root / row.path)
                self._sizes[key] = size
                kept.append(key)
            known = {self.root / r.path for r in rows.values()}
            for path in sorted(self.root.rglob("*")):
                if not path.is_file() or path in known:
                    continue
                orphan = self._orphan_key(path)
                if orphan is not None and self._record(orphan, path):
                    log.info("adopting disk blob %s without a row (an interrupted first write)", path)
                    self._sizes[orphan] = path.stat().st_size
                    kept.append(orphan)
                    continue
                log.info("removing orphan file %s", path)
                path.unlink(missing_ok=True)
            return kept

    def _orphan_key(self, path: Path) -> K | None:
        """The key of a file without a row, if it is a blob of an existing tenant's folder."""
        if path.name.startswith(TEMP_PREFIX) or path.suffix != BLOB_SUFFIX or path.parent.parent != self.root:
            return None
        tenant_id, name = path.parent.name, path.stem
        if not _SAFE_NAME.fullmatch(tenant_id) or not _SAFE_NAME.fullmatch(name):
            return None
        return self._key_factory(tenant_id, name)

    def _record(self, key: K, path: Path) -> bool:
        """Write the row of an existing file (its size and checksum as they are now)."""
        data = path.read_bytes()
        return self._metadata.put_blob(
            tenant_id=key.tenant_id,
            session_id=None if key.name.startswith("base-") else key.name,
            name=key.name,
            tier="disk",
            path=str(path.relative_to(self.root)),
            nbytes=len(data),
            checksum=hashlib.sha256(data).hexdigest(),
            model_fingerprint=self._fingerprint,
            location=self.location,
        )

    def _row_problem(self, relative: str, fingerprint: str) -> str | None:
        """Why a `cache_blobs` row cannot be used at all, or `None`."""
        path = self.root / relative
        if fingerprint != self._fingerprint:
            return "another model"
        if not path.resolve().is_relative_to(self.root.resolve()):
            return f"its path {relative!r} leaves the blob folder"
        if not path.is_file():
            return "file missing"
        return None

    def remove_tenant_folder(self, tenant_id: str) -> None:
        """Remove a deleted tenant's folder and anything left in it."""
        folder = self.root / _check_name(tenant_id)
        with self._lock:
            for key in [k for k in self._sizes if k.tenant_id == tenant_id]:
                self._sizes.pop(key, None)
            if folder.is_dir():
                for path in folder.iterdir():
                    path.unlink(missing_ok=True)
                folder.rmdir()
