"""The chatkv server: Gradio chat UI at `/`, admin JSON API under `/admin/`, Prometheus `/metrics`.

One process, one `SessionManager`, one FastAPI app served by uvicorn. The server holds the chatkv
home's lock file while it runs (see `storage.home_lock`).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

from sessions.manager import SessionManager
from storage.atomic_files import write_atomic

log = logging.getLogger(__name__)

ADMIN_TOKEN_FILE = "admin.token"


def admin_token(home: Path, configured: str | None) -> str:
    """The admin token: `configured` (`CHATKV_ADMIN_TOKEN`), else `home/admin.token`, generated with
    mode 0600 on first start."""
    if configured:
        return configured
    path = home / ADMIN_TOKEN_FILE
    if not path.exists():
        write_atomic(path, secrets.token_urlsafe(32).encode() + b"\n", mode=0o600)
    return path.read_text().strip()


def build_app(manager: SessionManager, *, local: bool, token: str) -> FastAPI:
    """The whole server app for `manager`.

    Args:
        local: single-tenant local mode (no API key asked; the UI uses the `local` tenant).
        token: the admin token the `/admin/` routes require.
    """
    import gradio as gr

    from app.admin_api import admin_router
    from app.ui import UI_CSS, build_ui

    app = FastAPI(title="chatkv", docs_url=None, redoc_url=None)
    app.include_router(admin_router(manager, token), prefix="/admin")

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(manager.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok", "model": manager.model_name}

    # Gradio's run history would keep what was typed (API keys, messages) in the browser's storage,
    # and its API page documents event endpoints that are internal to this page: both off.
    return gr.mount_gradio_app(
        app,
        build_ui(manager, local=local),
        path="/",
        footer_links=[],
        run_history=False,
        ssr_mode=False,
        css=UI_CSS,
    )


def serve(manager: SessionManager, *, host: str = "127.0.0.1", port: int = 7860, local: bool = False) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM), holding the home lock; closes `manager` at the
    end, which persists its caches so the next start resumes warm.

    Raises:
        HomeLockedError: if another live server holds the same chatkv home.
    """
    import uvicorn

    from storage.home_lock import HomeLock

    url = f"http://{host}:{port}"
    token = admin_token(manager.settings.home, manager.settings.admin_token)
    try:
        with HomeLock(manager.settings.home, url), _sigterm_exits():
            app = build_app(manager, local=local, token=token)
            log.info("chatkv serving %s on %s (admin token in %s)", manager.model_name, url, manager.settings.home)
            uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        manager.close()


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Make SIGTERM raise `SystemExit` while serving.

    uvicorn shuts down gracefully on SIGTERM and then raises the signal again under the handler that
    was installed before it started; with the default handler that kills the process at once, so
    `manager.close()` (persisting caches) and the home lock's release would never run.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread; uvicorn then ignores signals too
        return

    def exit_now(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
