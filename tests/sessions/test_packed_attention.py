"""The packed attention by attention kind, and the models it refuses: masks with exact values,
sinks and soft-capping against the models' own eager code, arguments never ignored, refusal at
load in one typed error."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

from cache.session_cache import SessionCache
from sessions.engine import Engine
from sessions.engine import packed_attention as packed_attention_module
from sessions.engine.attention_kinds import AttentionKind, LayerAttention, read_attention_kinds
from sessions.engine.batch import PackedBatch, band_mask, pack
from sessions.engine.packed_attention import (
    UnsupportedAttentionArgument,
    attend,
    packed_attention_for,
    without_cudnn_attention,
)
from sessions.errors import UnsupportedModel
from sessions.model_source import load_model
from tests.conftest import MODEL_CACHE

SLIDING_4 = LayerAttention(AttentionKind.SLIDING, 4)
FULL = LayerAttention(AttentionKind.FULL)


def test_band_mask_lets_each_query_see_itself_and_the_window_before_it() -> None:
    mask = band_mask(3, 6, 3, torch.device("cpu"))
    assert mask is not None
    assert mask.int().tolist() == [
        [0, 1, 1, 1, 0, 0],  # query at slot 3 sees slots 1..3
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 1],
    ]
    causal = band_mask(2, 4, None, torch.device("cpu"))
    assert causal is not None and causal.int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert band_mask(1, 3, 3, torch.device("cpu")) is None  # a decode over at most W keys sees all
    assert band_mask(1, 9, None, torch.device("cpu")) is None


class _Module(torch.nn.Module):
    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.sinks = torch.nn.Parameter(torch.randn(heads))
        self.training = False


def test_sinks_and_softcap_agree_with_the_models_own_eager_attention() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    module = _Module(4, 2)
    mask = band_mask(5, 9, 4, torch.device("cpu"))
    assert mask is not None
    additive = torch.zeros(1, 1, 5, 9).masked_fill(~mask, torch.finfo(torch.float32).min)
    ours = attend(q, k, v, mask, 0.35, sinks=module.sinks)
    theirs, _ = gpt_oss_eager(module, q, k, v, additive, scaling=0.35)
    torch.testing.assert_close(ours.transpose(1, 2), theirs)
    ours = attend(q, k, v, mask, 0.35, softcap=5.0)
    theirs, _ = gemma2_eager(module, q, k, v, additive, scaling=0.35, softcap=5.0)
    torch.testing.assert_close(ours.transpose(1, 2), theirs)


def _call_packed(**kwargs: object) -> None:
    cache = SessionCache.empty(None, 1, torch.empty(1, 2, 0, 8))
    working = cache.to_working_cache(2)
    batch = pack([(working.prealloc_layers, [1, 2], True)], torch.device("cpu"))
    attention = packed_attention_for(lambda *a, **k: (torch.empty(0), None))
    module = _Module(4, 2)
    q = torch.randn(1, 4, 2, 8)
    working.prealloc_layers[0].update(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8))
    attention(module, q, q, q, batch.placeholder_mask(), scaling=0.3, **kwargs)


def test_an_attention_argument_the_packed_path_does_not_implement_is_refused_never_dropped() -> None:
    _call_packed(position_ids=torch.arange(2), output_attentions=False)  # inert ones pass
    with pytest.raises(UnsupportedAttentionArgument, match="position_bias=Tensor"):
        _call_packed(position_bias=torch.zeros(1, 4, 2, 2))
    with pytest.raises(UnsupportedAttentionArgument, match=r"dropout=0\.1"):
        _call_packed(dropout=0.1)
    with pytest.raises(UnsupportedAttentionArgument, match="is_causal=False"):
        _call_packed(is_causal=False)
    with pytest.raises(UnsupportedAttentionArgument, match="sliding_window=4, but its config gives it window None"):
        _call_packed(sliding_window=4)


def test_attention_kinds_are_read_from_the_config() -> None:
    mistral = transformers.MistralConfig(num_hidden_layers=3, sliding_window=4)
    assert read_attention_kinds(mistral) == (SLIDING_4,) * 3
    assert read_attention_kinds(transformers.MistralConfig(num_hidden_layers=2, sliding_window=None)) == (FULL, FULL)
    gemma3 = transformers.Gemma3TextConfig(num_hidden_layers=6, sliding_window=4)
    assert read_attention_kinds(gemma3) == (SLIDING_4,) * 5 + (FULL,)
    qwen2 = transformers.Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=4, max_window_layers=2
    )
    assert read_attention_kinds(qwen2) == (FULL, FULL, SLIDING_4, SLIDING_4)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (transformers.Qwen3NextConfig(num_hidden_layers=4), "linear_attention"),
        (transformers.DeepseekV3Config(num_hidden_layers=2), "MLA, kv_lora_rank"),
        (transformers.MambaConfig(num_hidden_layers=2), "mamba has no attention layers"),
        (transformers.Gemma3nTextConfig(num_hidden_layers=4, num_kv_shared_layers=2), "num_kv_shared_layers"),
        (transformers.T5Config(num_layers=2), "encoder-decoder"),
    ],
)
def test_models_whose_cache_cannot_be_reused_exactly_are_refused_naming_why(config: object, named: str) -> None:
    with pytest.raises(UnsupportedModel, match=named):
        read_attention_kinds(getattr(config, "get_text_config", lambda **_: config)(decoder=True))


def test_a_model_whose_attention_passes_an_unknown_argument_is_refused_at_load(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir), MODEL_CACHE, "cpu", "float32")
    for layer in loaded.model.model.layers:
        layer.self_attn.forward = functools.partial(layer.self_attn.forward, alibi_bias=torch.zeros(1))
    with pytest.raises(UnsupportedModel, match="model layer 0's attention passes alibi_bias=Tensor"):
        Engine(loaded)


def test_a_packed_step_on_cuda_turns_cudnn_attention_off_and_back_on() -> None:
    """cuDNN attention builds a graph per key length, which grows every step (`without_cudnn_attention`).
    The flag is torch's process-wide one, so it is readable without a GPU."""
    cuda = torch.device("cuda")
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with without_cudnn_attention(cuda):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        with without_cudnn_attention(cuda):  # an overlapping step (another engine's loop)
            assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled()  # the first step still runs
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with pytest.raises(RuntimeError), without_cudnn_attention(cuda):
        raise RuntimeError("a failed forward pass")
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_cudnn_attention_turned_off_by_the_user_stays_off_and_a_cpu_step_changes_nothing() -> None:
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        with without_cudnn_attention(torch.device("cuda")):
            pass
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    with without_cudnn_attention(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()


def test_the_block_diagonal_mask_lets_each_decode_query_see_its_own_requests_keys_only() -> None:
    cache = SessionCache.empty(None, 1, torch.empty(1, 2, 0, 8))
    layers = [cache.to_working_cache(4).prealloc_layers for _ in range(3)]
    batch = pack([(layer, [7], True) for layer in layers], torch.device("cpu"), block_diagonal=True)
    assert batch.block_mask((2, 1, 3)).int().tolist() == [
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 1],
    ]


def test_only_a_decode_step_of_several_requests_attends_block_diagonally_and_by_default_on_cuda_only() -> None:
    cache = SessionCache.empty(None, 1, torch.empty(1, 2, 0, 8))
    a, b = (cache.to_working_cache(4).prealloc_layers for _ in range(2))
    cpu = torch.device("cpu")
    assert pack([(a, [1], True), (b, [2], True)], cpu, block_diagonal=True).block_diagonal
    assert not pack([(a, [1], True), (b, [2, 3], True)], cpu, block_diagonal=True).block_diagonal  # a prefill chunk
    assert not pack([(a, [1], True)], cpu, block_diagonal=True).block_diagonal  # one request
    assert not pack([(a, [1], True), (b, [2], True)], cpu).block_diagonal  # the CPU default


def _decode_logits(engine: Engine, rows: list[list[int]], block_diagonal: bool, holes: bool = False) -> torch.Tensor:
    """Logits of one decode step of `rows` (each prefilled but for its last id), packed together."""
    workings = []
    for ids in rows:
        working = engine.empty_cache(None).to_working_cache(len(ids) + 2)
        engine.prefill(working, ids[:-1])
        workings.append(working)
    if holes:  # request 0's first model layer stored ragged: KV head 1 holds no token in slot 0
        layer = workings[0].prealloc_layers[0]
        valid = torch.ones(engine.layout.kv_heads, layer.get_seq_length(), dtype=torch.bool)
        valid[1, 0] = False
        layer.head_valid = valid
    batch = pack(
        [(w.prealloc_layers, ids[-1:], True) for w, ids in zip(workings, rows, strict=True)],
        engine.device,
        block_diagonal=block_diagonal,
    )
    return engine.runner.forward(batch)


@pytest.mark.parametrize("engine_name", ["tiny_engine", "gemma3_engine"])
def test_block_diagonal_decode_agrees_with_attention_per_request_and_skips_layers_it_does_not_cover(
    engine_name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One call per model layer over every request's keys (CUDA's default) gives each request the
    logits of its own calls, up to float rounding; sliding layers (Gemma 3's) and a ragged layer
    attend per request."""
    engine: Engine = request.getfixturevalue(engine_name)
    rows = [[(i * 7 + j) % 500 + 20 for j in range(n)] for i, n in enumerate((9, 4, 13))]
    covered: list[int] = []
    block = packed_attention_module._block_diagonal_attention

    def counted(batch: PackedBatch, layer_idx: int, *args: object) -> torch.Tensor | None:
        out = block(batch, layer_idx, *args)  # type: ignore[arg-type]
        if out is not None:
            covered.append(layer_idx)
        return out

    monkeypatch.setattr(packed_attention_module, "_block_diagonal_attention", counted)
    per_request = _decode_logits(engine, rows, block_diagonal=False)
    assert covered == []
    together = _decode_logits(engine, rows, block_diagonal=True)
    full = [i for i, window in enumerate(engine.layout.windows) if window is None]
    assert covered == full
    torch.testing.assert_close(together, per_request, rtol=1e-5, atol=1e-5)

    covered.clear()
    ragged = _decode_logits(engine, rows, block_diagonal=True, holes=True)
    assert covered == [i for i in full if i != 0]
    torch.testing.assert_close(ragged, _decode_logits(engine, rows, block_diagonal=False, holes=True))
