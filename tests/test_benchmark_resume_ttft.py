"""`benchmarks/resume_ttft.py`: the Redis rows skip themselves on a machine where no Redis answers
(the device machine has none), instead of ending the run."""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def _resume_ttft() -> ModuleType:
    benchmarks = str(REPO / "benchmarks")
    if benchmarks not in sys.path:  # the benchmark imports its sibling `_common`
        sys.path.insert(0, benchmarks)
    spec = importlib.util.spec_from_file_location("resume_ttft", REPO / "benchmarks" / "resume_ttft.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port  # nothing listens once the socket is closed


def test_a_redis_row_is_skipped_with_its_reason_when_no_server_answers() -> None:
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    reason = _resume_ttft().redis_answers(url, False)
    assert reason is not None and reason.startswith(f"{url} does not answer")


def test_a_redis_row_without_a_url_is_skipped() -> None:
    assert _resume_ttft().redis_answers(None, True) == "no URL given"
