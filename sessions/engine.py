"""The model runner: prefill new tokens on top of a cache, then decode one token at a time.

Batch size is 1: each turn runs on its own session's cache. Model calls of concurrent turns are
serialised by a lock per forward pass, so several sessions interleave token by token instead of
one turn blocking the others until it finishes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from cache.rope import RopeLayout, rope_layout
from cache.session_cache import BaseLayer, SessionCache, WorkingCache
from sessions.model_source import LoadedModel
from sessions.sampling import Sampler, SamplingParams

PREFILL_CHUNK_TOKENS = 2048
"""Longer prefills run in chunks of this many tokens to bound the attention scratch memory."""


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
    """Runs one loaded model. Thread-safe: model calls are serialised by an internal lock.

    Attributes:
        max_context_tokens: the model's `max_position_embeddings`.
        stop_token_ids: ids that end a reply (the generation config's and tokenizer's EOS).
        rope_layout: the model's RoPE layout when cached keys can be re-rotated (see `cache.rope`),
            else `None` (windowing then re-prefills).
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
        self._lock = threading.Lock()

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
    def prefill(self, cache: WorkingCache, token_ids: Sequence[int]) -> torch.Tensor:
        """Run `token_ids` through the model on top of `cache` (positions continue from the cache
        length) and return the `[vocab]` logits of the last one.

        Raises:
            ValueError: if `token_ids` is empty.
        """
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        chunks = [
            token_ids[start : start + PREFILL_CHUNK_TOKENS] for start in range(0, len(token_ids), PREFILL_CHUNK_TOKENS)
        ]
        for chunk in chunks[:-1]:
            self._forward(cache, chunk)
        return self._forward(cache, chunks[-1])

    def _forward(self, cache: WorkingCache, token_ids: Sequence[int]) -> torch.Tensor:
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        with self._lock:
            out = self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    @torch.inference_mode()
    def decode(self, cache: WorkingCache, first_logits: torch.Tensor, params: SamplingParams) -> Iterator[int]:
        """Yield up to `params.max_new_tokens` token ids, stopping after a stop token.

        Every yielded token except the last is fed back into `cache`: the last one (a stop token,
        or the token at the length limit) is never run through the model, so after the loop the
        cache covers the prompt plus all but the last generated token.
        """
        sampler = Sampler(params)
        logits = first_logits
        for step in range(params.max_new_tokens):
            token = sampler(logits)
            yield token
            if token in self.stop_token_ids or step == params.max_new_tokens - 1:
                return
            logits = self._forward(cache, [token])
