"""The scheduler without a model: admission order across tenants, limits, chunked prefill, KV room."""

from __future__ import annotations

import pytest

from cache.ids import TenantId
from cache.working_cache import WorkingCache
from sessions.engine.config import SchedulerConfig
from sessions.engine.request import Request
from sessions.engine.scheduler import Scheduler, TenantRoundRobin, fair_shares
from sessions.sampling import SamplingParams


def request(tenant: str, prefill: int = 4, kv_bytes: int = 0, accountant: object = None) -> Request:
    r = Request(
        tenant_id=TenantId(tenant),
        prefill_ids=list(range(prefill)),
        params=SamplingParams(max_new_tokens=8),
        working=WorkingCache([]),
        accountant=accountant,  # type: ignore[arg-type]
    )
    r.kv_bytes = kv_bytes
    return r


class Budget:
    """A KV accountant with a fixed number of bytes."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.forced = 0

    def reserve_device_bytes(self, nbytes: int, *, force: bool) -> bool:
        if nbytes <= self.free or force:
            self.forced += nbytes > self.free
            self.free -= nbytes
            return True
        return False

    def release_device_bytes(self, nbytes: int) -> None:
        self.free += nbytes


def test_a_tenant_with_twenty_waiting_turns_does_not_starve_another_tenants_single_turn() -> None:
    scheduler = Scheduler(SchedulerConfig(max_running_requests=2))
    busy = [request("busy") for _ in range(20)]
    for r in busy:
        scheduler.add(r)
    lone = request("lone")
    scheduler.add(lone)  # arrives last
    plan = scheduler.schedule()
    assert plan.admitted == (busy[0], lone)
    assert [c.request for c in plan.chunks] == [busy[0], lone]


def test_round_robin_starts_after_the_tenant_admitted_last() -> None:
    policy = TenantRoundRobin()
    a1, a2, b1, c1 = request("a"), request("a"), request("b"), request("c")
    assert policy.order([a1, a2, b1, c1]) == [a1, b1, c1, a2]
    policy.admitted(b1)
    assert policy.order([a1, a2, c1]) == [c1, a1, a2]


def test_per_tenant_limit_lets_other_tenants_in() -> None:
    scheduler = Scheduler(SchedulerConfig(max_running_requests=4, max_running_per_tenant=1))
    a = [request("a") for _ in range(3)]
    b = request("b")
    for r in (*a, b):
        scheduler.add(r)
    plan = scheduler.schedule()
    assert plan.admitted == (a[0], b)
    assert scheduler.waiting == [a[1], a[2]]


def test_a_long_prefill_is_chunked_and_decodes_go_first() -> None:
    scheduler = Scheduler(SchedulerConfig(max_step_tokens=64, max_prefill_tokens=0))
    decoding = request("a", prefill=1)
    scheduler.add(decoding)
    scheduler.schedule()
    decoding.generated.append(7)  # it sampled a token; the token is its only pending id now
    decoding.pending_ids[:] = [7]
    long = request("b", prefill=150)
    scheduler.add(long)
    sizes = []
    for _ in range(3):
        plan = scheduler.schedule()
        assert plan.chunks[0].request is decoding and plan.chunks[0].token_ids == (7,)
        chunk = plan.chunks[1]
        sizes.append(len(chunk.token_ids))
        assert chunk.samples == (len(chunk.token_ids) == len(long.pending_ids))
        del long.pending_ids[: len(chunk.token_ids)]
        assert plan.num_tokens <= 64
    assert sizes == [63, 63, 24]


def decoding(tenant: str) -> Request:
    """A running request that has sampled a token: its one pending id is that token."""
    r = request(tenant, prefill=1)
    r.generated.append(7)
    r.pending_ids[:] = [7]
    return r


def feed(scheduler: Scheduler) -> list[tuple[str, int, bool]]:
    """One step: (tenant, ids fed, samples) per chunk, the fed ids taken off each request as the loop
    would (a decode stays a decode)."""
    fed = []
    for chunk in scheduler.schedule().chunks:
        fed.append((str(chunk.request.tenant_id), len(chunk.token_ids), chunk.samples))
        if chunk.request.in_prefill:
            del chunk.request.pending_ids[: len(chunk.token_ids)]
            if not chunk.request.pending_ids:
                chunk.request.generated.append(7)
                chunk.request.pending_ids[:] = [7]
    return fed


def test_fair_shares_split_the_budget_equally_by_tenant_and_pass_on_what_a_tenant_does_not_need() -> None:
    a, b, c = TenantId("a"), TenantId("b"), TenantId("c")
    assert fair_shares([(a, 6000), (b, 14)], 32) == [18, 14]
    assert fair_shares([(a, 6000), (a, 6000), (b, 6000)], 32) == [16, 0, 16]  # by tenant, not request
    assert fair_shares([(a, 3), (a, 5), (b, 100)], 32) == [3, 5, 24]
    assert fair_shares([(a, 100), (b, 100), (c, 100)], 32) == [11, 11, 10]
    assert fair_shares([(a, 100), (b, 100), (c, 100)], 2) == [1, 1, 0]
    assert fair_shares([(a, 100), (b, 100), (c, 50)], 2) == [1, 0, 1]  # odd ids: the least wanting first
    assert fair_shares([(a, 4), (b, 5)], 256) == [4, 5]
    assert fair_shares([], 32) == []


def test_a_long_prefill_alone_takes_full_steps_and_shares_small_chunks_once_a_prompt_arrives() -> None:
    scheduler = Scheduler(SchedulerConfig(max_step_tokens=256, max_prefill_tokens=32))
    long = request("long", prefill=6000)
    scheduler.add(long)
    assert feed(scheduler) == [("long", 256, False)]  # alone: a small step would cost a weight read
    scheduler.add(request("short", prefill=14))  # waiting: the cap applies from the next step
    assert feed(scheduler) == [("long", 18, False), ("short", 14, True)]
    assert feed(scheduler) == [("short", 1, True), ("long", 32, False)]  # decodes go first, beside the share


def test_four_long_prefills_leave_another_tenants_short_prefill_an_equal_share_of_each_step() -> None:
    scheduler = Scheduler(SchedulerConfig(max_step_tokens=256, max_prefill_tokens=32))
    for i in range(4):
        scheduler.add(request(f"long{i}", prefill=6000))
    scheduler.schedule()  # all four admitted
    scheduler.add(request("short", prefill=14))
    # Equal shares of 6, the 2 odd ids to the least wanting: the short prefill, then the first long.
    assert feed(scheduler) == [
        ("long0", 7, False),
        ("long1", 6, False),
        ("long2", 6, False),
        ("long3", 6, False),
        ("short", 7, False),
    ]
    assert feed(scheduler) == [
        ("long0", 7, False),
        ("long1", 6, False),
        ("long2", 6, False),
        ("long3", 6, False),
        ("short", 7, True),
    ]


def test_a_tenant_with_four_long_prefills_gets_the_share_of_one_tenant() -> None:
    scheduler = Scheduler(SchedulerConfig(max_step_tokens=256, max_prefill_tokens=32))
    for _ in range(4):
        scheduler.add(request("greedy", prefill=6000))
    scheduler.add(request("other", prefill=100))
    fed: dict[str, int] = {}
    for _ in range(3):
        for tenant, n, _ in feed(scheduler):
            fed[tenant] = fed.get(tenant, 0) + n
    assert fed == {"greedy": 48, "other": 48}


def test_decodes_are_never_held_back_by_the_prefill_share() -> None:
    scheduler = Scheduler(SchedulerConfig(max_step_tokens=256, max_prefill_tokens=4))
    running = [decoding(f"d{i}") for i in range(10)]
    for r in running:
        scheduler.add(r)
    scheduler.add(request("long", prefill=6000))
    fed = feed(scheduler)
    assert [n for t, n, _ in fed if t != "long"] == [1] * 10
    assert ("long", 4, False) in fed


def test_batching_off_runs_one_request_per_step_in_turn() -> None:
    scheduler = Scheduler(SchedulerConfig(max_batch_requests=1))
    a, b, c = request("a", 1), request("b", 1), request("c", 1)
    for r in (a, b, c):
        scheduler.add(r)
    order = [scheduler.schedule().chunks[0].request for _ in range(6)]
    assert order == [a, b, c, a, b, c]


def test_requests_wait_for_kv_room_in_order_and_one_runs_alone_whatever_its_size() -> None:
    budget = Budget(free=100)
    scheduler = Scheduler(SchedulerConfig())
    big = request("a", kv_bytes=150, accountant=budget)
    small = request("b", kv_bytes=10, accountant=budget)
    scheduler.add(big)
    scheduler.add(small)
    plan = scheduler.schedule()
    assert plan.admitted == (big,) and budget.forced == 1  # nothing ran: admitted alone
    plan = scheduler.schedule()
    assert plan.admitted == () and scheduler.waiting == [small]  # no room beside it: waits
    scheduler.remove(big)
    budget.release_device_bytes(big.reserved_bytes)
    assert scheduler.schedule().admitted == (small,)


def test_cancelled_requests_are_dropped_before_the_step() -> None:
    scheduler = Scheduler(SchedulerConfig())
    a, b = request("a"), request("b")
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    a.cancel()
    plan = scheduler.schedule()
    assert plan.dropped == (a,) and [c.request for c in plan.chunks] == [b]


@pytest.mark.parametrize(
    "field, value",
    [("max_step_tokens", 0), ("max_running_requests", 0), ("max_running_per_tenant", -1), ("max_batch_requests", 1.5)],
)
def test_bad_limits_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})  # type: ignore[arg-type]


def test_decodes_beyond_the_token_budget_take_turns_and_a_prefill_gets_its_chunks() -> None:
    scheduler = Scheduler(SchedulerConfig(max_step_tokens=4))
    decoding = [request(f"t{i}", prefill=1) for i in range(6)]
    prefill = request("p", prefill=50)
    for r in (*decoding, prefill):
        scheduler.add(r)
    fed: dict[int, int] = {}
    for _ in range(8):
        for chunk in scheduler.schedule().chunks:
            fed[chunk.request.id] = fed.get(chunk.request.id, 0) + len(chunk.token_ids)
            if chunk.request is not prefill:  # a decode stays a decode: one pending token again
                chunk.request.generated.append(1)
            else:
                del prefill.pending_ids[: len(chunk.token_ids)]
    assert all(fed.get(r.id, 0) >= 4 for r in decoding)  # 8 steps x 4 tokens over 7 requests
    assert fed.get(prefill.id, 0) >= 4


class Failing(Budget):
    def reserve_device_bytes(self, nbytes: int, *, force: bool) -> bool:
        raise OSError(28, "No space left on device")


def test_a_request_whose_admission_raises_fails_alone() -> None:
    scheduler = Scheduler(SchedulerConfig())
    ok = request("a", kv_bytes=10, accountant=Budget(100))
    broken = request("b", kv_bytes=10, accountant=Failing(100))
    later = request("c", kv_bytes=10, accountant=Budget(100))
    for r in (ok, broken, later):
        scheduler.add(r)
    plan = scheduler.schedule()
    assert plan.admitted == (ok, later)
    assert [(r, type(e)) for r, e in plan.failed] == [(broken, OSError)]
    assert scheduler.schedule().failed == ()
