"""A request: one prepared turn (or a prefill-only job) handed to the engine loop, and its output channel.

The model of a request is vLLM v1's: there is no prefill phase or decode phase, only tokens the
request still has to feed (`pending_ids`: the rest of its prefill, or the last sampled token) and a
cache that holds the tokens already fed. Each step feeds some of them (all of a decode's one token,
a chunk of a prefill) and, when the last pending token was fed, samples the next one.

    caller thread                       engine loop thread
    Request(...) ; loop.submit(r)  ->   waiting -> admitted (KV reserved, buffer built) -> running
    for t in r.tokens(): ...       <-   channel: token ids ..., then a RequestResult (or an error)
    r.cancel()                     ->   dropped at the next step, KV released
    r.finish_early()               ->   finished at the next step, as if at its length limit

Lifecycle is `RequestState`; each mutable field has one writer (the loop), except the two flags
that `cancel()` and `finish_early()` set.
"""

from __future__ import annotations

import enum
import itertools
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cache.ids import TenantId
from cache.session_cache import SessionCache
from cache.working_cache import WorkingCache
from sessions.sampling import Sampler, SamplingParams

_ids = itertools.count(1)


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


class RequestCancelled(Exception):
    """The request was cancelled before it finished (its stream was closed, or it was withdrawn)."""


class KVAccountant(Protocol):
    """Who pays for a request's KV buffer on the device (the tier manager of the request's manager)."""

    def reserve_device_bytes(self, nbytes: int, *, force: bool) -> bool:
        """Reserve `nbytes` of the device budget, evicting idle caches if needed. Returns `False`
        when they do not fit (unless `force`: then reserve anyway, for a request that runs alone)."""
        ...

    def release_device_bytes(self, nbytes: int) -> None: ...


@dataclass(frozen=True)
class RequestResult:
    """What a finished request leaves for its caller.

    Attributes:
        working: the request's KV cache: the start cache, the prefill, and every generated token
            but the last (that one was never fed).
        generated: sampled ids, the stop token included when one ended the reply.
        last_logits: `[vocab]` float logits of the last prefilled token for a prefill-only request,
            else `None`.
        queue_s: seconds from `submit` to the first step that ran the request.
    """

    working: WorkingCache
    generated: tuple[int, ...]
    last_logits: torch.Tensor | None
    queue_s: float


class Request:
    """One unit of work for the engine loop.

    Args:
        tenant_id: whose request it is (fair admission goes round-robin over tenants).
        prefill_ids: ids to feed before the first sampled token (at least one).
        params: sampling parameters; `None` for a prefill-only request (no token is sampled; the
            result carries the last token's logits).
        start: the session cache to continue; the loop builds the request's working buffer from it
            at admission, sized for the prefill plus `max_new_tokens`.
        working: an already built working cache to continue instead of `start` (prefill-only jobs
            of the engine itself); exactly one of `start` and `working` is given.
        stop_token_ids: ids that end the reply.
        accountant: reserves the working buffer's bytes against a device budget; `None`: unbudgeted.
        reserve_kv: reserve the working buffer's bytes (`SessionCache.working_nbytes`: each model
            layer's own length, a sliding layer's tail only; or, for a given `working`, its
            buffers' capacity) through `accountant`.
        keep_logits: keep every sampled row's logits (`sampled_logits`), for exactness tests.

    Raises:
        ValueError: for an empty prefill, or not exactly one of `start` and `working`.
    """

    def __init__(
        self,
        *,
        tenant_id: TenantId,
        prefill_ids: Sequence[int],
        params: SamplingParams | None,
        start: SessionCache | None = None,
        working: WorkingCache | None = None,
        stop_token_ids: Sequence[int] = (),
        accountant: KVAccountant | None = None,
        reserve_kv: bool = False,
        keep_logits: bool = False,
    ) -> None:
        if not prefill_ids:
            raise ValueError("a request needs at least one token to prefill")
        if (start is None) == (working is None):
            raise ValueError("give exactly one of start and working")
        self.id = next(_ids)
        self.tenant_id = tenant_id
        self.params = params
        self.start = start
        self.working = working
        self.stop_token_ids = frozenset(stop_token_ids)
        self.accountant = accountant
        self.pending_ids: list[int] = list(prefill_ids)
        self.generated: list[int] = []
        self.sampler = Sampler(params) if params is not None else None
        self.state = RequestState.WAITING
        self.submitted_at = time.monotonic()
        self.scheduled_at: float | None = None
        self.reserved_bytes = 0
        new = len(prefill_ids) + (params.max_new_tokens if params is not None else 0)
        self.kv_bytes = 0
        if reserve_kv:
            self.kv_bytes = start.working_nbytes(new) if start is not None else working.nbytes if working else 0
        self.sampled_logits: list[torch.Tensor] | None = [] if keep_logits else None
        self._stop_index: torch.Tensor | None = None  # the stop ids on the logits' device, made once
        self._channel: queue.SimpleQueue[int | RequestResult | BaseException] = queue.SimpleQueue()
        self._cancel_error: BaseException | None = None
        self._cancelled = threading.Event()
        self._finish_early = threading.Event()

    # -- caller side ---------------------------------------------------------------------------

    def tokens(self) -> Iterator[int]:
        """Yield sampled ids as the loop produces them; return the `RequestResult`.

        Raises:
            RequestCancelled, or the error given to `cancel`, or the error the forward pass raised.
        """
        while True:
            item = self._channel.get()
            if isinstance(item, RequestResult):
                return item  # type: ignore[return-value]  # a generator's return value
            if isinstance(item, BaseException):
                raise item
            yield item

    def result(self) -> RequestResult:
        """Wait for the request to finish, discarding streamed tokens."""
        stream = self.tokens()
        while True:
            try:
                next(stream)
            except StopIteration as done:
                result: RequestResult = done.value
                return result

    def cancel(self, error: BaseException | None = None) -> None:
        """Withdraw the request: the loop drops it at its next step and frees its KV. A reader of
        `tokens()` then gets `error` (default `RequestCancelled`). No-op once finished."""
        if self._cancelled.is_set():
            return
        self._cancel_error = error
        self._cancelled.set()

    def finish_early(self) -> None:
        """End the reply here (the caller found a stop string in its text): the loop finishes the
        request at its next step, normally, as if it had reached its length limit. Tokens sampled
        before that step still reach the channel; the result's working cache holds every generated
        token but the last, as always. Honoured once the request has sampled a token; a no-op
        after it finished or was cancelled (a cancel wins)."""
        self._finish_early.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def finishing_early(self) -> bool:
        """`finish_early` was asked and there is a reply to end (loop side)."""
        return self._finish_early.is_set() and bool(self.generated)

    @property
    def queue_s(self) -> float:
        return 0.0 if self.scheduled_at is None else self.scheduled_at - self.submitted_at

    # -- loop side -----------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.CANCELLED, RequestState.FAILED)

    @property
    def in_prefill(self) -> bool:
        """Still feeding prompt tokens (before its first sampled token)."""
        return not self.generated and bool(self.pending_ids)

    def emit(self, token: int) -> None:
        self.generated.append(token)
        self._channel.put(token)

    def finish(self, last_logits: torch.Tensor | None = None) -> None:
        if self.working is None:
            raise RuntimeError(f"bug: request {self.id} finished without a working cache")
        self.state = RequestState.FINISHED
        self._channel.put(RequestResult(self.working, tuple(self.generated), last_logits, self.queue_s))

    def fail(self, error: BaseException) -> None:
        self.state = RequestState.FAILED
        self._channel.put(error)

    def drop_cancelled(self) -> None:
        self.state = RequestState.CANCELLED
        self.working = None  # frees the buffer now; nobody will read it
        self._channel.put(self._cancel_error or RequestCancelled(f"request {self.id} was cancelled"))

    def sample(self, logits: torch.Tensor) -> int:
        """The next token from this request's `[vocab]` logits row (its own sampler). While its
        parameters forbid ending the reply (`min_new_tokens` not reached, or `ignore_eos`), the stop
        tokens' logits are masked to -inf in a copy of the row, so other rows are untouched.

        Raises:
            RuntimeError: for a prefill-only request (it samples nothing).
        """
        if self.sampler is None or self.params is None:
            raise RuntimeError(f"bug: prefill-only request {self.id} asked to sample")
        if self.stop_token_ids and not self.params.stop_tokens_allowed(len(self.generated)):
            # Made once per request: a tensor from a list is a host-to-device copy that waits for
            # the device on CUDA, and `ignore_eos` masks at every step.
            if self._stop_index is None or self._stop_index.device != logits.device:
                self._stop_index = torch.tensor(sorted(self.stop_token_ids), dtype=torch.long, device=logits.device)
            logits = logits.index_fill(0, self._stop_index, float("-inf"))
        return self.sampler(logits)

    def wants_to_stop(self, token: int) -> bool:
        """After sampling `token`: is the reply complete (a stop token, or the length limit)?"""
        if self.params is None:
            return True
        return token in self.stop_token_ids or len(self.generated) >= self.params.max_new_tokens
