"""Rebuilds under the lossy window policies (issue 31 item 4): the kept past prefilled in chunks
that evict as they go, so a rebuild holds at most the budget plus a chunk; exact without
eviction; beside other sessions' decoding; and forks of windowed sessions at their latest turn."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from cache.layer_table import LayerKind, LayerSpan
from cache.window_policy import WindowPolicy
from sessions import Reply, TurnOptions, TurnTarget
from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.turn.preparer import CHUNKED_REBUILD_SLACK, REBUILD_SLACK
from sessions.turn.window import TurnWindow, restack_kept
from tests.sessions.offload_helpers import reference_reply
from tests.sessions.window_helpers import BUDGET, MESSAGES, SYSTEM, cache_of, open_windowed, record_reservations

CHUNK = 32


def open_manager(home: Path, engine: Engine, **overrides: object) -> SessionManager:
    values = {"window_observation_tokens": 8, "window_rebuild_chunk_tokens": CHUNK, **overrides}
    return open_windowed(home, engine, "attention", **values)


def conversed(manager: SessionManager, tenant: str, turns: int) -> str:
    sid = manager.open_session(tenant, system_prompt=SYSTEM)
    for message in MESSAGES[:turns]:
        manager.chat(tenant, sid, message, max_new_tokens=8)
    return sid


@pytest.mark.parametrize("allocation", ["uniform", "per_head"])
@pytest.mark.parametrize("policy", ["attention", "agnostic"])
def test_a_chunked_rebuild_never_holds_more_than_the_budget_plus_a_chunk(
    tmp_path: Path, tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch, policy: str, allocation: str
) -> None:
    settings = {"window_policy": policy, "window_budget_allocation": allocation}
    with open_manager(tmp_path / "home", tiny_engine, **settings) as manager:
        tenant = manager.create_tenant("acme").id
        sid = conversed(manager, tenant, 9)
        manager.evict_session(tenant, sid, "drop")
        reserved = record_reservations(manager, monkeypatch)  # the buffers the turn's own thread prefills into
        reply = manager.chat(tenant, sid, MESSAGES[9], max_new_tokens=8)
        cache = cache_of(manager, tenant, sid)
    assert reply.stats.restored_from == "rebuilt"
    per_token = tiny_engine.layout.bytes_per_token
    # The last reservation is a copy of the cache for scores: under `attention` the turn's own
    # prefill, under `agnostic` the reconstruction of the committed turn (after the reply); every
    # chunk's buffer holds the cache so far (at most the budget) and a chunk.
    chunks = reserved[:-1]
    # Per-head budgets hold the budget's bytes at rest; a chunk's working buffer pads each model
    # layer's heads to its longest one (its holes), which these few heads keep within an eighth.
    padding = 0 if allocation == "uniform" else BUDGET // 8
    assert len(chunks) >= 3 and max(chunks) <= (BUDGET + padding + CHUNK) * per_token, (chunks, per_token)
    assert BUDGET < reply.stats.peak_tokens <= BUDGET + CHUNK
    # The past it chose from reached back further than the budget (the eviction chose among
    # more turns than fit), and a turn that did not fit was dropped whole, as before.
    spanned = cache.base_tokens + sum(span.original_tokens for span in cache.layers)
    assert BUDGET + CHUNK < spanned <= BUDGET + int(BUDGET * CHUNKED_REBUILD_SLACK)
    assert cache.layers[0].turn_index != 0 and cache.evicted_tokens > 0 and cache.total_tokens <= BUDGET
    assert reply.stats.demoted_tokens > cache.evicted_tokens
    if policy == "agnostic":  # the chunks' scores stay with the cache, for the next eviction
        assert cache.own_scores is not None


def test_a_chunked_rebuild_keeps_tokens_of_older_turns_than_a_rebuild_at_once(
    tmp_path: Path, tiny_engine: Engine
) -> None:
    first_kept = {}
    for chunk in (0, CHUNK):
        with open_manager(tmp_path / f"chunk-{chunk}", tiny_engine, window_rebuild_chunk_tokens=chunk) as manager:
            tenant = manager.create_tenant("acme").id
            sid = conversed(manager, tenant, 9)
            manager.evict_session(tenant, sid, "drop")
            reply = manager.chat(tenant, sid, MESSAGES[9], max_new_tokens=8)
            cache = cache_of(manager, tenant, sid)
        assert reply.stats.restored_from == "rebuilt" and cache.total_tokens <= BUDGET
        spanned = cache.base_tokens + sum(span.original_tokens for span in cache.layers)
        assert spanned <= BUDGET + int(BUDGET * (CHUNKED_REBUILD_SLACK if chunk else REBUILD_SLACK))
        first_kept[chunk] = cache.layers[0].turn_index
        assert reply.stats.peak_tokens > BUDGET  # at once: the kept past; chunked: the budget and a chunk
    assert first_kept[CHUNK] < first_kept[0]


def test_a_chunked_prefill_without_eviction_equals_the_prefill_at_once(tiny_engine: Engine) -> None:
    """Chunk boundaries inside and between layers: the same layer table and KV as one prefill."""
    ids = tuple(range(40, 40 + 57))
    spans = [
        LayerSpan(LayerKind.TURN, 0, 20, 0, 0),
        LayerSpan(LayerKind.BASE, 1, 9, 20, 20),  # a pinned turn
        LayerSpan(LayerKind.TURN, 2, 28, 29, 29),
    ]
    kept = restack_kept([(s, ids[s.original_start : s.original_start + s.token_count]) for s in spans], [], 0)
    empty = tiny_engine.empty_cache(None)
    at_once = TurnWindow(tiny_engine, WindowPolicy(4096, "attention")).prefill_layers(empty, kept.ids, kept.spans)
    for size in (7, 13):  # a budget above the past: the chunk size alone splits it
        chunked = TurnWindow(tiny_engine, WindowPolicy(4096, "attention", 8, 8, size))
        past = chunked.prefill_evicting(empty, kept)
        assert past.cache.layers == at_once.layers and past.cache.own_token_ids == at_once.own_token_ids
        assert past.cache.own_stream_index is None
        for mine, theirs in zip(past.cache.own_keys, at_once.own_keys, strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("policy", ["attention", "agnostic"])
def test_with_eviction_off_a_rebuild_replies_exactly(tmp_path: Path, tiny_engine: Engine, policy: str) -> None:
    with open_manager(tmp_path / "home", tiny_engine, window_policy=policy, context_budget_tokens=4000) as manager:
        tenant = manager.create_tenant("acme").id
        sid = conversed(manager, tenant, 6)
        manager.evict_session(tenant, sid, "drop")
        expected = reference_reply(manager, tenant, sid, MESSAGES[6], 8)
        reply = manager.chat(tenant, sid, MESSAGES[6], max_new_tokens=8)
    assert reply.stats.restored_from == "rebuilt" and reply.stats.demoted_tokens == 0
    assert reply.token_ids == expected


@pytest.mark.parametrize("policy", ["attention", "agnostic"])
def test_sessions_rebuilding_while_others_decode_reply_as_they_do_alone(
    tmp_path: Path, tiny_engine: Engine, policy: str
) -> None:
    """Two sessions rebuild (their chunks go through the engine loop) while two others decode
    long replies in the same loop: each reply is the one it gives alone."""

    def rebuilding(manager: SessionManager, tenant: str, offset: int, out: dict[str, tuple[int, ...]]) -> None:
        sid = rebuilt[offset]
        out[f"rebuild {offset}"] = manager.chat(tenant, sid, MESSAGES[11 - offset], max_new_tokens=8).token_ids

    def decoding(manager: SessionManager, tenant: str, offset: int, out: dict[str, tuple[int, ...]]) -> None:
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        out[f"decode {offset}"] = manager.chat(tenant, sid, MESSAGES[offset], max_new_tokens=40).token_ids

    results: dict[str, dict[str, tuple[int, ...]]] = {"alone": {}, "together": {}}
    for mode, out in results.items():
        with open_manager(tmp_path / mode, tiny_engine, window_policy=policy) as manager:
            tenant = manager.create_tenant("acme").id
            rebuilt = [conversed(manager, tenant, 8 + offset) for offset in range(2)]
            for sid in rebuilt:
                manager.evict_session(tenant, sid, "drop")
            jobs = [(rebuilding, o) for o in range(2)] + [(decoding, o) for o in range(2)]
            if mode == "alone":
                for job, offset in jobs:
                    job(manager, tenant, offset, out)
            else:
                packed = LargestStep()
                tiny_engine.loop.add_observer(packed)
                threads = [threading.Thread(target=job, args=(manager, tenant, o, out)) for job, o in jobs]
                try:
                    for thread in threads:
                        thread.start()
                    for thread in threads:
                        thread.join()
                finally:
                    tiny_engine.loop.remove_observer(packed)
                assert packed.requests > 1  # the loop did run them together
            assert all(cache_of(manager, tenant, sid).evicted_tokens > 0 for sid in rebuilt)
    assert len(results["together"]) == 4
    assert results["together"] == results["alone"]


class LargestStep:
    """The most requests one engine step ran (a `StepObserver`)."""

    def __init__(self) -> None:
        self.requests = 0

    def step(self, requests: int, tokens: int, forward_s: float) -> None:
        self.requests = max(self.requests, requests)


@pytest.mark.parametrize("policy", ["turns", "attention", "agnostic"])
def test_a_fork_at_a_windowed_sessions_latest_turn_replies_as_the_parent(
    tmp_path: Path, tiny_engine: Engine, policy: str
) -> None:
    with open_manager(tmp_path / "home", tiny_engine, window_policy=policy) as manager:
        tenant = manager.create_tenant("acme").id
        parent = conversed(manager, tenant, 8)
        held = cache_of(manager, tenant, parent)
        windowed = held.layers[0].turn_index != 0 if policy == "turns" else held.evicted_tokens > 0
        assert windowed
        fork = manager.fork(tenant, parent, 8)
        forked = manager.chat(tenant, fork, MESSAGES[10], max_new_tokens=8)
        continued = manager.chat(tenant, parent, MESSAGES[10], max_new_tokens=8)
        assert forked.stats.restored_from == "device" and forked.stats.reused_tokens > 0
        assert forked.token_ids == continued.token_ids
        assert manager.stats()["forks"] == {"device": 1.0}  # no rebuild


def test_a_negative_chunk_is_refused_and_a_zero_one_does_not_chunk(tiny_engine: Engine) -> None:
    with pytest.raises(ValueError, match=r"^window_rebuild_chunk_tokens must be >= 0, got -1$"):
        WindowPolicy(200, "attention", rebuild_chunk_tokens=-1)
    kept = restack_kept([(LayerSpan(LayerKind.TURN, 0, 3, 0, 0), (5, 6, 7))], [], 0)
    at_once = TurnWindow(tiny_engine, WindowPolicy(200, "attention", rebuild_chunk_tokens=0))
    with pytest.raises(ValueError, match="rebuild_chunk_tokens >= 1"):
        at_once.prefill_evicting(tiny_engine.empty_cache(None), kept)


@pytest.mark.parametrize("policy", ["attention", "agnostic"])
def test_a_fork_at_the_latest_turn_while_the_parent_is_mid_turn_shares_a_cache_nobody_writes(
    tmp_path: Path, tiny_engine: Engine, policy: str
) -> None:
    """The fork shares the parent's whole windowed cache (the same tensors); the parent's turn in
    flight meanwhile evicts and scores in its own working copy, never in the shared tensors, so the
    fork replies as one made (and answered) before that turn."""
    with open_manager(tmp_path / "home", tiny_engine, window_policy=policy) as manager:
        tenant = manager.create_tenant("acme").id
        parent = conversed(manager, tenant, 8)
        held = cache_of(manager, tenant, parent)
        before = [t.clone() for t in (*held.own_keys, *held.own_values, *(held.own_scores or ()))]
        early = manager.chat(tenant, manager.fork(tenant, parent, 8), MESSAGES[10], max_new_tokens=8)
        turn = manager.run_turn(tenant, TurnTarget(session=parent), MESSAGES[9], TurnOptions(max_new_tokens=8))
        assert isinstance(turn.start(), str)  # the parent's turn holds its lease, mid-reply
        fork = manager.fork(tenant, parent, 8)
        assert isinstance(list(turn)[-1], Reply)
        after = [*held.own_keys, *held.own_values, *(held.own_scores or ())]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        forked = manager.chat(tenant, fork, MESSAGES[10], max_new_tokens=8)
        assert forked.stats.restored_from == "device" and forked.token_ids == early.token_ids


def test_a_chunk_on_a_ragged_cache_is_scored_at_each_heads_own_slots(
    tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `attention` with per-head budgets, a chunk after the first runs on a ragged cache,
    whose working buffer puts each head's share of the chunk after the longest head's slots. Its
    observation scores must follow each head's slots: scored so that the chunk's tokens rank above
    every older token (older ones the higher the older), every head keeps each chunk's tokens."""

    def new_above_old(observer: object, cached_tokens: int, *args: object) -> torch.Tensor:
        columns = torch.arange(cached_tokens, dtype=torch.float32)
        per_layer = []
        for layer in observer._layers:  # type: ignore[attr-defined]
            held = layer.get_seq_length() - observed_chunk[0]  # the buffer's slots before the chunk
            heads = layer.filled_keys.shape[1]  # head h's older tokens outrank head h-1's: counts differ
            old = -columns + 500.0 * torch.arange(heads, dtype=torch.float32)[:, None]
            per_layer.append(torch.where(columns < held, old, 1000.0 + columns))
        return torch.stack(per_layer)

    from cache.attention_scores import ObservationWindow

    observed_chunk = [0]
    ids = tuple(range(40, 40 + 60))
    kept = restack_kept([(LayerSpan(LayerKind.TURN, 0, 60, 0, 0), ids)], [], 0)
    window = TurnWindow(tiny_engine, WindowPolicy(30, "attention", 0, 4, 10, "per_head"))
    chunks: list[int] = []
    prefill_chunk = window._prefill_chunk

    def recording(cache: object, kept_layers: object, start: int, end: int) -> object:
        observed_chunk[0] = end - start
        chunks.append(start)
        after = prefill_chunk(cache, kept_layers, start, end)  # type: ignore[arg-type]
        for layer in after.full_layers:
            for stream in after.head_stream_index(layer):
                assert set(range(start, end)) <= set(stream.tolist()), (start, end, stream.tolist())
        return after

    monkeypatch.setattr(ObservationWindow, "scores", new_above_old)
    monkeypatch.setattr(window, "_prefill_chunk", recording)
    past = window.prefill_evicting(tiny_engine.empty_cache(None), kept)
    assert len(chunks) >= 3 and len(set(past.cache.head_tokens(0))) > 1
