"""Importance of cached tokens from the attention an observation window of recent queries pays them.

SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024): the last
few queries of a prompt (the observation window) attend to much the same prompt tokens the reply
will attend to, so their attention, summed over the window and pooled over a small neighbourhood
(so a kept token keeps its neighbours, which carry the rest of a fact), ranks the cached tokens of
each KV head. H2O (Zhang et al., 2023) ranks by attention accumulated over all queries instead;
chatkv scores once per turn, when the window must shrink, so it takes SnapKV's observation window
(the new turn's prefill) rather than accumulating over every decode step.

SDPA does not return attention weights and switching the model to eager attention would slow every
step, so only the window's query states are captured (`ObservationWindow`, through the packed
attention's `PreallocatedLayer.query_observer`; RoPE already applied) and `softmax(q k^T * scale)`
is computed here against the cached keys, for `window_tokens` queries per model layer: a
`[heads, window, cached]` product, small beside the prefill itself.

    working cache (one model layer)   | cached tokens ........................ | new turn's prefill    |
    queries captured                                                            |   ...  | last W     |
    scores                            | sum over W, over each KV group's query heads; max-pooled       |

The `agnostic` policy's scores are KVzip's (Kim et al., NeurIPS 2025): `ReconstructionScores`, the
most attention any query of a prompt that repeats the context pays each KV pair, captured while
`sessions.turn.window.TurnWindow.reconstruction_scores` prefills that prompt after each committed
turn (served: the runner runs it once per committed turn). `QueryLog` keeps every query of a turn
instead (prefill and reply, the last 1,024 per model layer): a pass-free approximation, served only
where a chunked rebuild scores its chunks, and measured against the reconstruction in
`benchmarks/window_quality.py` (its `querylog` rows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Self

import torch
import torch.nn.functional as F

from cache.working_cache import PreallocatedLayer, WorkingCache

DEFAULT_POOL_KERNEL = 7
"""Neighbourhood of the max-pool over scores (SnapKV pools with kernels 5-7)."""


class _QueryObservers:
    """Attaches `_observer(index)` as the query observer of every full-attention model layer of a
    working cache for a `with` block (the packed attention calls it with each chunk's query states,
    RoPE applied, and the layer's scaling). A sliding-window layer gets none: its own window is the
    hard limit of what it holds, which eviction never touches."""

    def __init__(self, working: WorkingCache) -> None:
        self._layers: list[PreallocatedLayer] = working.prealloc_layers

    def __enter__(self) -> Self:
        for index, layer in enumerate(self._layers):
            if layer.window is None:
                layer.query_observer = self._observer(index)
        return self

    def __exit__(self, *exc: object) -> None:
        for layer in self._layers:
            layer.query_observer = None

    def _observer(self, index: int) -> Callable[[torch.Tensor, float | None], None]:
        raise NotImplementedError


class ObservationWindow(_QueryObservers):
    """Captures the last `window_tokens` query states of every full-attention model layer while a
    prefill runs. A sliding-window layer gets no observer: its own window is the hard limit of what
    it holds, which eviction never touches, so nothing past it is ever scored (or captured).

    Attach to a working cache before the prefill, detach after (`with` block). The captured states
    are `[1, heads, <= window_tokens, head_dim]` per model layer, in the model's dtype.

    Args:
        working: the cache the prefill runs on (its `PreallocatedLayer`s get the observer).
        window_tokens: queries kept per model layer, at the end of the prefill.

    Raises:
        ValueError: if `window_tokens < 1`.
    """

    def __init__(self, working: WorkingCache, window_tokens: int) -> None:
        if window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
        super().__init__(working)
        self.window_tokens = window_tokens
        self._queries: list[torch.Tensor | None] = [None] * len(self._layers)
        self._scaling: float | None = None

    def _observer(self, index: int) -> Callable[[torch.Tensor, float | None], None]:
        def capture(query: torch.Tensor, scaling: float | None) -> None:
            previous = self._queries[index]
            joined = query if previous is None else torch.cat([previous, query], dim=2)
            self._queries[index] = joined[:, :, -self.window_tokens :].clone()
            self._scaling = scaling

        return capture

    def scores(self, cached_tokens: int, pool_kernel: int = DEFAULT_POOL_KERNEL) -> torch.Tensor:
        """Importance of the first `cached_tokens` tokens of the working cache (those before the
        prefill), per model layer and KV head.

        Only full-attention model layers are scored (a sliding-window layer holds its own window,
        which eviction never touches).

        Returns:
            `[full_model_layers, kv_heads, cached_tokens]` float32 on the CPU: attention of the
            window's queries (each a probability distribution over every key it sees, causal
            inside the prefill), summed over the window and over the query heads sharing each KV
            head (GQA), then max-pooled over `pool_kernel` neighbouring tokens.

        Raises:
            RuntimeError: if a model layer captured no query (the prefill did not run).
        """
        out = []
        for index, layer in enumerate(self._layers):
            if layer.window is not None:
                continue
            query = self._queries[index]
            if query is None:
                raise RuntimeError(f"bug: model layer {index} captured no query states")
            scored = _layer_scores(query, layer.filled_keys, self._scaling, cached_tokens, pool_kernel, layer)
            out.append(F.pad(scored, (0, cached_tokens - scored.shape[1])))  # a narrower ragged layer's buffer
        return torch.stack(out)


def _visible(keys: torch.Tensor, first_query: int, queries: int, layer: PreallocatedLayer | None) -> torch.Tensor:
    """`[kv_heads | 1, 1, queries, t]` bool: the slots of `keys [1, kv_heads, t, d]` that queries at
    slots `first_query ..` see: causal, minus a ragged `layer`'s holes (`PreallocatedLayer.held_slots`)."""
    total = keys.shape[2]
    rows = torch.arange(first_query, first_query + queries, device=keys.device)  # each query's own slot
    visible = (torch.arange(total, device=keys.device)[None, :] <= rows[:, None])[None, None]  # [1, 1, n, t]
    if layer is not None and layer.head_valid is not None:
        visible = visible & layer.held_slots(total)[:, None, None, :]
    return visible


def _layer_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float | None,
    cached_tokens: int,
    pool_kernel: int,
    layer: PreallocatedLayer | None = None,
) -> torch.Tensor:
    """`query [1, heads, w, d]` (the last `w` tokens of `keys`), `keys [1, kv_heads, t, d]` (of
    `layer`, whose holes are masked when ragged) -> `[kv_heads, min(cached_tokens, t)]` float32."""
    heads, window, head_dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads, total = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    q = query[0].float().reshape(kv_heads, groups * window, head_dim)  # query heads of a group together
    logits = torch.bmm(q, keys[0].float().transpose(1, 2)) * scale  # [kv, groups * w, t]
    visible = _visible(keys, total - window, window, layer)
    logits = logits.view(kv_heads, groups, window, total).masked_fill(~visible, float("-inf"))
    weights = logits.softmax(dim=-1).sum(dim=(1, 2))[:, :cached_tokens]  # [kv, cached]
    if pool_kernel > 1 and cached_tokens > 0:
        weights = F.max_pool1d(weights[:, None], pool_kernel, stride=1, padding=pool_kernel // 2)[:, 0]
    return weights.to("cpu")


QUERY_LOG_TOKENS = 1024
"""Queries a `QueryLog` keeps per model layer (the most recent): bounds its memory on a long rebuild."""


class QueryLog(ObservationWindow):
    """Captures the query states of every full-attention model layer while a whole turn runs
    (its prefill chunks and decode steps): the pass-free approximation of the `agnostic` window
    policy's scores. Measured, not served on the turn path: a committed turn is scored by KVzip's
    reconstruction (`ReconstructionScores`); only a chunked rebuild's chunks are scored by their
    own queries (`TurnWindow.prefill_evicting`, where a reconstruction per chunk would double the
    rebuild), and `benchmarks/window_quality.py`'s `querylog` rows replay it at every commit.

    KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
    NeurIPS 2025) scores each KV pair by the most attention it receives while the model repeats
    its context, a score no later question changes. This approximation costs no extra pass: the
    queries the conversation itself ran (each turn's prompt and reply) stand in for the
    reconstruction's, and a pair's score is the most attention any of them paid it (KVzip's max
    over queries and the query heads of a KV group), accumulated as turns commit
    (`cache.token_eviction.committed_scores`). Measured against the reconstruction
    (benchmarks/README.md, "KVzip's own scores"): about even with the uniform budgets (better at
    25-50% of the context), at a ninth of its cost per commit; the reconstruction wins with
    per-head (Ada-KV) budgets.

    Attach to the turn's working cache before it is submitted (`with` block), `turn_scores` after
    it finished. At most
    the last `keep_tokens` queries per model layer are kept, `[1, heads, <= keep_tokens, head_dim]`
    in the model's dtype (after RoPE). The packed attention calls the observers from the engine
    loop's thread; `scores` is read on the caller's thread once the request's result arrived.

    Raises:
        ValueError: if `keep_tokens < 1`.
    """

    def __init__(self, working: WorkingCache, keep_tokens: int = QUERY_LOG_TOKENS) -> None:
        super().__init__(working, keep_tokens)
        self._chunks: list[list[torch.Tensor]] = [[] for _ in self._layers]
        self._fed = [0] * len(self._layers)
        self._start = [layer.get_seq_length() for layer in self._layers]

    def _observer(self, index: int) -> Callable[[torch.Tensor, float | None], None]:
        def capture(query: torch.Tensor, scaling: float | None) -> None:
            chunks = self._chunks[index]
            self._fed[index] += query.shape[2]
            chunks.append(query.clone())  # a decode step's one query: no copy of the log per step
            if sum(c.shape[2] for c in chunks) > 2 * self.window_tokens:
                chunks[:] = [torch.cat(chunks, dim=2)[:, :, -self.window_tokens :]]
            self._scaling = scaling

        return capture

    def _logged(self, index: int) -> torch.Tensor | None:
        chunks = self._chunks[index]
        return torch.cat(chunks, dim=2)[:, :, -self.window_tokens :] if chunks else None

    def turn_scores(self) -> tuple[torch.Tensor, ...]:
        """Per full-attention model layer, `[kv_heads, filled]` float32 on the CPU: the most
        attention each slot of the layer's buffer received from any logged query of the turn,
        over the query heads sharing each KV head; causal (a query sees the slots up to its own).
        Queries of slots cropped off the buffer after they were fed (a reply cut by a stop string)
        are dropped.

        Raises:
            RuntimeError: if a full model layer captured no query (the turn did not run).
        """
        out = []
        for index, layer in enumerate(self._layers):
            if layer.window is not None:
                continue
            query = self._logged(index)
            if query is None:
                raise RuntimeError(f"bug: model layer {index} captured no query states")
            cropped = self._start[index] + self._fed[index] - layer.get_seq_length()
            query = query[:, :, : max(0, query.shape[2] - cropped)]
            out.append(_max_attention_on_device(query, layer.filled_keys, self._scaling, layer).to("cpu"))
        return tuple(out)


def _max_attention_on_device(
    query: torch.Tensor, keys: torch.Tensor, scaling: float | None, layer: PreallocatedLayer | None = None
) -> torch.Tensor:
    """`query [1, heads, w, d]` (the last `w` slots of `keys [1, kv_heads, t, d]`, of `layer`, whose
    holes are masked when ragged) -> `[kv_heads, t]` float32 on the keys' device: each slot's
    largest attention weight over the queries and grouped heads (0 in a hole)."""
    heads, window, head_dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads, total = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    best = torch.zeros(kv_heads, total, device=keys.device)
    k = keys[0].float().transpose(1, 2)  # [kv, d, t]
    for first in range(0, window, 256):  # chunks of queries bound the [kv, g * n, t] product
        q = query[0, :, first : first + 256].float()
        n = q.shape[1]
        logits = torch.bmm(q.reshape(kv_heads, groups * n, head_dim), k) * scale
        visible = _visible(keys, total - window + first, n, layer)
        logits = logits.view(kv_heads, groups, n, total).masked_fill(~visible, float("-inf"))
        best = torch.maximum(best, logits.softmax(dim=-1).amax(dim=(1, 2)))
    return best


class ReconstructionScores(_QueryObservers):
    """KVzip's importance of cached KV pairs (Kim et al., "KVzip: Query-Agnostic KV Cache Compression
    with Context Reconstruction", NeurIPS 2025): while a prompt that makes the model repeat its
    context is prefilled on top of the cache, each cached pair's score is the largest attention
    weight any of the prompt's queries gives it, over the query heads sharing its KV head (GQA).
    A pair the model never needs to reproduce its context is one no later question needs either,
    so the score does not depend on what is asked next.

    Attach to the working cache the reconstruction prefill runs on (`with` block): every
    full-attention model layer gets a query observer that scores the `cached_tokens` first slots
    as each prefill chunk runs (keys already hold the chunk; causal), so no query is stored. A
    sliding-window layer is never scored (eviction never touches its window). The observers run on
    the engine loop's thread; read `scores` once the prefill returned.

    Args:
        working: the buffer of the reconstruction (a copy of the cache: its extra slots are dropped).
        cached_tokens: slots to score, from the first (base included): the cache's `score_width`
            (a ragged layer's own slots are padded to its longest head; holes score 0).

    Raises:
        ValueError: if `cached_tokens` is negative.
    """

    def __init__(self, working: WorkingCache, cached_tokens: int) -> None:
        if cached_tokens < 0:
            raise ValueError(f"cached_tokens must be >= 0, got {cached_tokens}")
        super().__init__(working)
        self.cached_tokens = cached_tokens
        self._best: list[torch.Tensor | None] = [None] * len(self._layers)

    def _observer(self, index: int) -> Callable[[torch.Tensor, float | None], None]:
        layer = self._layers[index]

        def score(query: torch.Tensor, scaling: float | None) -> None:
            fresh = _max_attention_on_device(query, layer.filled_keys, scaling, layer)
            fresh = F.pad(fresh, (0, max(0, self.cached_tokens - fresh.shape[1])))[:, : self.cached_tokens]
            best = self._best[index]
            self._best[index] = fresh if best is None else torch.maximum(best, fresh)

        return score

    def scores(self) -> torch.Tensor:
        """`[full_model_layers, kv_heads, cached_tokens]` float32 on the CPU, in `[0, 1]`.

        Raises:
            RuntimeError: if a full-attention model layer saw no query (the prefill did not run).
        """
        out = []
        for index, layer in enumerate(self._layers):
            if layer.window is not None:
                continue
            best = self._best[index]
            if best is None:
                raise RuntimeError(f"bug: model layer {index} scored nothing")
            out.append(best.to("cpu"))
        return torch.stack(out)
