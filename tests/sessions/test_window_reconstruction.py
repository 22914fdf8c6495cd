"""KVzip's reconstruction scores (`TurnWindow.reconstruction_scores`, measured in
`benchmarks/window_quality.py`) against the attention weights of an eager forward pass over the same
ids; nothing of the reconstruction kept; sliding-window layers never scored."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cache.attention_scores import ReconstructionScores
from cache.session_cache import SessionCache
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
