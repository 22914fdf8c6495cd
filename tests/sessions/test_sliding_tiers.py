"""A model with sliding-window layers (tiny Gemma-3 shape) through every tier and window policy:
its sliding layers hold their window only, on the device, in host and disk blobs and in Redis
chunks; the replies after a restore are exact; INT8 offload leaves the windows exact; the
`attention` policy evicts from full-attention layers only; and a blob written before per-layer
attention kinds is rebuilt, never misread."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cache.serialization import session_cache_to_tensors
from cache.session_cache import SessionCache
from sessions.engine import Engine
from sessions.manager import SessionManager
from storage import codec
from storage.keyring import blob_aad, seal
from tests.model_families import WINDOW
from tests.sessions.offload_helpers import key_of, open_manager, reference_reply

SYSTEM = "You are a helpful assistant who answers in short sentences."
MESSAGES = [
    "Tell me a story about a fox who lives in a forest near a river and a mountain.",
    "What did the fox eat for breakfast on the first day of spring?",
    "Where does the river go after it leaves the forest?",
]
NEXT = "And what happened on the mountain?"
TOKENS = 8


def converse(manager: SessionManager) -> tuple[str, str]:
    tenant = manager.create_tenant("acme").id
    sid = manager.open_session(tenant, SYSTEM)
    for message in MESSAGES:
        manager.chat(tenant, sid, message, max_new_tokens=TOKENS, ignore_eos=True)
    return tenant, sid


def assert_windows_only(engine: Engine, cache: SessionCache) -> None:
    held = [sum(cache.head_tokens(i)) // cache.kv_heads(i) for i in range(len(cache.own_keys))]  # per head
    assert held == [cache.own_tokens if w is None else w - 1 for w in engine.layout.windows]


def test_a_redis_restore_on_another_replica_is_exact_and_moves_only_the_windows(
    tmp_path: Path, gemma3_engine: Engine, redis_url: str, redis_prefix: str
) -> None:
    shared = {
        "database_url": f"sqlite:///{tmp_path / 'shared.db'}",
        "redis_url": redis_url,
        "redis_prefix": redis_prefix,
    }
    with open_manager(tmp_path / "a", gemma3_engine, replica_id="a", **shared) as first:
        tenant, sid = converse(first)
        cache = first.internals.tiers.peek(key_of(tenant, sid))
        assert cache is not None
        assert_windows_only(gemma3_engine, cache)
        own_bytes = cache.own_nbytes
    with open_manager(tmp_path / "b", gemma3_engine, replica_id="b", **shared) as second:
        assert second.internals.shared_store is not None
        stored = second.internals.shared_store.nbytes(key_of(tenant, sid))
        # Sealed bytes: the windows and the full layer's tokens, plus ids, header and tags; far
        # less than every layer holding every token (6 x the full layer's bytes).
        assert own_bytes < stored < own_bytes + 8192
        assert stored < 6 * cache.own_keys[-1].numel() * 4 * 2
        expected = reference_reply(second, tenant, sid, NEXT, TOKENS)
        reply = second.chat(tenant, sid, NEXT, max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "redis" and reply.token_ids == expected


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_lossy_offload_keeps_the_sliding_windows_exact(tmp_path: Path, gemma3_engine: Engine, precision: str) -> None:
    with open_manager(
        tmp_path / "home", gemma3_engine, offload_precision=precision, quant_residual_tokens=0
    ) as manager:
        tenant, sid = converse(manager)
        before = manager.internals.tiers.peek(key_of(tenant, sid))
        assert before is not None
        assert manager.evict_session(tenant, sid, "host") == "host"
        manager.restore_session(tenant, sid)
        after = manager.internals.tiers.peek(key_of(tenant, sid))
        assert after is not None
        for index, window in enumerate(gemma3_engine.layout.windows):
            same = torch.equal(before.own_keys[index], after.own_keys[index])
            assert same == (window is not None), f"model layer {index}: the full layer is quantised, windows exact"
        assert {span.precision for span in after.layers if not span.pinned} == {precision}
        reply = manager.chat(tenant, sid, NEXT, max_new_tokens=TOKENS)  # a lossy cache still serves
        assert reply.stats.restored_from == "device" and len(reply.token_ids) > 0


@pytest.mark.parametrize("policy", ["attention", "agnostic"])
def test_the_lossy_policies_evict_from_full_layers_only(tmp_path: Path, gemma3_engine: Engine, policy: str) -> None:
    settings = {"window_policy": policy, "context_budget_tokens": 120, "window_recent_tokens": 16}
    with open_manager(tmp_path / "home", gemma3_engine, **settings) as manager:
        tenant, sid = converse(manager)
        reply = manager.chat(tenant, sid, NEXT, max_new_tokens=TOKENS, ignore_eos=True)
        assert reply.stats.demoted_tokens > 0
        cache = manager.internals.tiers.peek(key_of(tenant, sid))
        assert cache is not None and cache.evicted_tokens > 0
        assert_windows_only(gemma3_engine, cache)  # full layer: the table's held tokens; windows whole
        assert cache.total_tokens <= 120


def test_a_blob_written_before_per_layer_attention_kinds_is_rebuilt_exactly(
    tmp_path: Path, gemma3_engine: Engine
) -> None:
    """A format-2 blob of a sliding model holds KV an attention computed past the windows: it must
    be rejected (the session rebuilds from its transcript), not decoded."""
    with open_manager(tmp_path / "home", gemma3_engine) as manager:
        tenant, sid = converse(manager)
        key = key_of(tenant, sid)
        cache = manager.internals.tiers.peek(key)
        assert cache is not None
        tensors, header = session_cache_to_tensors(cache)
        header.update(format_version=2, model_fingerprint=gemma3_engine.fingerprint)
        del header["windows"]
        data_key = manager.internals.keys.data_key(key.tenant_id)
        old = seal(
            data_key, codec.encode(tensors, header), blob_aad(key.tenant_id, key.name, gemma3_engine.fingerprint, 2)
        )
        disk = manager.internals.disk_store
    disk.put(key, old)  # over the blob the closing manager wrote: as left by the version before
    with open_manager(tmp_path / "home", gemma3_engine) as manager:
        expected = reference_reply(manager, tenant, sid, NEXT, TOKENS)
        reply = manager.chat(tenant, sid, NEXT, max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "rebuilt" and reply.token_ids == expected
        rejected = manager.internals.metrics.registry.get_sample_value(
            "chatkv_integrity_failures_total", {"tier": "disk"}
        )
        assert rejected == 1


@pytest.mark.parametrize("window_tokens", [WINDOW])
def test_fork_at_a_turn_whose_windows_the_parent_no_longer_holds_rebuilds_exactly(
    tmp_path: Path, gemma3_engine: Engine, window_tokens: int
) -> None:
    with open_manager(tmp_path / "home", gemma3_engine) as manager:
        tenant, sid = converse(manager)
        parent = manager.internals.tiers.peek(key_of(tenant, sid))
        assert parent is not None and parent.next_position - window_tokens > parent.layers[0].original_start
        fork = manager.fork(tenant, sid, at_turn=1)
        expected = reference_reply(manager, tenant, fork, NEXT, TOKENS)
        reply = manager.chat(tenant, fork, NEXT, max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "rebuilt" and reply.token_ids == expected


def test_regenerating_a_short_last_turn_forks_warm_from_the_window_checkpoint(
    tmp_path: Path, gemma3_engine: Engine
) -> None:
    with open_manager(tmp_path / "home", gemma3_engine) as manager:
        tenant, sid = converse(manager)
        manager.chat(tenant, sid, "Hi", max_new_tokens=3, ignore_eos=True)  # a turn shorter than the window
        parent = manager.internals.tiers.peek(key_of(tenant, sid))
        assert parent is not None and parent.layers[-1].token_count <= WINDOW - 1
        fork = manager.fork(tenant, sid, at_turn=len(MESSAGES))  # regenerate the reply to "Hi"
        expected = reference_reply(manager, tenant, fork, "Hi", TOKENS)
        reply = manager.chat(tenant, fork, "Hi", max_new_tokens=TOKENS)
        assert reply.stats.restored_from == "device" and reply.token_ids == expected
