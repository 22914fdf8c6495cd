"""Per-head budgets served (Ada-KV, `window_budget_allocation=per_head`): a ragged cache's turn,
through the engine loop's packed attention with each head's holes masked, equals the model's own
attention over the unevicted cache with each KV head shown only the tokens it kept."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cache.session_cache import BaseLayer, SessionCache
from cache.token_eviction import evict_by_scores
from sessions.engine import Engine
from sessions.engine.batch import band_mask
from sessions.engine.packed_attention import step_of
from tests.sessions.window_helpers import MESSAGES, SYSTEM, cache_of, open_windowed


@contextmanager
def heads_see_only(engine: Engine, visible: dict[int, torch.Tensor]) -> Iterator[None]:
    """While the block runs, a plain (not packed) forward of `engine.model` over the cached ids and
    new ones lets a new query of model layer `l` see cached slot `j` of KV head `h` only where
    `visible[l][h, j]` (`[kv_heads, cached]`); cached queries and new slots stay causal."""
    name = engine.model.config._attn_implementation
    original = ALL_ATTENTION_FUNCTIONS[name]
    local = name in ALL_ATTENTION_FUNCTIONS._local_mapping

    def attention(
        module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kw: Any
    ) -> Any:
        seen = visible.get(getattr(module, "layer_idx", -1))
        if seen is None or step_of(mask, kw) is not None:
            return original(module, query, key, value, mask, **kw)
        n, m = query.shape[2], key.shape[2]
        cached = seen.shape[1]  # only the queries after the cached tokens are restricted
        held = torch.cat([seen, seen.new_ones(seen.shape[0], m - cached)], dim=1)[:, None, :]  # [kv, 1, m]
        rows = (torch.arange(n) >= n - (m - cached))[None, :, None]  # [1, n, 1]
        allowed = (held | ~rows).repeat_interleave(query.shape[1] // key.shape[1], dim=0)
        causal = band_mask(n, m, None, query.device)
        if causal is not None:
            allowed = allowed & causal[None]
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=allowed[None], scale=kw.get("scaling"), enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None

    ALL_ATTENTION_FUNCTIONS[name] = attention
    try:
        yield
    finally:
        if local:
            ALL_ATTENTION_FUNCTIONS[name] = original
        else:
            del ALL_ATTENTION_FUNCTIONS[name]


def conversation(tmp_path: Path, engine: Engine) -> SessionCache:
    with open_windowed(tmp_path / "home", engine, "turns", context_budget_tokens=4000) as manager:
        tenant = manager.create_tenant("acme").id
        sid = manager.open_session(tenant, system_prompt=SYSTEM)
        for message in MESSAGES[:4]:
            manager.chat(tenant, sid, message, max_new_tokens=6, ignore_eos=True)
        cache = cache_of(manager, tenant, sid)
    assert cache.evicted_tokens == 0 and not cache.ragged and cache.base_key is not None
    if cache.base is None:  # the prefix pool's tensors: recomputed, the same ids at the same positions
        keys, values = engine.compute_prefix(cache.base_token_ids)
        cache = cache.with_base(BaseLayer(cache.base_key, cache.base_token_ids, keys, values))
    return cache


def test_a_ragged_cache_answers_as_the_masked_full_cache(tmp_path: Path, tiny_engine: Engine) -> None:
    whole = conversation(tmp_path, tiny_engine)
    kv = whole.kv_heads(whole.full_layers[0])
    scores = torch.rand(len(whole.full_layers), kv, whole.score_width, generator=torch.Generator().manual_seed(4))
    scores[:, 0] = scores[:, 0] ** 6  # the heads differ: Ada-KV moves budget between them
    evicted = evict_by_scores(whole, scores, whole.own_tokens // 2, 8, "per_head")
    assert evicted.ragged and len(set(evicted.head_tokens(evicted.full_layers[0]))) > 1
    new_ids = [int(t) for t in tiny_engine.tokenizer.encode(" and what was the parcel number of note 1?")]

    served = tiny_engine.prefill(evicted.to_working_cache(len(new_ids)), new_ids)  # packed, holes masked

    visible = {}
    for layer in whole.full_layers:
        seen = torch.zeros(kv, whole.total_tokens, dtype=torch.bool)
        seen[:, : whole.base_tokens] = True
        for head, stream in enumerate(evicted.head_stream_index(layer)):
            seen[head, stream] = True  # stream index = slot in the unevicted cache
        visible[layer] = seen
    ids = torch.tensor([[*whole.token_ids, *new_ids]])
    with heads_see_only(tiny_engine, visible), torch.inference_mode():
        reference = tiny_engine.model(input_ids=ids).logits[0, -1]
    assert torch.allclose(served.float(), reference.float(), atol=1e-4), (served - reference).abs().max()
    unmasked = tiny_engine.prefill(whole.to_working_cache(len(new_ids)), new_ids)
    assert not torch.allclose(unmasked.float(), reference.float(), atol=1e-4)  # the masks mattered
