"""The engine loop: one thread, the only code that runs the model.

Each step (nano-vllm's `step`, with chunked prefill mixed in):

    plan = scheduler.schedule()      admit round-robin over tenants; one token per decode + prefill chunks
    logits = forward(pack(plan))     one forward pass over every running request
    postprocess(plan, logits)        sample per request; push tokens to channels; finish requests

Callers prepare their turn (restore, window, ids), submit a `Request` and read its channel; the
turn's completion (storing it, committing the cache) happens on the caller's thread, so the loop
never waits on the database or the disk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from cache.ids import TenantId
from cache.working_cache import PreallocatedLayer, WorkingCache
from sessions.engine.batch import PackedBatch, pack
from sessions.engine.config import SchedulerConfig
from sessions.engine.request import Request
from sessions.engine.scheduler import Scheduler, StepPlan
from sessions.errors import EngineStopped

log = logging.getLogger(__name__)

BUSY_WINDOW_S = 60.0
"""Wall-clock window over which `LoopStats.busy_fraction` is computed."""


class StepObserver(Protocol):
    """Told about every step (metrics implement it)."""

    def step(self, requests: int, tokens: int, forward_s: float) -> None: ...


@dataclass(frozen=True)
class LoopStats:
    """A snapshot of the loop for metrics: request counts per tenant and the busy fraction (the share
    of the last `BUSY_WINDOW_S` of wall time spent in forward passes)."""

    running: dict[TenantId, int]
    waiting: dict[TenantId, int]
    busy_fraction: float
    steps: int


class EngineLoop:
    """Runs `forward` on packed steps in a daemon thread started by the first `submit`, until
    `stop` (which joins it: a stopped loop holds no thread, and nothing of the model).

    Args:
        forward: runs the model on a packed batch and returns `[len(batch.logits_indices), vocab]`
            logits (the `ModelRunner`'s `forward`, looked up by the `Engine` at each step).
        device: where the packed input tensors are built.
        config: the scheduler's limits.
    """

    def __init__(
        self, forward: Callable[[PackedBatch], torch.Tensor], device: torch.device, config: SchedulerConfig
    ) -> None:
        self._forward = forward
        self._device = device
        self._scheduler = Scheduler(config)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._observers: list[StepObserver] = []
        self._busy: deque[tuple[float, float]] = deque()
        self._started_at = time.monotonic()
        self._steps = 0
        self._stopped = False

    @property
    def config(self) -> SchedulerConfig:
        return self._scheduler.config

    def configure(self, config: SchedulerConfig) -> None:
        """Change the limits; takes effect at the next step."""
        with self._wake:
            self._scheduler.config = config

    def add_observer(self, observer: StepObserver) -> None:
        with self._wake:
            self._observers.append(observer)

    def remove_observer(self, observer: StepObserver) -> None:
        with self._wake:
            if observer in self._observers:
                self._observers.remove(observer)

    def submit(self, request: Request) -> Request:
        """Queue `request`; read its output with `request.tokens()`.

        Raises:
            EngineStopped: the loop was stopped (its engine was closed).
        """
        with self._wake:
            if self._stopped:
                raise EngineStopped("the model's engine was closed by the manager that loaded it")
            self._scheduler.add(request)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="chatkv-engine-loop", daemon=True)
                self._thread.start()
            self._wake.notify()
        return request

    def stop(self) -> None:
        """Stop the loop after its current step and join its thread; requests still queued fail
        with `EngineStopped`. Idempotent; `submit` raises afterwards."""
        with self._wake:
            self._stopped = True
            thread = self._thread
            self._wake.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._fail_all(EngineStopped("the model's engine was closed by the manager that loaded it"))

    def wake(self) -> None:
        """Make the loop look at its queues now (after a `Request.cancel`)."""
        with self._wake:
            self._wake.notify()

    def stats(self) -> LoopStats:
        with self._wake:
            running, waiting = self._scheduler.counts_by_tenant()
            now = time.monotonic()
            window = min(BUSY_WINDOW_S, max(now - self._started_at, 1e-9))
            busy = sum(seconds for end, seconds in self._busy if end >= now - window)
            return LoopStats(running, waiting, min(1.0, busy / window), self._steps)

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            try:
                self._run_once()
            # The loop thread must outlive any bug in one step: its callers would otherwise wait
            # forever. Every request in the queues gets the error instead.
            except Exception as exc:
                log.exception("engine loop step failed; failing every queued request")
                self._fail_all(exc)

    def _fail_all(self, error: BaseException) -> None:
        with self._wake:
            requests = [*self._scheduler.waiting, *self._scheduler.running]
            self._scheduler.waiting.clear()
            self._scheduler.running.clear()
        for request in requests:
            self._free(request)
            request.fail(error)

    def _run_once(self) -> None:
        with self._wake:
            while not self._scheduler.has_work():
                if self._stopped:
                    return
                self._wake.wait()
            plan = self._scheduler.schedule()
        self._release(plan)
        if plan.chunks:
            self._step(plan)
        elif not (plan.admitted or plan.dropped or plan.finished_early or plan.failed):
            with self._wake:  # every runnable request waits for KV room: wait for a change
                self._wake.wait(timeout=0.05)

    def _release(self, plan: StepPlan) -> None:
        for request in plan.dropped:
            self._free(request)
            request.drop_cancelled()
        for request in plan.finished_early:
            self._free(request)
            request.finish()
        for request, error in plan.failed:
            self._free(request)
            request.fail(error)
        for request in plan.admitted:
            request.scheduled_at = time.monotonic()
            if request.working is not None:
                continue
            try:
                request.working = _build_working(request)
            # A per-request boundary: whatever building this request's buffer raises (out of memory,
            # a bad shape from a bug) fails this request only, never the loop or the other requests.
            except Exception as exc:  # noqa: BLE001
                log.warning("request %s: its KV buffer could not be built: %s", request.id, exc)
                self._finish(request, error=exc)

    @torch.inference_mode()
    def _step(self, plan: StepPlan) -> None:
        started = time.monotonic()
        try:
            chunks = [c for c in plan.chunks if not c.request.done]  # a buffer that failed to build
            plan = replace(plan, chunks=tuple(chunks))
            if not chunks:
                return
            batch = pack([(_layers(c.request), c.token_ids, c.samples) for c in chunks], self._device)
            logits = self._forward(batch)
        # The loop is the boundary between every caller and the model: an error of one forward pass
        # (out of memory, a model bug) must reach the callers of that step, not kill the thread.
        except Exception as exc:
            log.exception("forward pass failed; failing the %d requests of the step", len(plan.chunks))
            for chunk in plan.chunks:
                self._finish(chunk.request, error=exc)
            return
        forward_s = time.monotonic() - started
        self._postprocess(plan, logits)
        self._account(len(plan.chunks), plan.num_tokens, forward_s)

    def _postprocess(self, plan: StepPlan, logits: torch.Tensor) -> None:
        row = 0
        for chunk in plan.chunks:
            request = chunk.request
            del request.pending_ids[: len(chunk.token_ids)]
            if not chunk.samples:
                continue
            row_logits = logits[row]
            row += 1
            if request.sampler is None:  # prefill-only
                self._finish(request, last_logits=row_logits.clone())
                continue
            if request.sampled_logits is not None:
                request.sampled_logits.append(row_logits.detach().to("cpu", torch.float32).clone())
            try:
                token = request.sample(row_logits)
            # One request's bad row (NaN logits, a sampler bug) fails that request, not the step.
            except Exception as exc:  # noqa: BLE001
                log.warning("request %s: sampling failed: %s", request.id, exc)
                self._finish(request, error=exc)
                continue
            request.emit(token)
            if request.wants_to_stop(token):
                self._finish(request)
            else:
                request.pending_ids.append(token)

    def _finish(
        self, request: Request, *, last_logits: torch.Tensor | None = None, error: BaseException | None = None
    ) -> None:
        with self._wake:
            self._scheduler.remove(request)
        self._free(request)
        if error is not None:
            request.fail(error)
        else:
            request.finish(last_logits)

    def _free(self, request: Request) -> None:
        if request.reserved_bytes and request.accountant is not None:
            request.accountant.release_device_bytes(request.reserved_bytes)
        request.reserved_bytes = 0

    def _account(self, requests: int, tokens: int, forward_s: float) -> None:
        now = time.monotonic()
        with self._wake:
            self._steps += 1
            self._busy.append((now, forward_s))
            while self._busy and self._busy[0][0] < now - BUSY_WINDOW_S:
                self._busy.popleft()
            observers = list(self._observers)
        for observer in observers:
            observer.step(requests, tokens, forward_s)


def _build_working(request: Request) -> WorkingCache:
    """The request's KV buffer: its start cache plus room for the prefill and the reply."""
    if request.start is None:
        raise RuntimeError(f"bug: request {request.id} has neither a start cache nor a buffer")
    extra = len(request.pending_ids) + (request.params.max_new_tokens if request.params else 0)
    return request.start.to_working_cache(extra)


def _layers(request: Request) -> list[PreallocatedLayer]:
    if request.working is None:
        raise RuntimeError(f"bug: request {request.id} is scheduled without a working cache")
    return request.working.prealloc_layers
