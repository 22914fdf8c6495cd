"""Real `redis-server` processes for tests: a private standalone server (to kill, stop or flush
without touching the machine's shared Redis) and a three-master Redis Cluster, each in a temporary
folder on free ports, with nothing persisted (`--save "" --appendonly no`); and a TCP proxy that
can make the connections it carries go silent (`SilencingProxy`)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

START_TIMEOUT_S = 15.0
CLUSTER_BUS_OFFSET = 10000
"""A cluster node also listens on its port + 10000 (the cluster bus)."""


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, with_bus: bool = False) -> int:
    """A port that is free now (and, `with_bus`, its cluster bus port too)."""
    for _ in range(200):
        port = random.randint(20000, 40000)
        if _port_free(port) and (not with_bus or _port_free(port + CLUSTER_BUS_OFFSET)):
            return port
    raise RuntimeError("no free port found for redis-server")


@dataclass
class RedisServer:
    """One `redis-server` process on 127.0.0.1:`port`, working in `folder`."""

    port: int
    folder: Path
    process: subprocess.Popen[bytes]
    _owns_folder: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2)

    @contextlib.contextmanager
    def hung(self) -> Iterator[None]:
        """SIGSTOP the server for the block: it accepts connections and never answers."""
        os.kill(self.process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Terminate the process (kill it if it lingers); idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        if self._owns_folder:
            shutil.rmtree(self.folder, ignore_errors=True)


def start_server(folder: Path | None = None, *, port: int | None = None, extra: tuple[str, ...] = ()) -> RedisServer:
    """Start `redis-server` and wait until it answers PING. Raises `RuntimeError` if it does not."""
    binary = redis_server_binary()
    if binary is None:
        raise RuntimeError("redis-server is not installed")
    owns = folder is None
    folder = Path(tempfile.mkdtemp(prefix="ckv-redis-")) if folder is None else folder
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port(with_bus=bool(extra)) if port is None else port
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--dir", str(folder), "--logfile", str(folder / "redis.log"), *extra]
    server = RedisServer(port, folder, subprocess.Popen(args, cwd=folder), owns)
    client = server.client()
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            client.ping()
            return server
        except redis.exceptions.ConnectionError:
            if server.process.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"redis-server on port {port} did not start; see {folder / 'redis.log'}") from None
            time.sleep(0.02)
        finally:
            client.close()


@dataclass
class RedisClusterServers:
    """Three master nodes forming one Redis Cluster (no replicas)."""

    nodes: list[RedisServer]
    folder: Path

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_cluster(masters: int = 3) -> RedisClusterServers:
    """Start `masters` cluster-enabled servers, join them with `redis-cli --cluster create`, and
    wait until every node reports `cluster_state:ok`. Raises `RuntimeError` on failure."""
    folder = Path(tempfile.mkdtemp(prefix="ckv-redis-cluster-"))
    nodes: list[RedisServer] = []
    try:
        for index in range(masters):
            node_dir = folder / f"node{index}"
            extra = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")
            nodes.append(start_server(node_dir, extra=extra))
        addresses = [f"127.0.0.1:{node.port}" for node in nodes]
        create = [shutil.which("redis-cli") or "redis-cli", "--cluster", "create", *addresses]
        create += ["--cluster-replicas", "0", "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-500:]} {done.stderr[-500:]}")
        _wait_cluster_ok(nodes)
    except BaseException:
        for node in nodes:
            node.stop()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return RedisClusterServers(nodes, folder)


def _wait_cluster_ok(nodes: list[RedisServer]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    for node in nodes:
        client = node.client()
        try:
            while client.cluster("INFO").get("cluster_state") != "ok":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"cluster node {node.port} did not reach cluster_state:ok")
                time.sleep(0.05)
        finally:
            client.close()


def delete_prefixed(client: redis.Redis | redis.RedisCluster, prefix: str) -> None:
    """Delete every key under `<prefix>:` (SCAN MATCH; never FLUSHALL on a shared server)."""
    if isinstance(client, redis.RedisCluster):
        keys = list(client.scan_iter(match=f"{prefix}:*", target_nodes=redis.RedisCluster.PRIMARIES))
    else:
        keys = list(client.scan_iter(match=f"{prefix}:*"))
    for key in keys:
        with contextlib.suppress(redis.exceptions.RedisError):
            client.delete(key)


class SilencingProxy:
    """A TCP proxy in front of a Redis (threads of this process) that can make the connections it
    carries go silent, as a NAT or firewall that dropped them would: `silence()` stops forwarding
    either way on every connection open now, without closing it (the client sees no reset and no
    end of stream, only no answer); connections made afterwards are carried as usual. Use it as a
    context manager; it closes its sockets on exit.

    Args:
        host, port: the Redis to forward to.
    """

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[tuple[socket.socket, socket.socket]] = []
        self._silenced: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def silence(self) -> int:
        """Stop forwarding on every connection open now; returns how many."""
        with self._lock:
            for client, _ in self._open:
                self._silenced.add(client)
            return len(self._open)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for pair in self._open:
                for sock in pair:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)  # wakes its pump's recv
                    sock.close()

    def __enter__(self) -> SilencingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self._target)
            with self._lock:
                self._open.append((client, server))
            threading.Thread(target=self._pump, args=(client, client, server), daemon=True).start()
            threading.Thread(target=self._pump, args=(client, server, client), daemon=True).start()

    def _pump(self, client: socket.socket, source: socket.socket, sink: socket.socket) -> None:
        while True:
            try:
                data = source.recv(1 << 16)
                if not data:
                    return
                with self._lock:
                    silent = client in self._silenced
                if not silent:
                    sink.sendall(data)
            except OSError:
                return
