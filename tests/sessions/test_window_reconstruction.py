"""KVzip's reconstruction scores (`TurnWindow.reconstruction_scores`) against the attention weights
of an eager forward pass over the same ids; nothing of the reconstruction kept; sliding-window
layers never scored. As the `agnostic` policy serves them: each committed turn's own ids
reconstructed once after its reply (never under `turns` or `attention`, never for a cancelled or
failed turn); a failed reconstruction stores the turn with a cache that evicts by recency; after a
restore, the next turn's reconstruction scores every held token; on a ragged cache (per-head
budgets) each head is scored at its own slots of the reconstruction's buffer."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cache.attention_scores import ReconstructionScores
from cache.session_cache import SessionCache
from cache.token_eviction import committed_scores
from cache.window_policy import WindowPolicy
from sessions.cancellation import CancelToken
from sessions.engine import Engine
from sessions.errors import ContextTooLong, TurnCancelled
from sessions.manager import SessionManager
from sessions.turn.window import RECONSTRUCTION_INSTRUCTION, TurnWindow
from tests.sessions.window_helpers import (
    BUDGET,
    MESSAGES,
    SYSTEM,
    cache_of,
    open_windowed,
    record_reconstructions,
)


def eager_reference(model_dir: Path, cache: SessionCache, prompt: list[int], chunk: list[int]) -> torch.Tensor:
    """`[layers, kv_heads, cached]`: the most attention any query of `prompt + chunk` pays each cached
    token, over the query heads of its KV group, from the eager attention of one forward pass over
    the cached ids and the reconstruction (another model instance, no KV cache)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    ids = [*cache.base_token_ids, *cache.own_token_ids, *prompt, *chunk]
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    cached, kv_heads = cache.total_tokens, model.config.num_key_value_heads
    rows = []
    for weights in out.attentions:  # [1, heads, n, n]
        best = weights[0, :, cached:, :cached].amax(dim=1)  # [heads, cached]
        rows.append(best.view(kv_heads, -1, cached).amax(dim=1))
    return torch.stack(rows)


def unevicted_cache(manager: SessionManager, turns: int) -> SessionCache:
    tenant = manager.create_tenant("acme").id
    sid = manager.open_session(tenant, system_prompt=SYSTEM)
    for message in MESSAGES[:turns]:
        manager.chat(tenant, sid, message, max_new_tokens=6, ignore_eos=True)
    cache = cache_of(manager, tenant, sid)
    assert cache.evicted_tokens == 0
    return cache


@pytest.mark.parametrize("chunk_tokens", [1000, 7])
def test_reconstruction_scores_are_the_max_eager_attention_of_the_repeat(
    tmp_path: Path, tiny_engine: Engine, tiny_model_dir: Path, chunk_tokens: int
) -> None:
    with open_windowed(tmp_path / "home", tiny_engine, "turns", context_budget_tokens=4000) as manager:
        cache = unevicted_cache(manager, 2)
        prompt = list(manager.internals.template.reconstruction_prompt_ids(RECONSTRUCTION_INSTRUCTION))
        window = TurnWindow(tiny_engine, WindowPolicy(4000))
    context = list(cache.own_token_ids[-20:])
    scores = window.reconstruction_scores(cache, context, prompt, chunk_tokens)
    chunks = [context[i : i + chunk_tokens] for i in range(0, len(context), chunk_tokens)]
    expected = torch.stack([eager_reference(tiny_model_dir, cache, prompt, c) for c in chunks]).amax(dim=0)
    assert scores.shape == (len(cache.full_layers), cache.own_keys[0].shape[1], cache.total_tokens)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)


def test_the_prompt_asks_for_a_repeat_in_a_user_turn_after_the_reply(tiny_manager: SessionManager) -> None:
    prompt = tiny_manager.internals.template.reconstruction_prompt_ids(RECONSTRUCTION_INSTRUCTION)
    text = tiny_manager.internals.engine.tokenizer.decode(prompt)
    assert text == f"<|im_end|>\n<|im_start|>user\n{RECONSTRUCTION_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"


def test_the_reconstruction_leaves_the_cache_it_scores_as_it_was(tmp_path: Path, tiny_engine: Engine) -> None:
    """The reconstruction's KV lives in a copy that is dropped: the session cache's tensors, ids
    and positions are what they were, and a turn after it replies as one without it."""
    with open_windowed(tmp_path / "home", tiny_engine, "turns", context_budget_tokens=4000) as manager:
        cache = unevicted_cache(manager, 2)
        prompt = list(manager.internals.template.reconstruction_prompt_ids(RECONSTRUCTION_INSTRUCTION))
    before = [t.clone() for t in (*cache.own_keys, *cache.own_values)]
    ids, position = cache.own_token_ids, cache.next_position
    TurnWindow(tiny_engine, WindowPolicy(4000)).reconstruction_scores(cache, cache.own_token_ids, prompt, 16)
    after = [*cache.own_keys, *cache.own_values]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert (cache.own_token_ids, cache.next_position) == (ids, position)
    assert [layer.get_seq_length() for layer in cache.to_working_cache(1).prealloc_layers] == [
        cache.total_tokens
    ] * len(cache.own_keys)


def test_sliding_window_layers_are_never_scored(tmp_path: Path, gemma3_engine: Engine) -> None:
    with open_windowed(tmp_path / "home", gemma3_engine, "agnostic", context_budget_tokens=4000) as manager:
        cache = unevicted_cache(manager, 2)
        prompt = list(manager.internals.template.reconstruction_prompt_ids(RECONSTRUCTION_INSTRUCTION))
    windows = gemma3_engine.layout.windows
    assert any(w is not None for w in windows) and any(w is None for w in windows)
    working = cache.to_working_cache(4)
    with ReconstructionScores(working, cache.total_tokens):
        observed = [layer.query_observer is not None for layer in working.prealloc_layers]
    assert observed == [w is None for w in windows]
    scores = TurnWindow(gemma3_engine, WindowPolicy(4000)).reconstruction_scores(cache, cache.own_token_ids, prompt)
    assert scores.shape[0] == len(cache.full_layers) == windows.count(None)
    assert cache.own_scores is not None and len(cache.own_scores) == len(cache.full_layers)


def test_a_reconstruction_of_nothing_or_in_empty_chunks_is_refused(tiny_engine: Engine) -> None:
    cache = tiny_engine.empty_cache(None)
    window = TurnWindow(tiny_engine, WindowPolicy(4000))
    with pytest.raises(ValueError, match=r"^need context ids and chunk_tokens >= 1, got 0 ids, 2048$"):
        window.reconstruction_scores(cache, [], [1, 2])
    with pytest.raises(ValueError, match=r"^need context ids and chunk_tokens >= 1, got 2 ids, 0$"):
        window.reconstruction_scores(cache, [5, 6], [1, 2], chunk_tokens=0)
    with pytest.raises(ValueError, match=r"^cached_tokens must be >= 0, got -1$"):
        ReconstructionScores(cache.to_working_cache(1), -1)


def reconstruction_prompt(manager: SessionManager) -> list[int]:
    return list(manager.internals.template.reconstruction_prompt_ids(RECONSTRUCTION_INSTRUCTION))


def test_an_agnostic_turn_commits_the_reconstruction_of_its_own_ids(tmp_path: Path, tiny_engine: Engine) -> None:
    """Scores of turn 2's cache: turn 2's ids reconstructed on it, the larger of that and turn 1's
    score for turn 1's tokens; the cache holds the same KV as a `turns` session's (no reconstruction
    KV kept)."""
    caches = {}
    for policy in ("agnostic", "turns"):
        with open_windowed(tmp_path / policy, tiny_engine, policy, context_budget_tokens=4000) as manager:
            first = unevicted_cache(manager, 1)
            tenant = manager.create_tenant("other").id
            sid = manager.open_session(tenant, system_prompt=SYSTEM)
            for message in MESSAGES[:2]:
                manager.chat(tenant, sid, message, max_new_tokens=6, ignore_eos=True)
            caches[policy] = (first, cache_of(manager, tenant, sid))
            prompt = reconstruction_prompt(manager)
    window = TurnWindow(tiny_engine, WindowPolicy(4000))
    (first, second), (_, plain) = caches["agnostic"], caches["turns"]
    assert first.own_scores is not None and second.own_scores is not None and plain.own_scores is None
    assert second.own_token_ids == plain.own_token_ids
    assert all(torch.equal(a, b) for a, b in zip(second.own_keys, plain.own_keys, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(second.own_values, plain.own_values, strict=True))
    turn1 = window.reconstruction_scores(first, first.own_token_ids, prompt)
    expected_first = committed_scores(first.with_scores(None), first, tuple(turn1), built_from=first)
    for got, want in zip(first.own_scores, expected_first, strict=True):
        torch.testing.assert_close(got, want)
    added = second.own_token_ids[len(first.own_token_ids) :]
    turn2 = window.reconstruction_scores(second, added, prompt)
    expected = committed_scores(first, second, tuple(turn2), built_from=second)
    for got, want in zip(second.own_scores, expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("policy", ["agnostic", "turns", "attention"])
def test_the_reconstruction_runs_once_per_committed_turn_and_only_under_agnostic(
    tmp_path: Path, tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """Each stored `agnostic` turn reconstructs exactly the ids it added (the closing of the last
    reply, the turn, its reply), evicting turns included; a turn cancelled mid-reply or refused
    before its reply runs none."""
    with open_windowed(tmp_path / "home", tiny_engine, policy) as manager:
        tenant = manager.create_tenant("acme").id
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        calls = record_reconstructions(manager, monkeypatch)
        added: list[tuple[int, ...]] = []
        evicted = 0
        for message in MESSAGES[:7]:
            before = cache_of(manager, tenant, sid).own_token_ids if added else ()
            evicted += manager.chat(tenant, sid, message, max_new_tokens=8).stats.demoted_tokens
            after = cache_of(manager, tenant, sid).own_token_ids
            added.append(after[len(before) :])
        assert evicted > 0
        cancel = CancelToken()
        stream = manager.stream_chat(tenant, sid, MESSAGES[7], max_new_tokens=64, ignore_eos=True, cancel=cancel)
        assert isinstance(next(stream), str)
        cancel.cancel()
        with pytest.raises(TurnCancelled):
            list(stream)
        with pytest.raises(ContextTooLong):
            manager.chat(tenant, sid, " ".join(MESSAGES), max_new_tokens=8)
        assert len(manager.history(tenant, sid)) == 2 * 7
    assert calls == (added if policy == "agnostic" else [])


def test_a_failed_reconstruction_stores_the_turn_and_its_cache_evicts_by_recency(
    tmp_path: Path, tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with open_windowed(tmp_path / "home", tiny_engine, "agnostic") as manager:
        tenant = manager.create_tenant("acme").id
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        for message in MESSAGES[:3]:
            manager.chat(tenant, sid, message, max_new_tokens=8)
        assert cache_of(manager, tenant, sid).own_scores is not None

        def failing(*args: object, **kwargs: object) -> torch.Tensor:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        monkeypatch.setattr(manager.internals.runner.preparer.fitting, "reconstruction_scores", failing)
        with caplog.at_level(logging.WARNING, logger="sessions.turn.runner"):
            reply = manager.chat(tenant, sid, MESSAGES[3], max_new_tokens=8)
        assert [r.getMessage() for r in caplog.records if r.name == "sessions.turn.runner"] == [
            f"session {sid}: KVzip reconstruction failed (CUDA out of memory (simulated)); "
            "its cache evicts by recency until a later turn scores it"
        ]
        history = manager.history(tenant, sid)
        assert len(history) == 8 and history[-1].text == reply.text
        cache = cache_of(manager, tenant, sid)
        assert cache.own_scores is None and cache.evicted_tokens == 0
        monkeypatch.undo()
        long = manager.chat(tenant, sid, MESSAGES[4] + " and " + MESSAGES[5], max_new_tokens=8)
        cache = cache_of(manager, tenant, sid)
    assert long.stats.demoted_tokens > 0 and cache.total_tokens <= BUDGET
    index = cache.own_stream_index
    assert index is not None
    for per_layer in index:  # recency: every head dropped the same oldest tokens
        assert (per_layer == per_layer[0]).all()
        assert int(per_layer[0, 0]) == cache.base_tokens + long.stats.demoted_tokens
    assert cache.own_scores is not None  # that turn's reconstruction scored it again


def test_no_reconstruction_runs_past_the_models_positions(
    tmp_path: Path, tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept keys keep their positions, so a long conversation nears the model's limit; the repeat
    after the turn would pass it, so the turn is stored without scores (the next turn rebuilds)."""
    with open_windowed(tmp_path / "home", tiny_engine, "agnostic", context_budget_tokens=4000) as manager:
        tenant = manager.create_tenant("acme").id
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        manager.chat(tenant, sid, MESSAGES[0], max_new_tokens=8)
        calls = record_reconstructions(manager, monkeypatch)
        end = cache_of(manager, tenant, sid).next_position
        # Room for the next turn itself, not for the repeat of it after the reply.
        monkeypatch.setattr(tiny_engine.runner, "max_context_tokens", end + 60)
        reply = manager.chat(tenant, sid, MESSAGES[1], max_new_tokens=8)
        cache = cache_of(manager, tenant, sid)
    assert calls == [] and cache.own_scores is None
    assert len(reply.token_ids) > 0 and cache.next_position <= end + 60


def test_after_a_restore_the_next_turn_scores_every_held_token_by_reconstructing_its_own_ids(
    tmp_path: Path, tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blob holds no scores; the turn after the restore reconstructs only the ids it added, and
    its scores of every held token, the older ones included, are the attention that repeat paid
    them (no earlier score to keep the larger of; the older turns are not repeated themselves)."""
    with open_windowed(tmp_path / "home", tiny_engine, "agnostic", context_budget_tokens=4000) as manager:
        tenant = manager.create_tenant("acme").id
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        for message in MESSAGES[:2]:
            manager.chat(tenant, sid, message, max_new_tokens=8)
        before = cache_of(manager, tenant, sid).own_token_ids
        assert manager.evict_session(tenant, sid, "disk") == "disk"
        calls = record_reconstructions(manager, monkeypatch)
        reply = manager.chat(tenant, sid, MESSAGES[2], max_new_tokens=8)
        cache = cache_of(manager, tenant, sid)
        prompt = reconstruction_prompt(manager)
    added = cache.own_token_ids[len(before) :]
    assert reply.stats.restored_from == "disk" and calls == [added]
    assert cache.own_scores is not None
    fresh = TurnWindow(tiny_engine, WindowPolicy(4000)).reconstruction_scores(cache, added, prompt)
    for row, got in enumerate(cache.own_scores):
        assert got.shape == (fresh.shape[1], cache.own_tokens)
        torch.testing.assert_close(got, fresh[row, :, cache.base_tokens :])


def test_on_a_ragged_cache_each_head_is_scored_at_its_own_slots_of_the_reconstruction(
    tmp_path: Path, tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-head budgets store layers ragged; the reconstruction's copy of the cache pads each layer's
    heads to its longest, so head `h`'s own slot `i` is column `base + i` of the scores: a turn's
    own tokens get their column's score, the older ones at least that (the max with their earlier
    scores)."""
    with open_windowed(tmp_path / "home", tiny_engine, "agnostic") as manager:
        tenant = manager.create_tenant("acme").id
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        for message in MESSAGES[:7]:
            manager.chat(tenant, sid, message, max_new_tokens=8)
        assert cache_of(manager, tenant, sid).ragged
        fitting = manager.internals.runner.preparer.fitting
        reconstruct = fitting.reconstruction_scores
        seen: list[tuple[SessionCache, int, torch.Tensor]] = []

        def keeping(cache: SessionCache, context_ids: list[int], *args: object) -> torch.Tensor:
            scores = reconstruct(cache, context_ids, *args)  # type: ignore[arg-type]
            seen.append((cache, len(context_ids), scores))
            return scores

        monkeypatch.setattr(fitting, "reconstruction_scores", keeping)
        manager.chat(tenant, sid, MESSAGES[7], max_new_tokens=8)
        stored = cache_of(manager, tenant, sid)
    [(after, added, fresh)] = seen
    assert after.ragged and stored.own_scores is not None
    base = after.base_tokens
    for row, layer in enumerate(after.full_layers):
        heads = stored.head_rows(layer, stored.own_scores[row])
        for head, (got, held) in enumerate(zip(heads, after.head_tokens(layer), strict=True)):
            column = fresh[row, head, base : base + held]
            torch.testing.assert_close(got[-added:], column[-added:], rtol=0, atol=0)
            assert bool((got >= column).all())
