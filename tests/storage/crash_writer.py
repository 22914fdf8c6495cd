"""Child process of the crash tests: writes blobs through `DiskBlobStore.put` until it is killed.

    python -m tests.storage.crash_writer ROOT DB_URL TENANT NAME PAUSE SIZE [SIZE ...]

Writes blob i (`size[i % n]` bytes of the letter `"AB..."[i % n]`) to key (TENANT, NAME), forever.
PAUSE stops the first write at a point and waits to be killed, after printing the point's name:
`before-rename` (temp file written and fsynced, not renamed), `before-row` (renamed, the
`cache_blobs` row not written yet), or `none` (no pause; prints `writing` once before the loop).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import storage.atomic_files as atomic_files
from storage.blob_stores import DiskBlobStore
from storage.database import open_database
from storage.metadata_store import MetadataStore

LETTERS = b"ABCDEFGH"


@dataclass(frozen=True)
class Key:
    tenant_id: str
    name: str


def blob_for(index: int, sizes: list[int]) -> bytes:
    slot = index % len(sizes)
    return LETTERS[slot : slot + 1] * sizes[slot]


def _pause(point: str) -> None:
    print(point, flush=True)
    time.sleep(3600)


def main(argv: list[str]) -> None:
    root, url, tenant, name, pause = argv[:5]
    sizes = [int(size) for size in argv[5:]]
    store = DiskBlobStore(Path(root), MetadataStore(open_database(url)), "fp-a", Key)
    store.reconcile()
    if pause == "before-rename":

        def paused_replace(src: object, dst: object) -> None:
            _pause("before-rename")

        os.replace = paused_replace  # type: ignore[assignment]
    elif pause == "before-row":

        def paused_fsync_dir(folder: Path) -> None:
            _pause("before-row")

        atomic_files.fsync_dir = paused_fsync_dir
    else:
        print("writing", flush=True)
    index = 0
    while True:
        store.put(Key(tenant, name), blob_for(index, sizes))
        index += 1


if __name__ == "__main__":
    main(sys.argv[1:])
