"""The model runner: the loaded model, its KV layout, and one forward pass over a packed step.

`Engine.forward` is called by the engine loop only (`sessions.engine.loop`), the one thread that runs
the model. Everything else goes through requests: `prefill` and `generate` submit one and wait.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from cache.ids import TenantId
from cache.rope import RopeLayout, rope_layout
from cache.session_cache import BaseLayer, SessionCache, WorkingCache
from sessions.engine.batch import NO_MASK, STEP_KWARG, PackedBatch, StepCache, register_packed_attention
from sessions.engine.config import SchedulerConfig
from sessions.engine.loop import EngineLoop
from sessions.engine.request import Request
from sessions.model_source import LoadedModel
from sessions.sampling import SamplingParams

ENGINE_TENANT = TenantId("chatkv-engine")
"""Tenant of the engine's own prefill-only jobs (a base layer recomputed, kept turns re-prefilled)."""


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


class Engine:
    """Runs one loaded model through its engine loop. Thread-safe: every model call is a request.

    Attributes:
        max_context_tokens: the model's `max_position_embeddings`.
        stop_token_ids: ids that end a reply (the generation config's and tokenizer's EOS).
        rope_layout: the model's RoPE layout when cached keys can be re-rotated (see `cache.rope`),
            else `None` (windowing then re-prefills).
        loop: the engine loop (started by the first request).

    Args:
        loaded: the model; its attention implementation is switched to the packed one (which falls
            back to the original for ordinary calls).
        scheduler: the loop's limits (default `SchedulerConfig()`).
    """

    def __init__(self, loaded: LoadedModel, scheduler: SchedulerConfig | None = None) -> None:
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
        # Looked up at each step, so a test can wrap `forward` to watch the passes.
        self.loop = EngineLoop(lambda batch: self.forward(batch), self.device, scheduler or SchedulerConfig())

    def _stop_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list | tuple):
                ids.update(int(i) for i in eos)
        return tuple(sorted(ids))

    # -- caches --------------------------------------------------------------------------------

    def empty_cache(self, base: BaseLayer | None) -> SessionCache:
        like = torch.empty(1, self.layout.kv_heads, 0, self.layout.head_dim, dtype=self.dtype, device=self.device)
        return SessionCache.empty(base, self.layout.num_model_layers, like)

    def compute_prefix(self, token_ids: Sequence[int]) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """KV of `token_ids` at positions `0..n-1`: per model layer `[1, kv_heads, n, head_dim]`."""
        working = self.empty_cache(None).to_working_cache(len(token_ids))
        self.prefill(working, token_ids)
        keys = tuple(layer.filled_keys.clone() for layer in working.prealloc_layers)
        values = tuple(layer.filled_values.clone() for layer in working.prealloc_layers)
        return keys, values

    # -- running the model ---------------------------------------------------------------------

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

    def prefill(self, cache: WorkingCache, token_ids: Sequence[int]) -> torch.Tensor:
        """Run `token_ids` through the model on top of `cache` (positions continue from its
        `next_position`) and return the `[vocab]` logits of the last one. Waits for the engine loop.

        Raises:
            ValueError: if `token_ids` is empty.
        """
        request = Request(tenant_id=ENGINE_TENANT, prefill_ids=token_ids, params=None, working=cache)
        result = self.loop.submit(request).result()
        if result.last_logits is None:
            raise RuntimeError("bug: a prefill-only request returned no logits")
        return result.last_logits

    def generate(self, cache: WorkingCache, token_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Prefill `token_ids` on top of `cache`, then yield sampled ids until a stop token or
        `params.max_new_tokens`. Every yielded id but the last is fed back into `cache`.

        Raises:
            ValueError: if `token_ids` is empty.
        """
        request = Request(
            tenant_id=ENGINE_TENANT,
            prefill_ids=token_ids,
            params=params,
            working=cache,
            stop_token_ids=self.stop_token_ids,
        )
        stream = self.loop.submit(request).tokens()
        try:
            yield from stream
        finally:
            request.cancel()
