"""A PostgreSQL outage under a real `chatkv serve` process: the server reaches the real database
through a TCP forwarder that the test cuts (every connection reset, new ones closed at once) and
restores. During the outage `/v1/` answers 503 `database_unavailable` with `Retry-After` in
OpenAI's error shape, never a bare 500; afterwards turns go on and nothing was stored twice or lost."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, make_url

from sessions.engine import Engine as ModelEngine
from sessions.manager import SessionManager
from tests.app.server_process import chatkv_serve
from tests.conftest import make_settings
from tests.storage.conftest import fresh_schema, postgres_admin  # noqa: F401


class DatabaseLink:
    """A TCP forwarder from a local port to the database server that can be cut and restored."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.up = True
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # the listener was closed: the test is over
                return
            if not self.up:
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Reset every forwarded connection; connections made until `restore` are closed at once."""
        self.up = False
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def restore(self) -> None:
        self.up = True

    def close(self) -> None:
        self.cut()
        self.listener.close()


@pytest.fixture
def database_url(postgres_admin: Engine) -> Iterator[str]:  # noqa: F811
    yield from fresh_schema(postgres_admin)


def test_a_database_outage_is_503_and_nothing_is_lost(
    tmp_path: Path, tiny_model_dir: Path, tiny_engine: ModelEngine, database_url: str
) -> None:
    direct = make_url(database_url)
    link = DatabaseLink(direct.host or "127.0.0.1", direct.port or 5432)
    linked = direct.set(host="127.0.0.1", port=link.port).render_as_string(hide_password=False)
    home = tmp_path / "home"
    with SessionManager(make_settings(home, database_url=database_url), engine=tiny_engine) as manager:
        key = manager.issue_api_key(manager.create_tenant("acme"))
    auth = {"Authorization": f"Bearer {key}"}
    try:
        with chatkv_serve(home, str(tiny_model_dir), tmp_path / "serve.log", database_url=linked) as server:
            client = httpx.Client(base_url=server.v1, timeout=60)
            created = client.post("/sessions", json={"system_prompt": "Be brief."}, headers=auth)
            assert created.status_code == 201, created.text
            session_id = created.json()["id"]

            def send(content: str) -> httpx.Response:
                return client.post(
                    f"/sessions/{session_id}/messages", json={"content": content, "max_tokens": 6}, headers=auth
                )

            assert send("first").status_code == 200
            link.cut()
            for response in (
                send("lost in the outage"),
                client.post(
                    "/chat/completions",
                    json={"model": "chatkv", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                    headers=auth,
                ),
                client.get(f"/sessions/{session_id}", headers=auth),
            ):
                assert response.status_code == 503, response.text
                assert response.headers["Retry-After"] == "5"
                error = response.json()["error"]
                assert (error["code"], error["type"]) == ("database_unavailable", "server_error")
            admin = {"Authorization": f"Bearer {(home / 'admin.token').read_text().strip()}"}
            listed = httpx.get(f"{server.url}/admin/sessions", params={"tenant": "acme"}, headers=admin, timeout=60)
            assert listed.status_code == 503, listed.text
            assert listed.headers["Retry-After"] == "5"
            assert listed.json() == {"error": "the database is unavailable; retry shortly"}
            link.restore()
            assert send("second").status_code == 200
            history = client.get(f"/sessions/{session_id}", headers=auth)
            assert history.status_code == 200, history.text
            users = [m["content"] for m in history.json()["messages"] if m["role"] == "user"]
            assert users == ["first", "second"]  # the turn the outage cut stored nothing
            client.close()
        # No request failed unhandled (background threads may log the outage; requests did not).
        assert "Exception in ASGI application" not in (tmp_path / "serve.log").read_text()
    finally:
        link.close()
