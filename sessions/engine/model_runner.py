"""The model runner: the loaded model, the facts the rest of chatkv reads off it (KV layout with each
model layer's attention kind, stop ids, RoPE layout, context length), and one forward pass over a
packed step.

`ModelRunner.forward` is called by the engine loop only (`sessions.engine.loop`), the one thread that
runs the model; the `Engine` (`sessions.engine.engine`) owns both and is what callers use.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from cache.rope import RopeLayout, rope_layout
from cache.session_cache import BaseLayer, SessionCache
from sessions.engine.attention_kinds import LayerAttention, confirm, read_attention_kinds, summary
from sessions.engine.batch import STEP_KWARG, PackedBatch, StepCache, pack
from sessions.engine.packed_attention import (
    UnsupportedAttentionArgument,
    register_packed_attention,
    without_cudnn_attention,
)
from sessions.errors import UnsupportedModel
from sessions.model_source import LoadedModel

log = logging.getLogger(__name__)

PROBE_IDS = (0, 1, 2)
"""Token ids of the load probe: one packed step of three tokens over an empty cache."""


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's KV: `num_model_layers` pairs of `[kv_heads, head_dim]` in `dtype`, and
    each model layer's attention kind (`attention[l]`; a sliding layer keeps at most W - 1 tokens).

    Raises:
        ValueError: if `attention` does not have one entry per model layer.
    """

    num_model_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    attention: tuple[LayerAttention, ...] = ()

    def __post_init__(self) -> None:
        if self.attention and len(self.attention) != self.num_model_layers:
            raise ValueError(f"{len(self.attention)} attention kinds for {self.num_model_layers} model layers")

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token in every model layer (what a full-attention cache pays per token)."""
        return self.num_model_layers * self.layer_bytes_per_token

    @property
    def layer_bytes_per_token(self) -> int:
        """KV bytes of one token in one model layer: keys and values."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.kv_heads * self.head_dim * element

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per model layer, its sliding window or `None` (full attention)."""
        return tuple(kind.window_tokens for kind in self.attention) or (None,) * self.num_model_layers

    def cache_bytes(self, tokens: int) -> int:
        """KV bytes a session cache of `tokens` tokens holds at rest: every token in a full layer,
        at most W - 1 in a sliding layer of window W."""
        held = sum(tokens if w is None else min(tokens, w - 1) for w in self.windows)
        return held * self.layer_bytes_per_token


class ModelRunner:
    """Runs one loaded model over packed steps: what the engine loop calls once per step.

    Attributes:
        loaded, model, tokenizer, fingerprint: the model as loaded (`sessions.model_source`).
        device, dtype: where and in what precision the weights (and so every KV cache) live.
        layout: one token's KV shape (`KVLayout`).
        max_context_tokens: the model's `max_position_embeddings` (2048 when the config has none).
        stop_token_ids: ids that end a reply (the generation config's and tokenizer's EOS), sorted.
        rope_layout: the model's RoPE layout when cached keys can be re-rotated (see `cache.rope`),
            else `None` (windowing then re-prefills).

    Args:
        loaded: the model; its attention implementation is switched to the packed one (which falls
            back to the original for ordinary calls), once even when several runners share it.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.fingerprint = loaded.fingerprint
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        config = self.model.config.get_text_config(decoder=True)
        self.max_context_tokens = int(getattr(config, "max_position_embeddings", 2048))
        attention = read_attention_kinds(config)  # refuses what chatkv cannot reuse, before any shape is read
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.layout = KVLayout(
            num_model_layers=config.num_hidden_layers,
            kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            dtype=self.dtype,
            attention=attention,
        )
        self.stop_token_ids = self._stop_ids()
        original = getattr(self.model.config, "_attn_implementation", None) or "sdpa"
        if not original.startswith("chatkv_packed_"):
            self.model.set_attn_implementation(register_packed_attention(original))
        self.layout = replace(self.layout, attention=self._probe())
        # A sliding layer holds only its tail, which a re-rotation cannot move past a demoted turn:
        # such models demote by re-prefilling the kept turns (exact).
        sliding = any(w is not None for w in self.layout.windows)
        self.rope_layout: RopeLayout | None = None if sliding else rope_layout(self.model)
        log.info("model attention: %s", summary(self.layout.attention))

    def _probe(self) -> tuple[LayerAttention, ...]:
        """Run one packed step at load and check that every model layer's attention received it,
        with the arguments it implements and the window its config says (`attention_kinds.confirm`).

        Raises:
            UnsupportedModel: naming what the packed attention cannot serve exactly.
        """
        working = self.empty_cache(None).to_working_cache(len(PROBE_IDS))
        batch = pack([(working.prealloc_layers, PROBE_IDS, True)], self.device, probe=True)
        try:
            self.forward(batch)
        except UnsupportedAttentionArgument as exc:
            raise UnsupportedModel(str(exc)) from None
        # Any other failure of the probe is a model whose layers do not fit a packed step (another
        # cache shape, a custom attention): refused here in one line rather than in a turn.
        except (RuntimeError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise UnsupportedModel(f"the model does not run in chatkv's packed step: {exc}") from None
        if batch.observed is None:
            raise RuntimeError("bug: the probe step recorded nothing")
        return confirm(self.layout.attention, batch.observed)

    def _stop_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list | tuple):
                ids.update(int(i) for i in eos)
        return tuple(sorted(ids))

    def empty_cache(self, base: BaseLayer | None) -> SessionCache:
        """A session cache holding only `base` (or nothing), shaped for this model's KV and windows."""
        like = torch.empty(1, self.layout.kv_heads, 0, self.layout.head_dim, dtype=self.dtype, device=self.device)
        return SessionCache.empty(base, self.layout.num_model_layers, like, self.layout.windows)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """One forward pass over a packed step (engine loop only). Returns the
        `[len(batch.logits_indices), vocab]` logits of the rows that sample. On CUDA, SDPA runs
        without its cuDNN backend during the pass (`without_cudnn_attention`: a graph build per
        new key length)."""
        with without_cudnn_attention(self.device):
            out = self.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                attention_mask=batch.placeholder_mask(),
                cache=StepCache(batch),
                use_cache=True,
                logits_to_keep=batch.logits_indices,
                **{STEP_KWARG: batch},
            )
        return out.logits[0]
