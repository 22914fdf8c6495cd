"""The `attention` window policy through the manager: eviction by importance per KV head, the base and
recent tokens kept, restores from host and disk, a policy switch on existing sessions, bad settings."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
import torch

from cache.layer_table import LayerKind
from cache.serialization import session_cache_to_tensors
from sessions.engine import Engine
from sessions.errors import ContextTooLong
from sessions.manager import SessionManager
from storage import codec
from storage.keyring import blob_aad, seal
from tests.conftest import make_settings
from tests.sessions.window_helpers import BUDGET, MESSAGES, RECENT, SYSTEM, cache_of, open_windowed, record_reservations

CHUNK = 128  # window_rebuild_chunk_tokens in the test of the reservations


def open_manager(home: Path, engine: Engine, **overrides: object) -> SessionManager:
    return open_windowed(home, engine, "attention", **{"window_observation_tokens": 8, **overrides})


def evicted_session(home: Path, engine: Engine) -> str:
    """Tenant `acme`'s session after seven turns under `attention` (tokens evicted), its cache
    persisted to disk by the manager's close. Returns its id."""
    with open_manager(home, engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        for message in MESSAGES[:7]:
            manager.chat(tenant, sid, message, max_new_tokens=8)
        assert cache_of(manager, tenant.id, sid).evicted_tokens > 0
    return sid


def test_tokens_are_evicted_per_head_while_every_turn_layer_and_the_base_stay(
    tmp_path: Path, tiny_engine: Engine
) -> None:
    with open_manager(tmp_path / "home", tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        base_ids = manager.internals.template.system_prefix_ids(SYSTEM)
        evicted = 0
        for turn, message in enumerate(MESSAGES):
            before = cache_of(manager, tenant.id, sid) if turn else None
            reply = manager.chat(tenant, sid, message, max_new_tokens=8)
            cache = cache_of(manager, tenant.id, sid)
            assert cache.total_tokens <= BUDGET
            assert cache.base_token_ids == tuple(base_ids)
            if before is not None:
                # demoted_tokens counts this turn's evictions (per head).
                assert reply.stats.demoted_tokens == cache.evicted_tokens - before.evicted_tokens
            evicted += reply.stats.demoted_tokens
        assert evicted > 0
        assert [span.turn_index for span in cache.layers] == list(range(len(MESSAGES)))
        assert all(span.kind is LayerKind.TURN for span in cache.layers)
        assert cache.next_position == cache.base_tokens + len(cache.own_token_ids)  # positions kept
        assert cache.next_position > cache.total_tokens
        assert cache.own_stream_index is not None
        stream_end = cache.next_original_index
        heads = [cache.head_stream_index(layer) for layer in cache.full_layers]
        for per_layer in heads:
            for stream in per_layer:  # the most recent tokens are held by every head, in every model layer
                assert stream[-RECENT:].tolist() == list(range(stream_end - RECENT, stream_end))
        # Heads differ in what they keep (their scores differ), and, per head budgets (Ada-KV), in
        # how many: every full model layer holds the same total.
        assert any(not torch.equal(per_layer[0], per_layer[1]) for per_layer in heads)
        assert cache.ragged
        for layer in cache.full_layers:
            assert sum(cache.head_tokens(layer)) == cache.kv_heads(layer) * cache.own_tokens


def test_the_scoring_and_rebuild_buffers_are_reserved_against_the_device_budget(
    tmp_path: Path, tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open_manager(tmp_path / "home", tiny_engine, window_rebuild_chunk_tokens=CHUNK) as manager:
        # Reservations made on the turn's own thread (the engine loop's admission of the request
        # itself runs on the loop's thread and is not counted here).
        reserved = record_reservations(manager, monkeypatch)
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        per_token = tiny_engine.layout.bytes_per_token
        evicting = 0
        for index, message in enumerate(MESSAGES[:8]):
            before = cache_of(manager, tenant.id, sid).total_tokens if index else 0
            reserved.clear()
            reply = manager.chat(tenant, sid, message, max_new_tokens=8)
            if reply.stats.demoted_tokens:  # one scoring copy: the cache plus the turn's ids
                evicting += 1
                assert len(reserved) == 1 and reserved[0] > before * per_token, (reserved, before)
            else:
                assert reserved == []
        assert evicting > 0
        manager.evict_session(tenant, sid, "drop")
        reserved.clear()
        assert manager.chat(tenant, sid, MESSAGES[8], max_new_tokens=8).stats.restored_from == "rebuilt"
        *chunks, scoring = reserved  # the kept past's chunks, then the scoring copy
        assert len(chunks) >= 2 and all(n <= (BUDGET + CHUNK) * per_token for n in chunks), chunks
        assert scoring > BUDGET * per_token // 2
        assert manager.internals.tiers.usage().reserved_device_bytes == 0  # every reservation was given back


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_restored_windowed_cache_gives_the_reply_of_the_device_copy(
    tmp_path: Path, tiny_engine: Engine, tier: str
) -> None:
    with open_manager(tmp_path / "home", tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        moved, stayed = (manager.open_session(tenant, system_prompt=SYSTEM) for _ in range(2))
        for message in MESSAGES[:6]:
            a = manager.chat(tenant, moved, message, max_new_tokens=8)
            b = manager.chat(tenant, stayed, message, max_new_tokens=8)
            assert a.token_ids == b.token_ids
        assert cache_of(manager, tenant.id, moved).evicted_tokens > 0
        assert manager.evict_session(tenant, moved, tier) == tier
        reply = manager.chat(tenant, moved, MESSAGES[6], max_new_tokens=8)
        control = manager.chat(tenant, stayed, MESSAGES[6], max_new_tokens=8)
        assert reply.stats.restored_from == tier and control.stats.restored_from == "device"
        assert reply.token_ids == control.token_ids
        assert reply.stats.demoted_tokens == control.stats.demoted_tokens


def test_switching_the_policy_on_existing_sessions_is_handled(tmp_path: Path, tiny_engine: Engine) -> None:
    home = tmp_path / "home"
    sid = evicted_session(home, tiny_engine)
    # attention -> turns: the evicted cache resumes warm; whole layers go, gaps and all.
    with open_manager(home, tiny_engine, window_policy="turns") as manager:
        first = manager.chat("acme", sid, MESSAGES[7], max_new_tokens=8)
        assert first.stats.restored_from == "disk"
        for message in MESSAGES[8:]:
            manager.chat("acme", sid, message, max_new_tokens=8)
        cache = cache_of(manager, "acme", sid)
        assert cache.total_tokens <= BUDGET
        assert cache.layers[0].turn_index is not None and cache.layers[0].turn_index > 0  # turns demoted
        positions = [(s.position_start, s.position_end) for s in cache.layers]
        assert all(end == start for (_, end), (start, _) in itertools.pairwise(positions))
    # turns -> attention: continues, evicting from the re-rotated layers.
    with open_manager(home, tiny_engine) as manager:
        for message in MESSAGES[:3]:
            reply = manager.chat("acme", sid, message, max_new_tokens=8)
            assert reply.stats.restored_from in ("disk", "device")
        assert cache_of(manager, "acme", sid).total_tokens <= BUDGET


def test_switching_to_turns_without_a_rope_layout_re_prefills_the_kept_layers_whole(
    tmp_path: Path, tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    sid = evicted_session(home, tiny_engine)
    # A model whose keys cannot be re-rotated demotes by re-prefilling the layers that stay: the
    # tokens the attention policy evicted from them come back, at contiguous positions.
    monkeypatch.setattr(tiny_engine.runner, "rope_layout", None)
    with open_manager(home, tiny_engine, window_policy="turns") as manager:
        demoted = 0
        for message in MESSAGES[7:]:
            reply = manager.chat("acme", sid, message, max_new_tokens=8)
            demoted += reply.stats.demoted_tokens
            if reply.stats.demoted_tokens:  # the kept layers were prefilled again: only the base was reused
                after = cache_of(manager, "acme", sid)
                assert reply.stats.reused_tokens == after.base_tokens
                assert reply.stats.prefill_tokens > after.own_tokens - reply.stats.decode_tokens
        cache = cache_of(manager, "acme", sid)
    assert demoted > 0
    assert cache.evicted_tokens == 0 and all(span.evicted_tokens == 0 for span in cache.layers)
    assert cache.total_tokens <= BUDGET
    positions = [(s.position_start, s.position_end) for s in cache.layers]
    assert positions[0][0] == cache.base_tokens
    assert all(end == start for (_, end), (start, _) in itertools.pairwise(positions))
    # The kept layers hold exactly what a fresh prefill of their tokens gives.
    fresh = tiny_engine.empty_cache(cache.base)
    working = fresh.to_working_cache(len(cache.own_token_ids))
    tiny_engine.prefill(working, list(cache.own_token_ids))
    expected = fresh.after_turn(working, list(cache.own_token_ids), list(cache.layers))
    for got, want in zip(cache.own_keys, expected.own_keys, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_positions_past_the_model_limit_rebuild_the_window(
    tmp_path: Path, tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tiny_engine.runner, "max_context_tokens", 320)
    with open_manager(tmp_path / "home", tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        sources = []
        for message in MESSAGES:
            reply = manager.chat(tenant, sid, message, max_new_tokens=8)
            sources.append(reply.stats.restored_from)
            cache = cache_of(manager, tenant.id, sid)
            assert cache.next_position <= 320 and cache.total_tokens <= BUDGET
            if reply.stats.restored_from == "rebuilt":
                # The rebuild evicts by attention too: it drops whole turns only down to half-way
                # between the 200-token budget and the model's 320 positions, not to the budget.
                assert cache.evicted_tokens > 0 and reply.stats.demoted_tokens > 0
                kept = sum(span.original_tokens for span in cache.layers)
                assert BUDGET < cache.base_tokens + kept <= 260
        assert "rebuilt" in sources[1:]
        # The turn after a rebuild continues from its cache.
        assert all(after == "device" for before, after in itertools.pairwise(sources) if before == "rebuilt")


def test_a_rebuild_at_once_without_a_stored_cache_evicts_by_attention(tmp_path: Path, tiny_engine: Engine) -> None:
    """`window_rebuild_chunk_tokens` 0 (the default): the kept past prefilled at once (chunked
    rebuilds: tests/sessions/test_window_rebuild.py)."""
    home = tmp_path / "home"
    with open_manager(home, tiny_engine, window_rebuild_chunk_tokens=0) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        for message in MESSAGES[:6]:
            manager.chat(tenant, sid, message, max_new_tokens=8)
        manager.evict_session(tenant, sid, "drop")
        reply = manager.chat(tenant, sid, MESSAGES[6], max_new_tokens=8)
        cache = cache_of(manager, tenant.id, sid)
    assert reply.stats.restored_from == "rebuilt"
    # Whole oldest turns went only down to the budget plus a quarter of it (what the rebuild
    # prefills and holds, whatever the conversation's length); the rest was evicted by attention.
    assert [span.turn_index for span in cache.layers] == list(range(1, 7))
    spanned = cache.base_tokens + sum(span.original_tokens for span in cache.layers)
    assert BUDGET < spanned <= BUDGET + BUDGET // 4
    assert cache.evicted_tokens > 0 and cache.total_tokens <= BUDGET
    assert reply.stats.demoted_tokens > cache.evicted_tokens  # turn 0 as a whole, then by attention


def test_a_turn_that_cannot_fit_beside_the_recent_window_is_refused(tmp_path: Path, tiny_engine: Engine) -> None:
    with open_manager(tmp_path / "home", tiny_engine, window_recent_tokens=150) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        for message in MESSAGES[:3]:
            manager.chat(tenant, sid, message, max_new_tokens=8)
        with pytest.raises(ContextTooLong):
            for message in MESSAGES[3:]:
                manager.chat(tenant, sid, message * 2, max_new_tokens=8)


def test_a_recent_window_above_the_derived_budget_is_refused_at_start(tmp_path: Path, tiny_engine: Engine) -> None:
    budget = int(tiny_engine.max_context_tokens * 0.8)
    settings = make_settings(tmp_path / "home", window_policy="attention", window_recent_tokens=budget)
    with pytest.raises(ValueError, match="window_recent_tokens"):
        SessionManager(settings, engine=tiny_engine)


def test_a_version_1_blob_sealed_before_the_upgrade_still_opens(tmp_path: Path, tiny_engine: Engine) -> None:
    with open_manager(tmp_path / "home", tiny_engine, window_policy="turns") as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        manager.chat(tenant, sid, MESSAGES[0], max_new_tokens=8)
        key = manager.internals.tiers_key(tenant, sid)
        cache = cache_of(manager, tenant.id, sid)
        tensors, header = session_cache_to_tensors(cache)
        header = {**header, "format_version": 1, "model_fingerprint": tiny_engine.fingerprint}
        old = seal(
            manager.internals.keys.data_key(tenant.id),
            codec.encode(tensors, header),
            blob_aad(key.tenant_id, key.name, tiny_engine.fingerprint, 1),
        )
        opened = manager.internals.sealer.open_session(key, old)
        assert opened.layers == cache.layers and opened.own_token_ids == cache.own_token_ids
        assert all(torch.equal(a, b) for a, b in zip(opened.own_keys, cache.own_keys, strict=True))
        assert (
            manager.internals.sealer.open_session(key, manager.internals.sealer.seal_session(key, cache)).layers
            == cache.layers
        )


class FedTokens:
    """Counts the tokens the engine loop feeds (a `StepObserver`)."""

    def __init__(self) -> None:
        self.tokens = 0

    def step(self, requests: int, tokens: int, forward_s: float) -> None:
        self.tokens += tokens


def test_an_evicting_turn_prefills_its_ids_once(tmp_path: Path, tiny_engine: Engine) -> None:
    fed = FedTokens()
    tiny_engine.loop.add_observer(fed)
    try:
        with open_manager(tmp_path / "home", tiny_engine) as manager:
            tenant = manager.create_tenant("acme")
            sid = manager.open_session(tenant, system_prompt=SYSTEM)
            evicting = expected = 0
            for message in MESSAGES[:8]:
                reply = manager.chat(tenant, sid, message, max_new_tokens=8)
                # The turn's ids once, then every sampled token but the last: no scoring copy.
                expected += reply.stats.prefill_tokens + reply.stats.decode_tokens - 1
                # The loop tells its observers after the step that delivered the reply: wait for it.
                deadline = time.monotonic() + 10
                while fed.tokens < expected and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert fed.tokens == expected
                evicting += reply.stats.demoted_tokens > 0
            assert evicting >= 3
    finally:
        tiny_engine.loop.remove_observer(fed)
