"""The admin JSON API under `/admin/`: everything the `chatkv` CLI does, on the server's live manager.

Every route needs `Authorization: Bearer <admin token>` (401 otherwise, compared in constant time,
before the request's body is read). Errors are `{"error": "..."}` with the status of the
`sessions.errors` type (404 for an unknown tenant, and for a session id of another tenant exactly as
for a missing one; 503 with `Retry-After` while the database cannot be reached). Routes are plain
`def`s because the manager blocks on the model and the disk: FastAPI runs them in its threadpool.

    GET    /admin/tenants                         POST /admin/tenants {"name": ...}
    GET    /admin/tenants/{tenant}                DELETE /admin/tenants/{tenant}
    POST   /admin/tenants/{tenant}/api-key        (rotate; the new key is in the answer, once)
    PUT    /admin/tenants/{tenant}/retention {"retention_s": seconds or null (the server's)}
    GET    /admin/sessions?tenant=&tier=&idle_for_s=
    GET    /admin/sessions/{id}?tenant=           (inspect)      DELETE /admin/sessions/{id}?tenant=
    GET    /admin/sessions/{id}/export?tenant=    POST /admin/sessions/{id}/evict?tenant=&to=host|disk|drop
    POST   /admin/sessions/{id}/restore?tenant=   (pre-warm onto the device)
    GET    /admin/stats     POST /admin/keys/rotate-master {"new_key": ...}     POST /admin/gc?dry_run=
    GET    /admin/replicas  POST /admin/replicas/{id}/drain
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from app.http.api_errors import DATABASE_ERRORS, DATABASE_RETRY_AFTER_S, database_outage
from app.http.body_limits import require_utf8_body
from sessions import AdminOps, ChatKVError, Json, SessionManager

UNAUTHORIZED_MESSAGE = "missing or wrong admin token"


def _admin_route_class(expected_token: bytes) -> type[APIRoute]:
    """The route class of the admin routes: checks the token, then answers domain, HTTP and
    validation errors as `{"error": "..."}` (a router cannot register exception handlers, and the
    app's handlers would answer `{"detail": ...}`).

    The token is checked here, before the route's handler runs, because FastAPI reads and parses a
    request's body before it solves the route's dependencies: a dependency would let anyone make
    the server read and parse a body of any size first.
    """

    class AdminRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def route(request: Request) -> Response:
                if not _has_token(request, expected_token):
                    return JSONResponse(
                        {"error": UNAUTHORIZED_MESSAGE},
                        status_code=status.HTTP_401_UNAUTHORIZED,
                        headers={"WWW-Authenticate": "Bearer"},
                    )
                try:
                    await require_utf8_body(request)
                    return await handler(request)
                except ChatKVError as exc:
                    return JSONResponse({"error": str(exc)}, status_code=exc.http_status)
                # Starlette's class: FastAPI raises it for a body it cannot parse (not UTF-8, say).
                except HTTPException as exc:
                    return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)
                except RequestValidationError as exc:
                    return JSONResponse({"error": _validation_message(exc)}, status_code=422)
                except DATABASE_ERRORS as exc:
                    return JSONResponse(
                        {"error": database_outage(exc)},
                        status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
                        headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
                    )

            return route

    return AdminRoute


def _has_token(request: Request, expected_token: bytes) -> bool:
    """`Authorization: Bearer <token>` with the admin token (compared in constant time)."""
    scheme, credentials = get_authorization_scheme_param(request.headers.get("authorization"))
    return scheme.lower() == "bearer" and hmac.compare_digest(credentials.encode(), expected_token)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p not in ("query", "body", "path"))
        parts.append(f"{where}: {error.get('msg', 'invalid')}" if where else str(error.get("msg", "invalid")))
    return "; ".join(parts) or "invalid request"


class TenantCreate(BaseModel):
    name: str


class TenantRetention(BaseModel):
    retention_s: float | None = Field(strict=True)
    """The tenant's idle TTL of implicit sessions and uncontinued forks in seconds; `null`: the
    server's (`CHATKV_IMPLICIT_RETENTION_S`). Required, so a forgotten field never clears it."""


class MasterKeyRotation(BaseModel):
    new_key: str | None = None
    """Base64 of 32 bytes; generated when omitted (required when the key comes from CHATKV_MASTER_KEY)."""


def admin_router(manager: SessionManager, token: str) -> APIRouter:
    """The `/admin/` routes over `manager`, guarded by `token`."""
    # Over 60 lines: the routes are closures over `manager` and `ops`, one short function each.
    if not token:
        raise ValueError("the admin token must not be empty")
    ops = AdminOps.of(manager)
    router = APIRouter(route_class=_admin_route_class(token.encode()))

    @router.get("/tenants")
    def list_tenants() -> list[Json]:
        return ops.list_tenants()

    @router.post("/tenants", status_code=status.HTTP_201_CREATED)
    def create_tenant(body: TenantCreate) -> Json:
        return ops.create_tenant(body.name)

    @router.get("/tenants/{tenant}")
    def show_tenant(tenant: str) -> Json:
        return ops.show_tenant(tenant)

    @router.delete("/tenants/{tenant}")
    def delete_tenant(tenant: str) -> Json:
        return ops.delete_tenant(tenant)

    @router.post("/tenants/{tenant}/api-key")
    def rotate_api_key(tenant: str) -> Json:
        return ops.rotate_api_key(tenant)

    @router.put("/tenants/{tenant}/retention")
    def set_tenant_retention(tenant: str, body: TenantRetention) -> Json:
        return ops.set_tenant_retention(tenant, body.retention_s)

    @router.get("/sessions")
    def list_sessions(
        tenant: str | None = None, tier: str | None = None, idle_for_s: float | None = None
    ) -> list[Json]:
        return ops.list_sessions(tenant=tenant, tier=tier, idle_for_s=idle_for_s)

    @router.get("/sessions/{session_id}")
    def inspect_session(session_id: str, tenant: str) -> Json:
        return ops.inspect_session(tenant, session_id)

    @router.delete("/sessions/{session_id}")
    def delete_session(session_id: str, tenant: str) -> Json:
        return ops.delete_session(tenant, session_id)

    @router.get("/sessions/{session_id}/export")
    def export_session(session_id: str, tenant: str) -> Json:
        return ops.export_session(tenant, session_id)

    @router.post("/sessions/{session_id}/evict")
    def evict_session(session_id: str, tenant: str, to: str) -> Json:
        return ops.evict_session(tenant, session_id, to)

    @router.post("/sessions/{session_id}/restore")
    def restore_session(session_id: str, tenant: str) -> Json:
        return ops.restore_session(tenant, session_id)

    @router.get("/stats")
    def stats() -> Json:
        return ops.stats()

    @router.get("/replicas")
    def replicas() -> Json:
        return ops.replicas()

    @router.post("/replicas/{replica_id}/drain")
    def drain_replica(replica_id: str) -> Json:
        return ops.drain_replica(replica_id)

    @router.post("/keys/rotate-master")
    def rotate_master_key(body: MasterKeyRotation) -> Json:
        return ops.rotate_master_key(body.new_key)

    @router.post("/gc")
    def gc(dry_run: bool = False) -> Json:
        return ops.gc(dry_run=dry_run)

    return router
