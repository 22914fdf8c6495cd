"""The chatkv server: Gradio chat UI at `/`, the OpenAI-compatible and session API under `/v1/`,
admin JSON API under `/admin/`, Prometheus `/metrics`; the OpenAPI schema at `/openapi.json`.

One process, one `SessionManager`, one FastAPI app served by uvicorn. The server holds the chatkv
home's lock file while it runs (see `storage.home_lock`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import signal
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from types import FrameType
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from app.http.body_limits import DEFAULT_BODY_LIMITS, BodyLimitMiddleware, BodyLimits

if TYPE_CHECKING:
    from starlette.routing import BaseRoute

    from sessions import Services, SessionManager

log = logging.getLogger(__name__)

SHUTDOWN_TURN_WAIT_S = 120.0
"""How long a shutdown waits for chat turns in flight (they are stored when they complete)."""


class ListenError(Exception):
    """The server cannot listen on the address; the message is one line for the operator."""


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Bind (without listening yet) the sockets `serve` listens on: one per address of `host`, with
    the options uvicorn and asyncio use. Done before the model loads, so a taken port fails at once.

    Raises:
        ListenError: if the port is in use or the address cannot be bound.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {host}: {exc.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(f"port {port} on {host} is in use (is `make run` still running?)") from None
        raise ListenError(f"cannot listen on port {port} on {host}: {exc.strerror or exc}") from None
    return sockets


def build_app(services: Services, *, local: bool, token: str, body_limits: BodyLimits = DEFAULT_BODY_LIMITS) -> FastAPI:
    """The whole server app over the composition root's `services` (`sessions.open_services`).
    Its `state.chat_ui` is the chat page's `ChatUI`.

    Args:
        local: single-tenant local mode (no API key asked; the UI uses the `local` tenant).
        token: the admin token the `/admin/` routes require (`/v1/` takes tenants' API keys).
        body_limits: the largest request body per path (413 above it; see `app.http.body_limits`).
    """
    import gradio as gr

    from app.http.admin_api import admin_router
    from app.http.api_auth import TenantLimiter, api_route_class
    from app.http.conversations_api import conversations_router
    from app.http.forwarding import Forwarder
    from app.http.openai_api import openai_router
    from app.http.prefetch import Prefetcher
    from app.http.responses_api import responses_router
    from app.http.session_api import session_router
    from app.ui import UI_CSS, UI_TRANSLATIONS, ChatUI, build_ui

    manager = services.manager
    forwarder = Forwarder(manager)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await forwarder.aclose()

    app = FastAPI(
        title="chatkv",
        description="Chat sessions that keep their KV cache. `/v1/`: OpenAI-compatible chat completions, the "
        "Responses and Conversations APIs and "
        "chatkv's sessions, authenticated with a tenant's API key as a bearer token.",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.include_router(admin_router(manager, token), prefix="/admin")
    limiter = TenantLimiter(manager.settings.max_concurrent_requests_per_tenant)
    route_class = api_route_class(manager, limiter)
    prefetcher = Prefetcher(manager)
    app.state.prefetcher = prefetcher
    app.include_router(openai_router(services, route_class, forwarder), prefix="/v1")
    app.include_router(responses_router(services, route_class, forwarder), prefix="/v1")
    app.include_router(conversations_router(services.conversations, route_class), prefix="/v1")
    app.include_router(session_router(services, route_class, prefetcher, forwarder), prefix="/v1")
    api_routes = _answer_unrouted_v1(app)
    chat_ui = ChatUI(manager, local=local, prefetcher=prefetcher)
    app.state.chat_ui = chat_ui

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(services.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        """200 while serving; 503 `draining` while this replica hands its sessions over (a load
        balancer's health check then stops sending it requests)."""
        draining = manager.draining
        body = {"status": "draining" if draining else "ok", "model": manager.model_name}
        return JSONResponse(body, status_code=503 if draining else 200)

    app.add_middleware(BodyLimitMiddleware, limits=body_limits)
    # Gradio's run history would keep what was typed (API keys, messages) in the browser's storage,
    # and its API page documents event endpoints that are internal to this page: both off. The page
    # has no file input, so no upload is accepted (the body limits refuse them before Gradio too).
    app = gr.mount_gradio_app(
        app,
        build_ui(manager, local=local, chat_ui=chat_ui),
        path="/",
        footer_links=[],
        run_history=False,
        max_file_size=0,
        ssr_mode=False,
        css=UI_CSS,
        i18n=gr.I18n(**UI_TRANSLATIONS),
    )
    _answer_unrouted_outside_v1(app, api_routes)
    return app


_METHODS = ["DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT"]


def _answer_unrouted_v1(app: FastAPI) -> list[BaseRoute]:
    """Answer a `/v1/` request no route takes in OpenAI's error shape: 404 `unknown_url`, or 405
    `method_not_allowed` when routes have the path with other methods. Without this, the UI
    mounted at `/` would answer it with its own `{"detail": "Not Found"}`. Must be added after
    the `/v1/` routers and before the UI: it matches every path and method under `/v1`, and only
    the routes there before it count; returns them."""
    from starlette.routing import Match

    from app.http.api_errors import method_not_allowed, unknown_url

    known = list(app.router.routes)

    def unrouted(request: Request) -> JSONResponse:
        method, path = request.method, request.url.path
        allowed = [
            other
            for other in _METHODS
            if any(route.matches({"type": "http", "path": path, "method": other})[0] is Match.FULL for route in known)
        ]
        return method_not_allowed(method, path, allowed) if allowed else unknown_url(method, path)

    for path in ("/v1", "/v1/{path:path}"):
        app.add_api_route(path, unrouted, methods=_METHODS, include_in_schema=False)
    return known


def _answer_unrouted_outside_v1(app: FastAPI, api: list[BaseRoute]) -> None:
    """Answer a path outside `/v1/` that nothing serves in OpenAI's error shape, 404 `unknown_url`,
    instead of the UI's `{"detail": "Not Found"}`; for an API path sent without its `/v1` prefix
    (`/chat/completions`, `/responses`), the message names the path under `/v1`. Every such path
    falls through to the UI mounted at `/`, so the answer is that app's 404 handler; a 404 the UI
    raises with a reason of its own (a file it does not have) keeps the reason, and one under
    `/admin/` keeps the admin API's shape (`{"detail": ...}`). `api`: the app's routes before the
    catch-alls of `_answer_unrouted_v1`."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Match, Mount

    from app.http.api_errors import error_response, unknown_url

    ui = [route.app for route in app.router.routes if isinstance(route, Mount)][-1]
    if not isinstance(ui, Starlette):
        raise RuntimeError(f"bug: the UI is mounted as {type(ui).__name__}, not an app")

    def under_v1(method: str, path: str) -> str | None:
        scope = {"type": "http", "path": "/v1" + path, "method": method}
        known = any(route.matches(scope)[0] is not Match.NONE for route in api)
        return "/v1" + path if known else None

    async def not_found(request: Request, exc: Exception) -> Response:
        reason = exc.detail if isinstance(exc, HTTPException) else None
        path = request.url.path
        if path == "/admin" or path.startswith("/admin/"):  # the admin API answers in its own shape
            return JSONResponse({"detail": reason or "Not Found"}, status_code=404)
        if reason not in (None, "Not Found"):
            return error_response(404, str(reason), "not_found")
        return unknown_url(request.method, path, under_v1(request.method, path))

    ui.add_exception_handler(404, not_found)


def serve(
    services: Services,
    *,
    host: str = "127.0.0.1",
    port: int = 7860,
    local: bool = False,
    sockets: list[socket.socket] | None = None,
    log_level: str = "warning",
) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM, both a normal end: exit code 0), holding the home
    lock and expiring idle implicit sessions (`SessionManager.start_retention_sweeps`); at the end
    waits for chat turns in flight, then closes the manager, which stops the sweeps and persists its
    caches so the next start resumes warm.

    Args:
        sockets: from `bind_sockets(host, port)`, bound before the manager was made (default: bound
            here). They are closed at the end.
        log_level: uvicorn's (`info` logs each request: its access log). Its records go to the root
            logger's handlers (`app.cli.logs.configure_logging`), not to a configuration of its own.

    Raises:
        HomeLocked: if another live server holds the same chatkv home.
        ListenError: if the port cannot be bound, or the server did not start.
    """
    # Over 60 lines: start-up and shutdown are one sequence of steps whose order matters (the
    # `finally` undoes them in reverse); split, the order would be harder to see.
    import uvicorn

    from sessions import ADMIN_TOKEN_FILE, HomeLock, admin_token

    url = f"http://{host}:{port}"
    manager = services.manager
    configured = manager.settings.admin_token
    token = admin_token(manager.settings.home, configured)
    token_source = "from CHATKV_ADMIN_TOKEN" if configured else f"in {manager.settings.home / ADMIN_TOKEN_FILE}"
    app = None
    try:
        if sockets is None:
            sockets = bind_sockets(host, port)
        with HomeLock(manager.settings.home, url), _sigterm_exits():
            listening_url = advertised_url(host, port)
            manager.set_replica_url(listening_url)
            log.info("building the chat UI, the /v1/ API and the admin API")
            app = build_app(services, local=local, token=token)
            # Implicit sessions and uncontinued forks expire here; `manager.close()` stops the sweeps.
            manager.start_retention_sweeps()
            # The address and the admin token's place are what a person starting the server needs:
            # shown at any --log-level, not only at info.
            shown = max(logging.INFO, log.getEffectiveLevel())
            log.log(shown, "chatkv serving %s on %s (admin token %s)", manager.model_name, url, token_source)
            if manager.replica_id is not None:
                advertised = manager.settings.replica_url or listening_url
                log.info("replica %s, reachable at %s (CHATKV_REPLICA_URL)", manager.replica_id, advertised)
                if re.match(r"https?://(localhost|127\.|\[::1\])", advertised) and host not in _LOOPBACK:
                    log.warning(
                        "this replica tells clients of other replicas to come to %s, which only this "
                        "machine reaches: set CHATKV_REPLICA_URL",
                        advertised,
                    )
            config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=None, access_log=True)
            server = _draining_server_class()(config, manager)
            with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: uvicorn shut down gracefully
                server.run(sockets=sockets)
            if not server.started:
                raise ListenError(f"the server on {url} did not start")
    finally:
        if app is not None:
            log.info("chatkv stopping: finishing the turns in flight, then persisting caches")
        for sock in sockets or ():
            sock.close()
        if app is not None and not app.state.chat_ui.wait_for_turns(SHUTDOWN_TURN_WAIT_S):
            log.warning("chat turns still running after %.0f s are abandoned", SHUTDOWN_TURN_WAIT_S)
        if app is not None:
            app.state.prefetcher.close()  # uvicorn has already waited for the /v1/ requests in flight
        manager.close()
        if app is not None:
            log.info("chatkv stopped")


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _draining_server_class() -> type:
    """`uvicorn.Server` that starts draining the replica (`SessionManager.drain`) on the first
    SIGTERM or Ctrl-C, while uvicorn waits for the requests in flight: other replicas hand its
    sessions over rather than forward turns to it, and each session is published and released as
    soon as its turn ends, not when the process exits (docs/replicas.md, "Drain")."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self, config: uvicorn.Config, manager: SessionManager) -> None:
            super().__init__(config)
            self._manager = manager

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if not self.should_exit:  # the first signal; a signal handler must not block: a thread
                threading.Thread(target=self._drain, name="chatkv-drain", daemon=True).start()
            super().handle_exit(sig, frame)

        def _drain(self) -> None:
            try:
                self._manager.drain()
            # A drain that fails (the database is down) leaves the stop as it was before drains:
            # sessions are still published and released when the manager closes.
            except Exception:
                log.exception("could not start draining; the sessions are handed over at exit")

    return DrainingServer


def advertised_url(host: str, port: int) -> str:
    """The URL other replicas' clients can reach this server at: the listening address, or the
    machine's host name when it listens on every interface."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Make SIGTERM end the process with exit code 0 (a requested shutdown is a success), after
    the `finally` blocks that persist caches and release the home lock.

    uvicorn shuts down gracefully on SIGTERM and then raises the signal again under the handler that
    was installed before it started; with the default handler that kills the process at once, so
    `manager.close()` (persisting caches) and the home lock's release would never run. This handler
    raises `SystemExit(0)` instead.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread; uvicorn then ignores signals too
        return

    def exit_now(signum: int, frame: object) -> None:
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
