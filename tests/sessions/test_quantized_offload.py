"""Quantised demotion through the manager: lossy turn layers in lower tiers, exact base; a sealed
cache of any precision fits the payload bound a reader checks before opening it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.offload import HEADER_ALLOWANCE_BYTES, max_payload_bytes
from storage.chunked_blobs import ChunkedHeader
from tests.conftest import make_settings


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_offloaded_turn_layers_are_stored_quantised_and_the_base_exact(
    tmp_path: Path, tiny_engine: Engine, precision: str
) -> None:
    settings = make_settings(tmp_path / "home", offload_precision=precision, quant_residual_tokens=8)
    with SessionManager(settings, engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt="System prompt " * 10)
        for turn in range(3):
            manager.chat(tenant, sid, f"message {turn} " + "words " * 30, max_new_tokens=8)
        key = manager.internals.tiers_key(tenant, sid)
        hot = manager.internals.tiers.peek(key)
        assert hot is not None
        assert manager.evict_session(tenant, sid, "host") == "host"
        host_bytes = manager.internals.tiers.entry_bytes(key)
        layers = manager.inspect_session(tenant, sid).layers
        assert layers[0].kind.value == "base" and layers[0].precision == "exact"
        assert any(span.precision == precision for span in layers[1:])
        reply = manager.chat(tenant, sid, "go on", max_new_tokens=4)
        assert reply.stats.restored_from == "host"
        assert reply.stats.reused_tokens == hot.total_tokens  # length accounting includes quantised tokens
        restored = manager.internals.tiers.peek(key)
        assert restored is not None and restored.base is not None
        assert all(torch.equal(a, b) for a, b in zip(restored.base.keys, hot.base.keys, strict=True))  # type: ignore[union-attr]
        exact_bytes = hot.own_nbytes
        assert host_bytes < exact_bytes * (0.6 if precision == "int8" else 0.45)


@pytest.mark.parametrize("precision", ["exact", "int8", "int4"])
def test_a_sealed_cache_of_many_short_turns_fits_the_payload_bound_of_its_tokens_without_the_allowance(
    tmp_path: Path, tiny_engine: Engine, precision: str
) -> None:
    settings = make_settings(tmp_path / "home", offload_precision=precision, quant_residual_tokens=8)
    with SessionManager(settings, engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        sid = manager.open_session(tenant, system_prompt="Be brief.")
        for turn in range(12):  # short turns: the layer table's largest share per token
            manager.chat(tenant, sid, f"hi {turn}", max_new_tokens=1)
        key = manager.internals.tiers_key(tenant, sid)
        cache = manager.internals.tiers.peek(key)
        assert cache is not None
        payload_bytes = ChunkedHeader.parse(manager.internals.sealer.seal_session(key, cache)).payload_bytes
        per_token_share = max_payload_bytes(cache.total_tokens, tiny_engine.layout) - HEADER_ALLOWANCE_BYTES
        assert payload_bytes <= per_token_share // 2  # a margin of two on top
