"""Which requests run in the next step, and how many of their tokens.

Scheduling model (after vLLM v1's scheduler): no prefill or decode phase; every running request
has pending ids (the rest of its prefill, or its last sampled token). A step takes one pending id
of every request that is decoding, then chunks of pending prefills (chunked prefill, Sarathi-Serve:
Agrawal et al., OSDI 2024), up to `max_step_tokens`; the prefill ids of a step are also capped by
`max_prefill_tokens` while other requests run or wait, and split max-min fairly over the
prefilling requests' tenants (`fair_shares`). On a CPU a shared step costs about its token count,
so the prefill cap, not the decodes, sets how long the other turns wait for it, and another
tenant's short prompt gets an equal share of each step instead of queueing behind a long one.
A prompt alone in the loop takes `max_step_tokens` ids a step: a forward pass also reads every
weight once, so 32-id steps made a lone 2,000-token prefill about 3x slower on the bundled model
(TTFT medians 83.6 s against 26.6 s, 3 interleaved runs on a loaded CPU). A turn that arrives
then waits for at most one such step.

    running: A decoding, B decoding, C prefilling 6,000 ids, D (another tenant) prefilling 14
    step:    | A 1 | B 1 | C 18 | D 14, samples |     max_prefill_tokens 32: equal shares
             of 16; D needs only 14, so C takes the 2 left

Admission (waiting -> running) is bounded by `max_running_requests`, `max_running_per_tenant` and
the device KV budget (each request reserves its working buffer's bytes through its accountant), and
goes round-robin over tenants (`TenantRoundRobin`): a tenant with 20 waiting turns cannot starve
another tenant's single turn. vLLM and SGLang admit first-come-first-served across all users.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cache.ids import TenantId
from sessions.engine.config import SchedulerConfig
from sessions.engine.request import Request, RequestState

__all__ = ["Scheduler", "SchedulerConfig", "TenantRoundRobin", "fair_shares"]


@dataclass(frozen=True)
class ScheduledChunk:
    """Ids of one request fed in a step; `samples` when they are its last pending ids (the step's
    logits at the chunk's last token then pick the request's next token)."""

    request: Request
    token_ids: tuple[int, ...]
    samples: bool


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]
    admitted: tuple[Request, ...]
    dropped: tuple[Request, ...]
    """Cancelled requests removed from the queues (the loop releases their KV)."""
    finished_early: tuple[Request, ...] = ()
    """Running requests asked to `finish_early`, removed from the queue (the loop finishes them)."""
    failed: tuple[tuple[Request, BaseException], ...] = ()
    """Requests whose admission raised, removed from the queue (the loop fails them)."""

    @property
    def num_tokens(self) -> int:
        return sum(len(chunk.token_ids) for chunk in self.chunks)


class AdmissionPolicy(Protocol):
    """Orders waiting requests for admission."""

    def order(self, waiting: Sequence[Request]) -> list[Request]: ...

    def admitted(self, request: Request) -> None: ...


class TenantRoundRobin:
    """One request per tenant in turn, first-come-first-served within a tenant. Tenants keep their
    place in a ring (in order of arrival), and each admission round starts after the tenant
    admitted last."""

    def __init__(self) -> None:
        self._last: TenantId | None = None
        self._ring: list[TenantId] = []

    def order(self, waiting: Sequence[Request]) -> list[Request]:
        queues: dict[TenantId, list[Request]] = {}
        for request in waiting:
            queues.setdefault(request.tenant_id, []).append(request)
        self._ring = [t for t in self._ring if t in queues or t == self._last]
        self._ring += [t for t in queues if t not in self._ring]
        ring = self._ring
        if self._last in ring:
            cut = ring.index(self._last) + 1
            ring = ring[cut:] + ring[:cut]
        tenants = [t for t in ring if t in queues]
        ordered: list[Request] = []
        depth = 0
        while len(ordered) < len(waiting):
            ordered.extend(queues[t][depth] for t in tenants if depth < len(queues[t]))
            depth += 1
        return ordered

    def admitted(self, request: Request) -> None:
        self._last = request.tenant_id


class Scheduler:
    """Waiting and running requests of one engine loop. Not thread-safe: the loop owns it (the
    loop's lock guards `add`)."""

    def __init__(self, config: SchedulerConfig, policy: AdmissionPolicy | None = None) -> None:
        self.config = config
        self.policy = policy or TenantRoundRobin()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._rotation = 0
        self.failed: list[tuple[Request, BaseException]] = []
        """Requests that failed at admission, for the loop to fail (taken by `schedule`)."""

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Take a finished or failed request off the running list."""
        if request in self.running:
            self.running.remove(request)

    def schedule(self) -> StepPlan:
        dropped = self._drop_cancelled()
        finished = self._take_finished_early()
        admitted = self._admit()
        failed, self.failed = tuple(self.failed), []
        return StepPlan(self._pack(), tuple(admitted), tuple(dropped), tuple(finished), failed)

    def counts_by_tenant(self) -> tuple[dict[TenantId, int], dict[TenantId, int]]:
        """(running, waiting) request counts per tenant."""
        return _count(self.running), _count(self.waiting)

    def _drop_cancelled(self) -> list[Request]:
        dropped = [r for r in (*self.waiting, *self.running) if r.cancelled]
        if dropped:
            self.waiting = [r for r in self.waiting if not r.cancelled]
            self.running = [r for r in self.running if not r.cancelled]
        return dropped

    def _take_finished_early(self) -> list[Request]:
        finished = [r for r in self.running if r.finishing_early]
        if finished:
            self.running = [r for r in self.running if not r.finishing_early]
        return finished

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        per_tenant = _count(self.running)
        for request in self.policy.order(self.waiting):
            if len(self.running) >= self.config.max_running_requests:
                break
            if per_tenant.get(request.tenant_id, 0) >= self.config.tenant_limit:
                continue
            try:
                reserved = self._reserve(request)
            # Making room can fail (a full disk under a base-layer write, a bug in a store): that
            # must fail this request, not every request of the loop.
            except Exception as exc:  # noqa: BLE001
                self.waiting.remove(request)
                self.failed.append((request, exc))
                continue
            if not reserved:
                break  # the device is full: later requests wait too, in order
            self.waiting.remove(request)
            self.running.append(request)
            request.state = RequestState.RUNNING
            per_tenant[request.tenant_id] = per_tenant.get(request.tenant_id, 0) + 1
            self.policy.admitted(request)
            admitted.append(request)
        return admitted

    def _reserve(self, request: Request) -> bool:
        if request.accountant is None or not request.kv_bytes:
            return True
        alone = not self.running
        if not request.accountant.reserve_device_bytes(request.kv_bytes, force=alone):
            return False
        request.reserved_bytes = request.kv_bytes
        return True

    def _pack(self) -> tuple[ScheduledChunk, ...]:
        seated = self._seated()
        decodes = [r for r in seated if not r.in_prefill]
        prefills = [r for r in seated if r.in_prefill]
        budget = self.config.max_step_tokens - len(decodes)
        if self.config.max_prefill_tokens and (len(self.running) > 1 or self.waiting):
            budget = min(budget, self.config.max_prefill_tokens)
        shares = fair_shares([(r.tenant_id, len(r.pending_ids)) for r in prefills], budget)
        chunks = [ScheduledChunk(r, tuple(r.pending_ids), samples=True) for r in decodes]
        for request, share in zip(prefills, shares, strict=True):
            if share:
                take = tuple(request.pending_ids[:share])
                chunks.append(ScheduledChunk(request, take, samples=share == len(request.pending_ids)))
        if len(chunks) < len(self.running):
            self._rotation += len(chunks)  # those left out this step go first in the next
        return tuple(chunks)

    def _seated(self) -> list[Request]:
        """The requests that may feed ids this step: every running one when each can have a token
        and a batch seat, else as many as can from the rotating offset (`_rotated`)."""
        seats = min(self.config.max_step_tokens, self.config.max_batch_requests or len(self.running))
        return self._rotated()[:seats]

    def _rotated(self) -> list[Request]:
        """Running requests from a rotating offset, so that when a step cannot take them all (the
        token budget or `max_batch_requests`), they take turns instead of the last ones starving."""
        if not self.running:
            return []
        start = self._rotation % len(self.running)
        return self.running[start:] + self.running[:start]


def fair_shares(needs: Sequence[tuple[TenantId, int]], budget: int) -> list[int]:
    """Split `budget` tokens over requests given as `(tenant, tokens wanted)`, max-min fairly by
    tenant (water-filling): each tenant still wanting tokens gets an equal share, a share larger
    than a tenant wants goes round again to the others, and tokens too few to share go one each to
    the tenants wanting the fewest. Within a tenant, its requests take its tokens first come, first
    served (in `needs` order). Returns the tokens of each request, in `needs` order; they sum to at most `budget`."""
    wanted: dict[TenantId, int] = {}
    for tenant, need in needs:
        wanted[tenant] = wanted.get(tenant, 0) + need
    granted = dict.fromkeys(wanted, 0)
    while budget > 0 and (hungry := [t for t in wanted if granted[t] < wanted[t]]):
        each = max(1, budget // len(hungry))
        # Least wanted first: the odd tokens finish a short prefill rather than lengthen a long one.
        for tenant in sorted(hungry, key=lambda t: wanted[t] - granted[t]):
            give = min(each, wanted[tenant] - granted[tenant], budget)
            granted[tenant] += give
            budget -= give
    shares = []
    for tenant, need in needs:
        take = min(need, granted[tenant])
        granted[tenant] -= take
        shares.append(take)
    return shares


def _count(requests: Iterable[Request]) -> dict[TenantId, int]:
    counts: dict[TenantId, int] = {}
    for request in requests:
        counts[request.tenant_id] = counts.get(request.tenant_id, 0) + 1
    return counts
