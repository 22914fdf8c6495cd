"""Child process of the model cache tests: one process publishing a directory into the shared
model cache, as two chatkv processes converting the bundled model at once would.

    python -m tests.sessions.model_cache_worker <target> <go-file> <build-log>

It waits until `<go-file>` exists (so that two workers start together), then calls
`publish_once(target, build)`; `build` appends a line to `<build-log>` and writes its files slowly,
so that the other worker arrives while it is still building. Exit code 0 when the target is there.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from sessions.model_cache import publish_once

WEIGHT_FILES = ("model-00001.safetensors", "model-00002.safetensors", "config.json")


def build(staging: Path, build_log: Path) -> str:
    with build_log.open("a") as log:
        log.write(f"{os.getpid()}\n")
    for name in WEIGHT_FILES:
        (staging / name).write_bytes(name.encode() * 1000)
        time.sleep(0.3)
    return json.dumps({"built_by": os.getpid()})


def main(target: Path, go: Path, build_log: Path) -> None:
    while not go.exists():
        time.sleep(0.01)
    built = publish_once(target, lambda staging: build(staging, build_log), wait_s=60)
    print(json.dumps({"pid": os.getpid(), "built": built}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
