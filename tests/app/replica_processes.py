"""Real `chatkv serve` replicas for the scale-out tests: each its own home and port, all on one
PostgreSQL schema, one Redis (or Redis Cluster) key prefix and one master key; a replica can be
stopped (SIGTERM, a clean hand-over) or killed (SIGKILL, its leases must expire)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.app.server_process import launch_serve, wait_until_serving


@dataclass
class Replica:
    """One `chatkv serve` process."""

    url: str
    home: Path
    log: Path
    process: subprocess.Popen[bytes]
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def kill(self) -> None:
        """SIGKILL: no hand-over, no persisting; its leases stay until they expire."""
        self.process.kill()
        self.process.wait()
        self.client.close()

    def stop(self) -> None:
        """SIGTERM and wait for a clean exit (exit code 0)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError(f"replica did not stop:\n{self.log.read_text()}") from None
            if self.process.returncode != 0:
                raise AssertionError(f"replica exited with {self.process.returncode}:\n{self.log.read_text()}")
        self.client.close()

    def send(self, api_key: str, session_id: str, content: str, **body: Any) -> httpx.Response:
        """`POST /v1/sessions/{id}/messages` (not streamed)."""
        return self.client.post(
            f"/v1/sessions/{session_id}/messages",
            json={"content": content, "max_tokens": 12, **body},
            headers={"Authorization": f"Bearer {api_key}"},
        )


def start_replica(home: Path, model: str, settings: Mapping[str, str]) -> Replica:
    """`chatkv serve --model MODEL` on its own home with `CHATKV_*` `settings` (names without the
    prefix); returns once it answers `/healthz`."""
    replica = launch_replica(home, model, settings)
    wait_until_serving(replica.url, replica.process, replica.log)
    return replica


def launch_replica(home: Path, model: str, settings: Mapping[str, str]) -> Replica:
    """`start_replica` without waiting for it to answer."""
    home.mkdir(parents=True, exist_ok=True)
    log = home / "serve.log"
    url, process = launch_serve(home, model, log, {"threads": "1", **settings})
    return Replica(url, home, log, process)


@contextlib.contextmanager
def replicas(root: Path, model: str, settings: Mapping[str, str], count: int = 2) -> Iterator[list[Replica]]:
    """`count` replicas started side by side (launched together, then each waited for), stopped
    (or already killed) at the end. The caller has migrated the database (`make_tenants`), so
    the replicas' start-up finds it current."""
    started: list[Replica] = []
    try:
        for index in range(count):
            started.append(launch_replica(root / f"replica{index}", model, settings))
        for replica in started:
            wait_until_serving(replica.url, replica.process, replica.log)
        yield started
    finally:
        for replica in started:
            if replica.process.poll() is None:
                replica.stop()
