"""A real `chatkv serve` process for the `/v1/` API tests: a home prepared by a test-process manager
(tenants and their API keys), a free port, this checkout's code (the child gets the checkout first
on `PYTHONPATH`, whatever the installed `chatkv` package points at), stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.conftest import MASTER_KEY, MODEL_CACHE, REPO

START_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class ServerProcess:
    url: str
    home: Path
    log: Path

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process that runs this checkout's code."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATKV_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["GRADIO_ANALYTICS_ENABLED"] = "False"
    env["CHATKV_RESTORE_OR_RECOMPUTE"] = "0"  # the tests check which tier a cache came from
    return {**env, **(extra or {})}


@contextlib.contextmanager
def chatkv_serve(home: Path, model: str, log: Path, **settings: str) -> Iterator[ServerProcess]:
    """`chatkv serve --model MODEL` on `home` (filled and closed by the caller) until the block ends.

    Args:
        settings: `CHATKV_*` variables, e.g. `MAX_CONCURRENT_REQUESTS_PER_TENANT="4"`.
    """
    url, process = start_serve(home, model, log, settings)
    try:
        yield ServerProcess(url, home, log)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.returncode != 0:
        raise AssertionError(f"chatkv serve exited with {process.returncode}:\n{log.read_text()}")


def start_serve(home: Path, model: str, log: Path, settings: Mapping[str, str]) -> tuple[str, subprocess.Popen[bytes]]:
    """Start `chatkv serve --model MODEL` on `home` with `CHATKV_*` `settings` (names without the
    prefix), its output in `log`; return its URL and process once it answers `/healthz` (killed,
    and `AssertionError`, if it does not)."""
    url, process = launch_serve(home, model, log, settings)
    wait_until_serving(url, process, log)
    return url, process


def launch_serve(home: Path, model: str, log: Path, settings: Mapping[str, str]) -> tuple[str, subprocess.Popen[bytes]]:
    """`start_serve` without the wait: processes launched together start side by side (most of a
    start is importing torch and loading the model, one core each); `wait_until_serving` then."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = child_env(
        {
            "CHATKV_HOME": str(home),
            "CHATKV_MODEL_CACHE_DIR": str(MODEL_CACHE),
            "CHATKV_MASTER_KEY": MASTER_KEY,
            **{f"CHATKV_{name.upper()}": value for name, value in settings.items()},
        }
    )
    command = [sys.executable, "-c", "from app.cli import main; main()", "serve", "--port", str(port), "--model", model]
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=out)
    return url, process


def wait_until_serving(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    """Return once the launched server answers `/healthz`; kill it and raise `AssertionError`
    if it exits or does not answer within `START_TIMEOUT_S`."""
    try:
        _wait_until_up(url, process, log)
    except AssertionError:
        process.kill()
        process.wait()
        raise


def _wait_until_up(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"chatkv serve exited with {process.returncode}:\n{log.read_text()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"chatkv serve did not answer within {START_TIMEOUT_S} s:\n{log.read_text()}")
