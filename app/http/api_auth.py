"""Who is calling the `/v1/` API, and how many of their requests run at once.

Every `/v1/` request carries `Authorization: Bearer <tenant API key>`; the tenant is always the
key's (`SessionManager.tenant_for_api_key`), never a field of the body. The key is checked by the
route class, before the route's handler runs, because FastAPI reads and parses a body before it
solves a route's dependencies (as for the admin routes, `app.http.admin_api`): without a valid key
nothing of the body is read. A missing and a wrong key get the same 401.

Then the tenant takes one of its `max_concurrent_requests_per_tenant` slots, held until the answer
is complete (a streamed answer's slot is released when its stream ends, also when its client goes
away); a request over the limit is answered 429 with `Retry-After`, before its body is read.
Errors of the handler are answered in OpenAI's shape (`app.http.api_errors`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from starlette.exceptions import HTTPException

from app.http.api_errors import DATABASE_ERRORS, ApiError, error_response, response_for, unauthorized
from app.http.body_limits import require_utf8_body
from app.http.forwarding import ForwardedResponse
from app.http.sse import EventStream
from sessions import ChatKVError, SessionManager, Tenant, TenantId, TenantNotFound

RETRY_AFTER_S = 1

bearer_scheme = HTTPBearer(
    auto_error=False, description="The tenant's API key (`chatkv tenants create` prints it once)."
)
"""Declared on the `/v1/` routers so the OpenAPI schema shows the scheme; the check itself is the
route class's."""


class TenantLimiter:
    """Counts each tenant's requests in flight against one limit. Thread-safe."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the per-tenant request limit must be >= 1, got {limit}")
        self.limit = limit
        self._counts: dict[TenantId, int] = {}
        self._lock = threading.Lock()

    def try_acquire(self, tenant_id: TenantId) -> Callable[[], None] | None:
        """Take a slot; returns its release function (idempotent), or `None` at the limit."""
        with self._lock:
            if self._counts.get(tenant_id, 0) >= self.limit:
                return None
            self._counts[tenant_id] = self._counts.get(tenant_id, 0) + 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if released.is_set():
                    return
                released.set()
                left = self._counts[tenant_id] - 1
                if left:
                    self._counts[tenant_id] = left
                else:
                    del self._counts[tenant_id]

        return release

    def in_flight(self, tenant_id: TenantId) -> int:
        with self._lock:
            return self._counts.get(tenant_id, 0)


def tenant_of(request: Request) -> Tenant:
    """The authenticated tenant of a `/v1/` request (a dependency of the routes)."""
    tenant = getattr(request.state, "tenant", None)
    if not isinstance(tenant, Tenant):
        raise RuntimeError("bug: a /v1/ route ran without the API route class")
    return tenant


def _tenant_for(manager: SessionManager, request: Request) -> Tenant | None:
    scheme, credentials = get_authorization_scheme_param(request.headers.get("authorization"))
    if scheme.lower() != "bearer" or not credentials:
        return None
    try:
        return manager.tenant_for_api_key(credentials)
    except TenantNotFound:
        return None


def api_route_class(manager: SessionManager, limiter: TenantLimiter) -> type[APIRoute]:
    """The route class of every `/v1/` route: key, then slot, then the handler (see the module)."""

    class ApiRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def route(request: Request) -> Response:
                # A key's check hashes it (PBKDF2) and reads the database: not on the event loop.
                try:
                    tenant = await run_in_threadpool(_tenant_for, manager, request)
                except DATABASE_ERRORS as exc:
                    return response_for(exc)
                if tenant is None:
                    return unauthorized()
                release = limiter.try_acquire(tenant.id)
                if release is None:
                    return error_response(
                        429,
                        f"too many requests in flight for this tenant (the limit is {limiter.limit}); retry shortly",
                        "rate_limit_exceeded",
                        headers={"Retry-After": str(RETRY_AFTER_S)},
                    )
                request.state.tenant = tenant
                try:
                    await require_utf8_body(request)
                    response = await handler(request)
                except TenantNotFound:  # deleted while the request ran: its key is no longer valid
                    release()
                    return unauthorized()
                except (ApiError, ChatKVError, HTTPException, RequestValidationError, *DATABASE_ERRORS) as exc:
                    release()
                    return response_for(exc)
                # Not a blanket catch: any other error (a bug, a cancelled task) gives the tenant's
                # slot back and propagates unchanged.
                except BaseException:
                    release()
                    raise
                if isinstance(response, EventStream | ForwardedResponse):  # streamed: released at the end
                    response.call_on_close(release)
                else:
                    release()
                return response

            return route

    return ApiRoute
