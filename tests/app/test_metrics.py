"""`/metrics` of the real server app, parsed with `prometheus_client`'s own parser, while real turns run
on a tiny model and the admin API moves the cache between tiers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.http.server import build_app
from cache.tiers import CacheKey
from sessions.engine import Engine
from sessions.manager import Services, SessionManager, open_services
from sessions.records import Reply
from tests.conftest import make_settings

TOKEN = "metrics-test-token"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def client(tiny_services: Services) -> Iterator[TestClient]:
    with TestClient(build_app(tiny_services, local=True, token=TOKEN)) as client:
        yield client


def scrape(client: TestClient) -> Samples:
    response = client.get("/metrics")
    assert response.status_code == 200
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def _turn_counters_moved(before: Samples, after: Samples, reply: Reply) -> None:
    s = reply.stats
    assert delta(before, after, "chatkv_cache_queries_total", unit="tokens") == s.prefill_tokens + s.reused_tokens
    assert delta(before, after, "chatkv_cache_hits_total", unit="tokens") == s.reused_tokens
    assert delta(before, after, "chatkv_cache_queries_total", unit="turns") == 1
    assert delta(before, after, "chatkv_cache_hits_total", unit="turns") == (1 if s.reused_tokens else 0)
    assert delta(before, after, "chatkv_prefill_tokens_total") == s.prefill_tokens
    assert delta(before, after, "chatkv_prefill_tokens_saved_total") == s.reused_tokens
    assert delta(before, after, "chatkv_decode_tokens_total") == s.decode_tokens
    assert delta(before, after, "chatkv_turns_total", restored_from=s.restored_from) == 1
    assert delta(before, after, "chatkv_ttft_seconds_count") == 1
    assert delta(before, after, "chatkv_ttft_seconds_sum") == pytest.approx(s.ttft_s)


def test_counters_move_as_turns_run(client: TestClient, tiny_manager: SessionManager) -> None:
    tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session("acme", system_prompt="You are terse.")
    start = scrape(client)
    assert value(start, "chatkv_prefill_tokens_total") == 0
    assert value(start, "chatkv_tier_sessions", tier="device") == 0

    first = tiny_manager.chat("acme", sid, "Hello there", max_new_tokens=6)
    after_first = scrape(client)
    _turn_counters_moved(start, after_first, first)
    assert first.stats.restored_from == "new"

    second = tiny_manager.chat("acme", sid, "And again", max_new_tokens=6)
    after_second = scrape(client)
    _turn_counters_moved(after_first, after_second, second)
    assert second.stats.restored_from == "device" and second.stats.reused_tokens > 0
    assert value(after_second, "chatkv_tier_sessions", tier="device") == 1
    device_bytes = value(after_second, "chatkv_tier_bytes", tier="device")
    budget = value(after_second, "chatkv_tier_budget_bytes", tier="device")
    assert device_bytes > 0 and budget == tiny_manager.settings.device_budget_bytes
    assert value(after_second, "chatkv_tier_budget_usage_ratio", tier="device") == pytest.approx(device_bytes / budget)
    assert value(after_second, "chatkv_tenant_turns_total", tenant=str(tiny_manager.get_tenant("acme").id)) == 0


def test_evictions_restores_and_integrity_failures(client: TestClient, tiny_manager: SessionManager) -> None:
    tenant = tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session(tenant, system_prompt="You are terse.")
    tiny_manager.chat(tenant, sid, "Hello", max_new_tokens=6)
    tiny_manager.internals.tiers.flush()  # the write-back stored this version: the eviction goes straight to disk
    before = scrape(client)
    evicted = client.post(
        f"/admin/sessions/{sid}/evict",
        params={"tenant": "acme", "to": "disk"},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert evicted.json() == {"id": sid, "tier": "disk"}
    moved = scrape(client)
    assert delta(before, moved, "chatkv_evictions_total", source="device", target="disk") == 1
    assert delta(before, moved, "chatkv_evictions_total", source="device", target="host") == 0
    assert value(moved, "chatkv_tier_sessions", tier="disk") == 1
    assert value(moved, "chatkv_tier_sessions", tier="device") == 0

    reply = tiny_manager.chat(tenant, sid, "Back again", max_new_tokens=6)
    restored = scrape(client)
    assert reply.stats.restored_from == "disk"
    assert delta(moved, restored, "chatkv_restores_total", tier="disk") == 1
    assert delta(moved, restored, "chatkv_restore_seconds_count", tier="disk") == 1
    _turn_counters_moved(moved, restored, reply)

    tiny_manager.evict_session(tenant, sid, "disk")
    blob = tiny_manager.internals.disk_store.path_for(CacheKey(tenant.id, sid))
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0x01  # one flipped bit in the AES-GCM tag
    blob.write_bytes(bytes(data))
    tampered = scrape(client)
    rebuilt = tiny_manager.chat(tenant, sid, "Still there?", max_new_tokens=6)
    assert rebuilt.stats.restored_from == "rebuilt"
    after = scrape(client)
    assert delta(tampered, after, "chatkv_integrity_failures_total", tier="disk") == 1
    _turn_counters_moved(tampered, after, rebuilt)


def test_per_tenant_labels_only_when_enabled(tmp_path: Path, tiny_engine: Engine) -> None:
    settings = make_settings(tmp_path / "home", metrics_tenant_labels=True)
    services = open_services(settings, engine=tiny_engine)
    with services.manager as manager:
        acme, globex = manager.create_tenant("acme"), manager.create_tenant("globex")
        for tenant, turns in ((acme, 2), (globex, 1)):
            sid = manager.open_session(tenant)
            for turn in range(turns):
                manager.chat(tenant, sid, f"Turn {turn}", max_new_tokens=4)
        with TestClient(build_app(services, local=False, token=TOKEN)) as client:
            samples = scrape(client)
    assert value(samples, "chatkv_tenant_turns_total", tenant=acme.id) == 2
    assert value(samples, "chatkv_tenant_turns_total", tenant=globex.id) == 1


@pytest.mark.parametrize("tenant_labels", [False, True], ids=["one-series", "per-tenant"])
def test_prompt_tokens_from_cache_and_prefilled_and_forks_by_source(
    tmp_path: Path, tiny_engine: Engine, tenant_labels: bool
) -> None:
    """`chatkv_prompt_tokens_total` splits each turn's prompt into tokens served from the cache and
    tokens prefilled, per tenant with tenant labels (else one `tenant="*"` series: tenant ids are
    unbounded label values); `chatkv_forks_total` counts forks by where their cache came from."""
    settings = make_settings(tmp_path / "home", metrics_tenant_labels=tenant_labels)
    services = open_services(settings, engine=tiny_engine)
    with services.manager as manager:
        replies: dict[str, list[Reply]] = {}
        for name, turns in (("acme", 2), ("globex", 1)):
            tenant = manager.create_tenant(name)
            sid = manager.open_session(tenant, system_prompt="You are terse.")
            replies[tenant.id] = [manager.chat(tenant, sid, f"Turn {t}", max_new_tokens=4) for t in range(turns)]
        acme = manager.get_tenant("acme").id
        parent = manager.list_sessions(acme)[0].id
        manager.internals.tiers.flush()
        manager.evict_session(acme, parent, "disk")
        fork = manager.fork(acme, parent, 1)
        replies[acme].append(manager.chat(acme, fork, "Elsewhere", max_new_tokens=4))
        with TestClient(build_app(services, local=False, token=TOKEN)) as client:
            samples = scrape(client)

    def tokens(tenant_ids: list[str], source: str) -> int:
        field = "reused_tokens" if source == "cache" else "prefill_tokens"
        return sum(getattr(r.stats, field) for t in tenant_ids for r in replies[t])

    series = {labels: v for (name, labels), v in samples.items() if name == "chatkv_prompt_tokens_total"}
    if tenant_labels:
        expected = {
            frozenset({("tenant", t), ("source", source)}): tokens([t], source)
            for t in replies
            for source in ("cache", "prefill")
        }
    else:
        expected = {
            frozenset({("tenant", "*"), ("source", source)}): tokens(list(replies), source)
            for source in ("cache", "prefill")
        }
    assert series == expected
    assert tokens(list(replies), "cache") > 0 and tokens(list(replies), "prefill") > 0
    assert value(samples, "chatkv_forks_total", source="disk") == 1
    assert value(samples, "chatkv_forks_total", source="device") == 0
