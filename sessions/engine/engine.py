"""The engine: the front over the model runner and the engine loop (nano-vllm's `LLMEngine` over
its `ModelRunner`). Thread-safe: every model call is a request the loop runs.

    Engine --owns--> ModelRunner   the model, its KV layout, one forward pass per step
           --owns--> EngineLoop    the one thread that schedules requests and calls the runner
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from cache.ids import TenantId
from cache.rope import RopeLayout
from cache.session_cache import BaseLayer, SessionCache
from cache.working_cache import WorkingCache
from sessions.engine.config import SchedulerConfig
from sessions.engine.loop import EngineLoop
from sessions.engine.model_runner import KVLayout, ModelRunner
from sessions.engine.request import Request
from sessions.model_source import LoadedModel
from sessions.sampling import SamplingParams

ENGINE_TENANT = TenantId("chatkv-engine")
"""Tenant of the engine's own prefill-only jobs (a base layer recomputed, kept turns re-prefilled)."""


class Engine:
    """Runs one loaded model through its engine loop: `submit` a request, or `prefill`/`generate`
    on a working cache and wait.

    Attributes:
        runner: the `ModelRunner` (the model and its facts; its `forward` runs one step).
        loop: the `EngineLoop` (started by the first request); it calls `runner.forward`.

    Args:
        loaded: the model; its attention implementation is switched to the packed one (which falls
            back to the original for ordinary calls).
        scheduler: the loop's limits (default `SchedulerConfig()`).
    """

    def __init__(self, loaded: LoadedModel, scheduler: SchedulerConfig | None = None) -> None:
        self.runner = ModelRunner(loaded)
        # Looked up at each step, so a test can wrap `runner.forward` to watch the passes.
        self.loop = EngineLoop(
            lambda batch: self.runner.forward(batch), self.runner.device, scheduler or SchedulerConfig()
        )

    # -- the model's facts ---------------------------------------------------------------------
    # Read-only views of the runner's: the engine's callers (turns, templates, the tiers' sealer,
    # tests, benchmarks) read the model's facts through the engine they were handed.

    @property
    def loaded(self) -> LoadedModel:
        return self.runner.loaded

    @property
    def model(self) -> Any:
        return self.runner.model

    @property
    def tokenizer(self) -> Any:
        return self.runner.tokenizer

    @property
    def fingerprint(self) -> str:
        return self.runner.fingerprint

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def layout(self) -> KVLayout:
        return self.runner.layout

    @property
    def max_context_tokens(self) -> int:
        """The model's `max_position_embeddings`."""
        return self.runner.max_context_tokens

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end a reply (the generation config's and tokenizer's EOS)."""
        return self.runner.stop_token_ids

    @property
    def rope_layout(self) -> RopeLayout | None:
        """The model's RoPE layout when cached keys can be re-rotated, else `None`."""
        return self.runner.rope_layout

    def empty_cache(self, base: BaseLayer | None) -> SessionCache:
        """A session cache holding only `base` (or nothing), shaped for this model's KV."""
        return self.runner.empty_cache(base)

    # -- running requests ----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine loop and join its thread (`EngineLoop.stop`): nothing then holds the
        engine but its callers, so the model's memory goes with their last reference. For the
        owner of the engine only (a `SessionManager` that loaded it); later requests raise
        `EngineStopped`. Idempotent."""
        self.loop.stop()

    def submit(self, request: Request) -> Request:
        """Queue `request` on the engine loop; read its output with `request.tokens()`."""
        return self.loop.submit(request)

    def compute_prefix(self, token_ids: Sequence[int]) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """KV of `token_ids` at positions `0..n-1`: per model layer `[1, kv_heads, n, head_dim]`."""
        working = self.empty_cache(None).to_working_cache(len(token_ids))
        self.prefill(working, token_ids)
        keys = tuple(layer.filled_keys.clone() for layer in working.prealloc_layers)
        values = tuple(layer.filled_values.clone() for layer in working.prealloc_layers)
        return keys, values

    def prefill(self, cache: WorkingCache, token_ids: Sequence[int]) -> torch.Tensor:
        """Run `token_ids` through the model on top of `cache` (positions continue from its
        `next_position`) and return the `[vocab]` logits of the last one. Waits for the engine loop.

        Raises:
            ValueError: if `token_ids` is empty.
        """
        request = Request(tenant_id=ENGINE_TENANT, prefill_ids=token_ids, params=None, working=cache)
        result = self.submit(request).result()
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
        stream = self.submit(request).tokens()
        try:
            yield from stream
        finally:
            request.cancel()
