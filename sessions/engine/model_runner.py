"""The model runner: the loaded model, the facts the rest of chatkv reads off it (KV layout, stop
ids, RoPE layout, context length), and one forward pass over a packed step.

`ModelRunner.forward` is called by the engine loop only (`sessions.engine.loop`), the one thread that
runs the model; the `Engine` (`sessions.engine.engine`) owns both and is what callers use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache.rope import RopeLayout, rope_layout
from cache.session_cache import BaseLayer, SessionCache
from sessions.engine.batch import NO_MASK, STEP_KWARG, PackedBatch, StepCache, register_packed_attention
from sessions.model_source import LoadedModel


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's KV: `num_model_layers` pairs of `[kv_heads, head_dim]` in `dtype`."""

    num_model_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_model_layers * self.kv_heads * self.head_dim * element


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
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.layout = KVLayout(
            num_model_layers=config.num_hidden_layers,
            kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            dtype=self.dtype,
        )
        self.stop_token_ids = self._stop_ids()
        self.rope_layout: RopeLayout | None = rope_layout(self.model)
        original = getattr(self.model.config, "_attn_implementation", None) or "sdpa"
        if not original.startswith("chatkv_packed_"):
            self.model.set_attn_implementation(register_packed_attention(original))

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
        """A session cache holding only `base` (or nothing), shaped for this model's KV."""
        like = torch.empty(1, self.layout.kv_heads, 0, self.layout.head_dim, dtype=self.dtype, device=self.device)
        return SessionCache.empty(base, self.layout.num_model_layers, like)

    @torch.inference_mode()
    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """One forward pass over a packed step (engine loop only). Returns the
        `[len(batch.logits_indices), vocab]` logits of the rows that sample."""
        out = self.model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            attention_mask=NO_MASK,
            cache=StepCache(batch),
            use_cache=True,
            logits_to_keep=batch.logits_indices,
            **{STEP_KWARG: batch},
        )
        return out.logits[0]
