"""Issue 4's shared base layer: one KV per tenant and system prompt, never across tenants."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cache.prefix_pool import prefix_key
from cache.tiers import CacheKey, Tier
from sessions.engine import Engine
from sessions.errors import SessionNotFound, TenantNotFound
from sessions.manager import SessionManager
from storage import codec
from tests.conftest import make_settings

SYSTEM = "You are the support bot of Acme. " * 12


def first_turn(manager: SessionManager, tenant: object, system: str = SYSTEM):  # type: ignore[no-untyped-def]
    sid = manager.open_session(tenant, system_prompt=system)  # type: ignore[arg-type]
    return sid, manager.chat(tenant, sid, "Where is my order?", max_new_tokens=6)  # type: ignore[arg-type]


def test_second_session_of_a_tenant_prefills_only_its_first_message(tiny_manager: SessionManager) -> None:
    base_tokens = len(tiny_manager.internals.template.system_prefix_ids(SYSTEM))
    acme = tiny_manager.create_tenant("acme")
    _, one = first_turn(tiny_manager, acme)
    _, two = first_turn(tiny_manager, acme)
    assert one.stats.reused_tokens == 0 and one.stats.base_reused_tokens == 0
    assert two.stats.reused_tokens == two.stats.base_reused_tokens == base_tokens
    assert two.stats.prefill_tokens == one.stats.prefill_tokens - base_tokens
    assert one.token_ids == two.token_ids  # the shared base is the same KV: same greedy reply
    assert len(tiny_manager.internals.tiers.pool) == 1


def test_another_tenant_with_the_same_prompt_gets_no_hit(tiny_manager: SessionManager) -> None:
    acme = tiny_manager.create_tenant("acme")
    beta = tiny_manager.create_tenant("beta")
    first_turn(tiny_manager, acme)
    _, theirs = first_turn(tiny_manager, beta)
    assert theirs.stats.reused_tokens == 0 and theirs.stats.base_reused_tokens == 0
    assert len(tiny_manager.internals.tiers.pool) == 2
    ids = tiny_manager.internals.template.system_prefix_ids(SYSTEM)
    fingerprint = tiny_manager.internals.engine.fingerprint
    assert prefix_key(acme.id, fingerprint, ids) != prefix_key(beta.id, fingerprint, ids)


def test_sharing_can_be_turned_off(tmp_path: Path, tiny_engine: Engine) -> None:
    with SessionManager(make_settings(tmp_path / "home", share_base=False), engine=tiny_engine) as manager:
        acme = manager.create_tenant("acme")
        first_turn(manager, acme)
        _, two = first_turn(manager, acme)
        assert two.stats.reused_tokens == 0


def test_offloaded_sessions_store_a_reference_to_the_base_not_a_copy(tiny_manager: SessionManager) -> None:
    acme = tiny_manager.create_tenant("acme")
    sessions = [first_turn(tiny_manager, acme)[0] for _ in range(2)]
    for sid in sessions:
        assert tiny_manager.evict_session(acme, sid, "disk") == "disk"
    disk = tiny_manager.internals.disk_store
    names = sorted(key.name for key in disk.keys())
    assert len(names) == 3 and sum(name.startswith("base-") for name in names) == 1  # one base blob for both
    for sid in sessions:
        cache = tiny_manager.internals.tiers.stored_cache(CacheKey(acme.id, sid))
        assert cache is not None and cache.base is None and cache.base_tokens > 0
        assert cache.own_keys[0].shape[-2] == cache.own_tokens
    # Restoring re-attaches the one pooled base: bit-identical to the base the sessions started with.
    pooled = tiny_manager.internals.tiers.pool.get(cache.base_key)  # type: ignore[arg-type]
    reply = tiny_manager.chat(acme, sessions[0], "thanks", max_new_tokens=4)
    assert reply.stats.restored_from == "disk"
    restored = tiny_manager.internals.tiers.peek(CacheKey(acme.id, sessions[0]))
    assert restored is not None and restored.base is not None
    if pooled is not None:
        assert all(torch.equal(a, b) for a, b in zip(restored.base.keys, pooled.keys, strict=True))
    assert tiny_manager.internals.tiers.placement(CacheKey(acme.id, sessions[1])) is Tier.DISK
    blob = disk.path_for(CacheKey(acme.id, sessions[1])).read_bytes()
    assert codec is not None and len(blob) < tiny_manager.internals.engine.layout.bytes_per_token * cache.total_tokens


def test_a_new_system_prompt_is_prefilled_in_the_first_turns_own_forward_pass(
    tiny_manager: SessionManager, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    engine = tiny_manager.internals.engine
    passes: list[int] = []
    forward = engine.runner.forward

    def counting(batch):  # type: ignore[no-untyped-def]
        passes.append(batch.input_ids.shape[1])
        return forward(batch)

    monkeypatch.setattr(engine.runner, "forward", counting)
    acme = tiny_manager.create_tenant("acme")
    _, one = first_turn(tiny_manager, acme)
    prefills = [n for n in passes if n > 1]
    assert prefills == [one.stats.prefill_tokens]  # base and message in one pass, not two
    ids = tiny_manager.internals.template.system_prefix_ids(SYSTEM)
    base = tiny_manager.internals.tiers.pool.get(prefix_key(acme.id, engine.fingerprint, ids))
    assert base is not None and base.token_ids == tuple(ids)
    keys, values = engine.compute_prefix(ids)  # the prefix alone, at positions 0..n-1
    for got, want in zip((*base.keys, *base.values), (*keys, *values), strict=True):
        torch.testing.assert_close(got, want)


def test_a_tenant_deleted_during_its_first_turn_leaves_no_base_in_the_pool(
    tiny_manager: SessionManager, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    engine = tiny_manager.internals.engine
    acme = tiny_manager.create_tenant("acme")
    sid = tiny_manager.open_session(acme, system_prompt=SYSTEM)
    forward = engine.runner.forward

    def forward_then_delete(batch):  # type: ignore[no-untyped-def]
        logits = forward(batch)
        monkeypatch.setattr(engine.runner, "forward", forward)
        tiny_manager.delete_tenant(acme)  # while the first turn (which computes the base) runs
        return logits

    monkeypatch.setattr(engine.runner, "forward", forward_then_delete)
    with pytest.raises((SessionNotFound, TenantNotFound)):
        tiny_manager.chat(acme, sid, "Where is my order?", max_new_tokens=4)
    assert len(tiny_manager.internals.tiers.pool) == 0 and tiny_manager.internals.tiers.pool.nbytes() == 0
