"""KVzip's reconstruction scores (`TurnWindow.reconstruction_scores`) against the attention weights
of an eager forward pass over the same ids, and the `agnostic` policy's commit-time scores built
from them: the turn's ids reconstructed on top of its cache, nothing of the reconstruction kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cache.session_cache import SessionCache
from cache.token_eviction import committed_scores
from cache.window_policy import WindowPolicy
from sessions.engine import Engine
from sessions.manager import SessionManager
from sessions.turn.window import RECONSTRUCTION_INSTRUCTION, TurnWindow
from tests.sessions.window_helpers import MESSAGES, SYSTEM, cache_of, open_windowed


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
            prompt = list(manager.internals.template.reconstruction_prompt_ids(RECONSTRUCTION_INSTRUCTION))
            window = TurnWindow(tiny_engine, WindowPolicy(4000))
    (first, second), (_, plain) = caches["agnostic"], caches["turns"]
    assert first.own_scores is not None and second.own_scores is not None and plain.own_scores is None
    assert second.own_token_ids == plain.own_token_ids
    assert all(torch.equal(a, b) for a, b in zip(second.own_keys, plain.own_keys, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(second.own_values, plain.own_values, strict=True))
    before = first.with_scores(None)
    turn1 = window.reconstruction_scores(first, first.own_token_ids, prompt)
    expected_first = committed_scores(before, first, tuple(turn1))
    for got, want in zip(first.own_scores, expected_first, strict=True):
        torch.testing.assert_close(got, want)
    added = second.own_token_ids[len(first.own_token_ids) :]
    turn2 = window.reconstruction_scores(second, added, prompt)
    expected = committed_scores(first, second, tuple(turn2))
    for got, want in zip(second.own_scores, expected, strict=True):
        torch.testing.assert_close(got, want)
