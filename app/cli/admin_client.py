"""HTTP client of the admin API (`app.http.admin_api`), for `chatkv --server URL ...`.

`AdminClient` has the methods of `sessions.admin.AdminOps` with the same arguments and answers, so the
CLI runs one code path whether it works on a home directly or through a server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

if TYPE_CHECKING:
    from sessions import Json

DEFAULT_TIMEOUT_S = 120.0
"""Generous: restoring or inspecting a large cache decrypts it, and a gc may delete many sessions."""


class AdminRequestFailed(Exception):
    """The server answered with an error status; `status` is the HTTP status, the message its `error`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class AdminClient:
    """The admin API of the server at `base_url`, authenticated with `token`.

    Raises (from every method):
        AdminRequestFailed: for an error answer (4xx: bad input or not found; 5xx: server failure).
        httpx.HTTPError: if the server cannot be reached or the connection fails.
    """

    def __init__(self, http: httpx.Client) -> None:
        """`http`: a client whose base URL is the server's root, sending the admin token (see `connect`)."""
        self._http = http

    @classmethod
    def connect(cls, base_url: str, token: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> AdminClient:
        """A client of `base_url` (e.g. `http://127.0.0.1:7860`). Raises `ValueError` for a URL
        that is not http(s)."""
        url = httpx.URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"not a server URL: {base_url!r} (example: http://127.0.0.1:7860)")
        http = httpx.Client(
            base_url=base_url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
        )
        return cls(http)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        if "params" in kwargs:
            kwargs["params"] = {k: v for k, v in kwargs["params"].items() if v is not None}
        response = self._http.request(method, "/admin" + path, **kwargs)
        if response.is_error:
            raise AdminRequestFailed(response.status_code, _error_message(response))
        return response.json()

    # -- tenants -------------------------------------------------------------------------------

    def list_tenants(self) -> list[Json]:
        return self._call("GET", "/tenants")

    def show_tenant(self, tenant: str) -> Json:
        return self._call("GET", f"/tenants/{_segment(tenant)}")

    def create_tenant(self, name: str) -> Json:
        return self._call("POST", "/tenants", json={"name": name})

    def rotate_api_key(self, tenant: str) -> Json:
        return self._call("POST", f"/tenants/{_segment(tenant)}/api-key")

    def delete_tenant(self, tenant: str) -> Json:
        return self._call("DELETE", f"/tenants/{_segment(tenant)}")

    def set_tenant_retention(self, tenant: str, retention_s: float | None) -> Json:
        return self._call("PUT", f"/tenants/{_segment(tenant)}/retention", json={"retention_s": retention_s})

    # -- sessions ------------------------------------------------------------------------------

    def list_sessions(
        self, *, tenant: str | None = None, tier: str | None = None, idle_for_s: float | None = None
    ) -> list[Json]:
        return self._call("GET", "/sessions", params={"tenant": tenant, "tier": tier, "idle_for_s": idle_for_s})

    def inspect_session(self, tenant: str, session_id: str) -> Json:
        return self._call("GET", f"/sessions/{_segment(session_id)}", params={"tenant": tenant})

    def evict_session(self, tenant: str, session_id: str, to: str) -> Json:
        return self._call("POST", f"/sessions/{_segment(session_id)}/evict", params={"tenant": tenant, "to": to})

    def restore_session(self, tenant: str, session_id: str) -> Json:
        return self._call("POST", f"/sessions/{_segment(session_id)}/restore", params={"tenant": tenant})

    def delete_session(self, tenant: str, session_id: str) -> Json:
        return self._call("DELETE", f"/sessions/{_segment(session_id)}", params={"tenant": tenant})

    def export_session(self, tenant: str, session_id: str) -> Json:
        return self._call("GET", f"/sessions/{_segment(session_id)}/export", params={"tenant": tenant})

    # -- operations ----------------------------------------------------------------------------

    def stats(self) -> Json:
        return self._call("GET", "/stats")

    def replicas(self) -> Json:
        return self._call("GET", "/replicas")

    def drain_replica(self, replica_id: str) -> Json:
        return self._call("POST", f"/replicas/{_segment(replica_id)}/drain")

    def rotate_master_key(self, new_key: str | None = None) -> Json:
        return self._call("POST", "/keys/rotate-master", json={"new_key": new_key})

    def gc(self, *, dry_run: bool = False) -> Json:
        return self._call("POST", "/gc", params={"dry_run": dry_run})


def _segment(value: str) -> str:
    """A path segment: percent-encoded, so an id with `/` or `?` cannot reach another route."""
    return quote(value, safe="")


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return body["error"]
    return f"the server answered {response.status_code} {response.reason_phrase}"
