"""The `/admin/` JSON routes on a live manager (tiny model, real SQLite file, real encryption), and the
CLI's HTTP client against them."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.cli.admin_client import AdminClient, AdminRequestFailed
from app.http.admin_api import admin_router
from sessions.admin import AdminOps
from sessions.manager import SessionManager
from tests.conftest import MASTER_KEY

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

ROUTES = [
    ("GET", "/admin/tenants"),
    ("POST", "/admin/tenants"),
    ("GET", "/admin/tenants/acme"),
    ("DELETE", "/admin/tenants/acme"),
    ("POST", "/admin/tenants/acme/api-key"),
    ("PUT", "/admin/tenants/acme/retention"),
    ("GET", "/admin/sessions"),
    ("GET", "/admin/sessions/s_x?tenant=acme"),
    ("DELETE", "/admin/sessions/s_x?tenant=acme"),
    ("GET", "/admin/sessions/s_x/export?tenant=acme"),
    ("POST", "/admin/sessions/s_x/evict?tenant=acme&to=disk"),
    ("POST", "/admin/sessions/s_x/restore?tenant=acme"),
    ("GET", "/admin/stats"),
    ("POST", "/admin/keys/rotate-master"),
    ("POST", "/admin/gc"),
]


@pytest.fixture
def client(tiny_manager: SessionManager) -> Iterator[TestClient]:
    app = FastAPI()
    app.include_router(admin_router(tiny_manager, TOKEN), prefix="/admin")  # as `app.http.server.build_app` does
    with TestClient(app, headers=AUTH) as client:
        yield client


def _turns(manager: SessionManager, tenant: str, *messages: str) -> str:
    sid = manager.open_session(tenant, system_prompt="You are terse.")
    for message in messages:
        manager.chat(tenant, sid, message, max_new_tokens=5)
    return sid


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}, {"Authorization": TOKEN}],
    ids=["missing", "wrong", "basic", "no-scheme"],
)
def test_every_route_needs_the_admin_token(
    client: TestClient, tiny_manager: SessionManager, method: str, path: str, headers: dict[str, str]
) -> None:
    tiny_manager.create_tenant("acme")
    client.headers.pop("Authorization")
    response = client.request(method, path, headers=headers, json={"name": "x"})
    assert response.status_code == 401
    assert response.json() == {"error": "missing or wrong admin token"}
    assert response.headers["www-authenticate"] == "Bearer"
    assert [t.name for t in tiny_manager.list_tenants()] == ["acme"]


def test_the_token_is_checked_before_the_body_is_parsed(client: TestClient) -> None:
    client.headers.pop("Authorization")
    for body in (b"{not json", b'{"name": "\xff"}', b"[" * 100_000):
        response = client.post("/admin/tenants", content=body, headers={"Content-Type": "application/json"})
        assert (response.status_code, response.json()) == (401, {"error": "missing or wrong admin token"})


def test_a_body_that_is_not_utf8_is_an_error_like_any_other(client: TestClient) -> None:
    utf16 = '{"name": "acme2"}'.encode("utf-16")  # JSON parsers would sniff and accept it
    for body in (b'{"name": "\xff"}', utf16, '{"name": "acme2"}'.encode("utf-16-le")):
        response = client.post("/admin/tenants", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 400
        assert response.json()["error"].startswith("the body is not valid UTF-8")


def test_tenants_crud(client: TestClient, tiny_manager: SessionManager) -> None:
    created = client.post("/admin/tenants", json={"name": "acme"})
    assert created.status_code == 201
    body = created.json()
    assert tiny_manager.tenant_for_api_key(body["api_key"]).id == body["id"]
    assert client.post("/admin/tenants", json={"name": "acme"}).json() == {"error": "tenant exists: acme"}
    assert client.post("/admin/tenants", json={"name": "acme"}).status_code == 409
    assert client.post("/admin/tenants", json={}).status_code == 422
    assert client.post("/admin/tenants", json={"name": "no spaces"}).status_code == 400

    assert [t["name"] for t in client.get("/admin/tenants").json()] == ["acme"]
    shown = client.get(f"/admin/tenants/{body['id']}").json()
    assert shown["name"] == "acme" and shown["sessions"] == 0 and shown["has_api_key"]

    rotated = client.post("/admin/tenants/acme/api-key").json()
    assert tiny_manager.tenant_for_api_key(rotated["api_key"]).name == "acme"
    with pytest.raises(Exception, match="tenant not found"):
        tiny_manager.tenant_for_api_key(body["api_key"])

    assert client.delete("/admin/tenants/acme").json() == {"id": body["id"], "name": "acme", "deleted": True}
    missing = client.get("/admin/tenants/acme")
    assert (missing.status_code, missing.json()) == (404, {"error": "tenant not found: acme"})


def test_sessions_move_through_the_tiers(client: TestClient, tiny_manager: SessionManager) -> None:
    tiny_manager.create_tenant("acme")
    sid = _turns(tiny_manager, "acme", "Hello", "Again")
    params = {"tenant": "acme"}

    def tier() -> str | None:
        [session] = client.get("/admin/sessions", params=params).json()
        return session["tier"]

    assert tier() == "device"
    detail = client.get(f"/admin/sessions/{sid}", params=params).json()
    assert [row["turn_index"] for row in detail["layers"]] == [None, 0, 1]
    own = detail["layers"][1:]
    assert sum(row["bytes"] for row in own) == detail["cache_bytes"]  # exact on an unquantised device cache
    assert all(row["tier"] == "device" for row in own)

    assert client.post(f"/admin/sessions/{sid}/evict", params={**params, "to": "host"}).json() == {
        "id": sid,
        "tier": "host",
    }
    assert tier() == "host"
    assert client.get("/admin/sessions", params={"tier": "host"}).json()[0]["id"] == sid
    assert client.get("/admin/sessions", params={"tier": "device"}).json() == []
    client.post(f"/admin/sessions/{sid}/evict", params={**params, "to": "disk"})
    assert tier() == "disk"
    up = client.post(f"/admin/sessions/{sid}/evict", params={**params, "to": "host"})
    assert up.status_code == 400 and "cannot evict from disk up to host" in up.json()["error"]

    restored = client.post(f"/admin/sessions/{sid}/restore", params=params).json()
    assert restored["tier"] == "device" and restored["restored_from"] == "disk" and not restored["rejected"]
    assert tier() == "device"
    reply = tiny_manager.chat("acme", sid, "Once more", max_new_tokens=5)
    assert reply.stats.restored_from == "device" and reply.stats.prefill_tokens < reply.stats.reused_tokens

    client.post(f"/admin/sessions/{sid}/evict", params={**params, "to": "drop"})
    assert tier() is None
    exported = client.get(f"/admin/sessions/{sid}/export", params=params).json()
    assert [m["text"] for m in exported["messages"]] == [m.text for m in tiny_manager.history("acme", sid)]
    assert client.delete(f"/admin/sessions/{sid}", params=params).json() == {"id": sid, "deleted": True}
    assert client.get("/admin/sessions").json() == []


def test_another_tenants_session_is_answered_like_a_missing_one(
    client: TestClient, tiny_manager: SessionManager
) -> None:
    tiny_manager.create_tenant("acme")
    tiny_manager.create_tenant("globex")
    theirs = _turns(tiny_manager, "globex", "Secret plans")
    missing = "s_" + "0" * 24
    requests = [
        ("GET", "/admin/sessions/{sid}", {}),
        ("GET", "/admin/sessions/{sid}/export", {}),
        ("POST", "/admin/sessions/{sid}/evict", {"to": "drop"}),
        ("POST", "/admin/sessions/{sid}/restore", {}),
        ("DELETE", "/admin/sessions/{sid}", {}),
    ]
    for method, path, extra in requests:
        for sid in (theirs, missing):
            response = client.request(method, path.format(sid=sid), params={"tenant": "acme", **extra})
            assert (response.status_code, response.json()) == (404, {"error": f"session not found: {sid}"})
    assert client.get("/admin/sessions", params={"tenant": "acme"}).json() == []
    assert tiny_manager.session_info("globex", theirs).tier == "device"  # untouched


def test_bad_parameters_are_4xx_with_an_error(client: TestClient, tiny_manager: SessionManager) -> None:
    tiny_manager.create_tenant("acme")
    sid = _turns(tiny_manager, "acme", "Hi")
    cases = [
        ("GET", "/admin/sessions", {"tier": "cloud"}, 400, "tier must be one of device, host, disk, got 'cloud'"),
        ("GET", "/admin/sessions", {"idle_for_s": "soon"}, 422, "idle_for_s: Input should be a valid number"),
        ("GET", "/admin/sessions", {"idle_for_s": "-1"}, 400, "idle_for_s must be between 0 and 100 years"),
        ("GET", "/admin/sessions", {"tenant": "nobody"}, 404, "tenant not found: nobody"),
        ("GET", f"/admin/sessions/{sid}", {}, 422, "tenant: Field required"),
        ("POST", f"/admin/sessions/{sid}/evict", {"tenant": "acme", "to": "moon"}, 400, "evict target must be"),
    ]
    for method, path, params, status, message in cases:
        response = client.request(method, path, params=params)
        assert response.status_code == status, (path, params, response.text)
        assert response.json()["error"].startswith(message), response.json()
    bad_key = client.post("/admin/keys/rotate-master", json={"new_key": "c2hvcnQ="})
    assert (bad_key.status_code, bad_key.json()) == (400, {"error": "the master key must be 32 bytes, got 5"})


def test_stats_gc_and_master_key_rotation(client: TestClient, tiny_manager: SessionManager) -> None:
    tiny_manager.create_tenant("acme")
    sid = _turns(tiny_manager, "acme", "Hello", "Again")
    stats = client.get("/admin/stats").json()
    assert stats["tenants"] == 1 and stats["sessions"] == 1
    assert stats["tiers"]["device"]["sessions"] == 1
    assert stats["prefill_tokens_saved"] > 0 and 0 < stats["cache_hit_rate_tokens"] < 1
    [(tenant_id, tokens)] = stats["prompt_tokens_by_tenant"].items()
    assert tenant_id == tiny_manager.get_tenant("acme").id and tokens["tenant"] == "acme"
    assert (
        tokens["cached_tokens"] == stats["prefill_tokens_saved"]
        and tokens["prefilled_tokens"] == stats["prefill_tokens"]
    )
    assert client.post("/admin/gc").json() == {
        "retention_s": None,
        "dry_run": False,
        "expired_sessions": [],
        "implicit_retention_s": tiny_manager.settings.implicit_retention_s,
        "expired_implicit_sessions": [],
    }

    new_key = "bmV3LW1hc3Rlci1rZXktZm9yLXRoZS10ZXN0cy0zMiE="
    rotated = client.post("/admin/keys/rotate-master", json={"new_key": new_key}).json()
    assert rotated["from_env"] is True and rotated["master_key_id"] == tiny_manager.internals.keys.master.id
    assert tiny_manager.internals.keys.master.key != base64.b64decode(MASTER_KEY)
    refused = client.post("/admin/keys/rotate-master", json={})  # a key from settings cannot be generated
    assert refused.status_code == 400 and "pass the new key explicitly" in refused.json()["error"]
    assert client.get("/admin/sessions/" + sid, params={"tenant": "acme"}).json()["layers"]  # still opens


def test_a_tenants_retention_is_set_and_cleared(client: TestClient, tiny_manager: SessionManager) -> None:
    acme = tiny_manager.create_tenant("acme")
    default = tiny_manager.settings.implicit_retention_s
    assert client.get("/admin/tenants/acme").json()["implicit_retention_s"] is None
    set_ = client.put("/admin/tenants/acme/retention", json={"retention_s": 7 * 86400})
    assert set_.json() == {
        "id": acme.id,
        "name": "acme",
        "implicit_retention_s": 7 * 86400.0,
        "default_implicit_retention_s": default,
    }
    shown = client.get(f"/admin/tenants/{acme.id}").json()
    assert (shown["implicit_retention_s"], shown["default_implicit_retention_s"]) == (7 * 86400.0, default)
    assert client.get("/admin/tenants").json()[0]["implicit_retention_s"] == 7 * 86400.0
    cleared = client.put("/admin/tenants/acme/retention", json={"retention_s": None})
    assert cleared.json()["implicit_retention_s"] is None
    assert client.get("/admin/tenants/acme").json()["implicit_retention_s"] is None

    refused = [
        ({"retention_s": 0}, 400, "a retention must be in (0, 100 years] seconds, got 0"),
        ({"retention_s": -5}, 400, "a retention must be in (0, 100 years]"),
        ({"retention_s": 1e300}, 400, "a retention must be in (0, 100 years]"),
        ({"retention_s": "7d"}, 422, "retention_s: Input should be a valid number"),
        ({"retention_s": True}, 422, "retention_s: Input should be a valid number"),
        ({}, 422, "retention_s: Field required"),
    ]
    for body, status, message in refused:
        response = client.put("/admin/tenants/acme/retention", json=body)
        assert (response.status_code, response.json()["error"][: len(message)]) == (status, message), body
    missing = client.put("/admin/tenants/nobody/retention", json={"retention_s": 60})
    assert (missing.status_code, missing.json()) == (404, {"error": "tenant not found: nobody"})
    assert client.get("/admin/tenants/acme").json()["implicit_retention_s"] is None  # nothing refused was kept


def test_the_cli_client_gets_the_same_answers_as_local_operations(
    client: TestClient, tiny_manager: SessionManager
) -> None:
    tiny_manager.create_tenant("acme")
    sid = _turns(tiny_manager, "acme", "Hello")
    remote, local = AdminClient(client), AdminOps.of(tiny_manager)  # type: ignore[arg-type]  # an httpx.Client
    assert remote.list_tenants() == local.list_tenants()
    assert remote.show_tenant("acme") == local.show_tenant("acme")
    assert remote.list_sessions(tenant="acme", idle_for_s=0) == local.list_sessions(tenant="acme", idle_for_s=0)
    assert remote.inspect_session("acme", sid) == local.inspect_session("acme", sid)
    assert remote.export_session("acme", sid) == local.export_session("acme", sid)
    assert remote.evict_session("acme", sid, "host") == {"id": sid, "tier": "host"}
    assert remote.set_tenant_retention("acme", 60) == local.set_tenant_retention("acme", 60)
    assert remote.gc(dry_run=True) == local.gc(dry_run=True)
    with pytest.raises(AdminRequestFailed, match="session not found: s_nope") as failed:
        remote.inspect_session("acme", "s_nope")
    assert failed.value.status == 404
    with pytest.raises(AdminRequestFailed) as odd:
        remote.inspect_session("acme", "a/b")  # percent-encoded: stays one path segment, reaches no route
    assert odd.value.status == 404


@pytest.mark.parametrize("idle", ["1e11", "1e300", "inf", "-1", "nan"])
def test_an_absurd_idle_duration_is_a_4xx_not_a_500(client: TestClient, idle: str) -> None:
    response = client.get(f"/admin/sessions?idle_for_s={idle}")
    assert 400 <= response.status_code < 500
    assert "error" in response.json()
