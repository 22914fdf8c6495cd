"""The write-back worker of the tier manager: one background thread that seals each committed cache
and writes it to disk, stepping aside while turns run.

With write-back, moving a persisted session from host to disk is instant and a crash loses no
cache. The writer steps aside while turns run: sealing holds the GIL for tens of milliseconds per
100 MB (safetensors encoding, AES-GCM), and a turn's hundreds of short torch calls each wait for it
(a GIL convoy: measured here, a follow-up turn of a 2,000-token session took 645 ms instead of
222 ms while another session's cache was being sealed). So a write-back starts once no turn has
been in flight for `settle_s`, pauses between its steps while one is, and goes ahead anyway
`max_defer_s` after it was queued, so a busy server still persists (bounding what a crash loses).
It does not yield when the device tier is nearly full (an eviction would then seal the cache
synchronously, on a turn's thread, instead), nor while `flush()` waits.

What to write, and how, stays with the tier manager: it hands this worker three callbacks
(`WriteBack` arguments). This module owns only the queue, the thread and the yielding rule.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from cache.tiers import CacheKey

log = logging.getLogger(__name__)

WRITE_BACK_SETTLE_S = 0.05
"""Seconds without a turn in flight before a write-back starts sealing."""
WRITE_BACK_MAX_DEFER_S = 2.0
"""Seconds after a write-back is queued at which it runs even if turns are still going on."""
WRITE_BACK_DEVICE_PRESSURE = 0.75
"""Device-tier use (share of its budget) above which the writer stops yielding: the next
eviction would otherwise have to seal a not-yet-persisted cache on a turn's thread, under the lock."""


class WriteBack:
    """Queue of write-back jobs, run one at a time on a background thread, yielding to turns.

    The tier manager reports turns (`turn_started`, `turn_ended`) and queues a job per committed
    cache (`queue`); every acquire has its release: `flush` waits for the queued jobs, `close`
    stops the thread.

    Args:
        lock: the tier manager's lock. The writer waits on a condition of it (so a turn ending
            under that lock wakes it) and calls `is_due` and `device_use` with it held.
        is_due: whether `key` still has a version to write (not deleted, on the device, not yet
            on disk); a job that is not due returns without waiting for turns.
        write: seals and writes `key`'s current version, calling its `pause` argument between the
            sealing steps; it checks again whether the version is still due.
        device_use: the device tier's `(bytes in use, budget bytes)`.
        settle_s, max_defer_s: see the module docstring; `None` takes `WRITE_BACK_SETTLE_S` and
            `WRITE_BACK_MAX_DEFER_S` as they are when the writer is made.
    """

    def __init__(
        self,
        *,
        lock: threading.RLock,
        is_due: Callable[[CacheKey], bool],
        write: Callable[[CacheKey, Callable[[], None]], None],
        device_use: Callable[[], tuple[int, int]],
        settle_s: float | None = None,
        max_defer_s: float | None = None,
    ) -> None:
        self._lock = lock
        self._is_due = is_due
        self._write = write
        self._device_use = device_use
        self._settle_s = WRITE_BACK_SETTLE_S if settle_s is None else settle_s
        self._max_defer_s = WRITE_BACK_MAX_DEFER_S if max_defer_s is None else max_defer_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatkv-write-back")
        self._pending: dict[CacheKey, Future[None]] = {}
        self._closed = False
        self._turns_in_flight = 0
        self._hurry = 0
        self._last_turn_end = time.monotonic()
        self._turn_ended = threading.Condition(lock)

    # -- what the writer yields to -------------------------------------------------------------

    def turn_started(self) -> None:
        with self._lock:
            self._turns_in_flight += 1

    def turn_ended(self) -> None:
        with self._lock:
            self._turns_in_flight -= 1
            self._last_turn_end = time.monotonic()
            self._turn_ended.notify_all()

    def wake(self) -> None:
        """Make a waiting writer check its conditions again (device use changed)."""
        with self._lock:
            self._turn_ended.notify_all()

    # -- jobs ----------------------------------------------------------------------------------

    def queue(self, key: CacheKey) -> None:
        """Write `key`'s cache in the background (nothing once `close` was called)."""
        with self._lock:
            if self._closed:
                return
            future = self._executor.submit(self._run, key, time.monotonic() + self._max_defer_s)
            self._pending[key] = future
        future.add_done_callback(lambda done: self._done(key, done))

    def cancel(self, key: CacheKey) -> None:
        """Drop `key`'s queued job, if it has not started (its session was deleted)."""
        with self._lock:
            future = self._pending.pop(key, None)
            if future is not None:
                future.cancel()

    def _done(self, key: CacheKey, future: Future[None]) -> None:
        with self._lock:
            if self._pending.get(key) is future:
                del self._pending[key]
        if not future.cancelled() and future.exception() is not None:
            # The cache stays on the device and is written at eviction or shutdown instead.
            log.error("write-back of session %s failed", key.name, exc_info=future.exception())

    def _run(self, key: CacheKey, deadline: float) -> None:
        with self._lock:
            if not self._is_due(key):
                return  # e.g. an earlier job already wrote this version: no need to wait for turns
        self._step_aside(deadline)
        self._write(key, lambda: self._step_aside(deadline))

    def _step_aside(self, deadline: float) -> None:
        """Block the writer until no turn has been in flight for the settle time, or `deadline`
        (`time.monotonic()` seconds) passes, the device tier is nearly full, a `flush()` waits,
        or the writer closes."""
        with self._lock:
            while not self._closed and not self._hurry:
                now = time.monotonic()
                if now >= deadline or self._device_pressure():
                    return
                if self._turns_in_flight:
                    timeout = deadline - now
                else:
                    quiet = now - self._last_turn_end
                    if quiet >= self._settle_s:
                        return
                    timeout = min(self._settle_s - quiet, deadline - now)
                self._turn_ended.wait(timeout)

    def _device_pressure(self) -> bool:
        """Under the lock: is the device tier above `WRITE_BACK_DEVICE_PRESSURE` of its budget?"""
        used, budget = self._device_use()
        return used > WRITE_BACK_DEVICE_PRESSURE * budget

    # -- lifecycle -----------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for queued write-backs, which stop yielding to turns meanwhile (a failed one was
        logged; its cache is written at shutdown)."""
        with self._lock:
            futures = list(self._pending.values())
            self._hurry += 1
            self._turn_ended.notify_all()
        try:
            wait(futures)
        finally:
            with self._lock:
                self._hurry -= 1

    def close(self) -> None:
        """Stop queueing, stop yielding, and wait for the job in progress and those queued."""
        with self._lock:
            self._closed = True
            self._turn_ended.notify_all()
        self._executor.shutdown(wait=True)
