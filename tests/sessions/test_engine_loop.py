"""The engine loop with a model: batched turns equal solo turns, cancellation, deletion while waiting,
chunked prefill beside running decodes, budgets under concurrency."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from cache.tiers import Tier
from sessions.engine import Engine, Request, RequestResult, SchedulerConfig
from sessions.engine.batch import PackedBatch
from sessions.errors import ManagerClosed, SessionNotFound, TenantNotFound
from sessions.manager import SessionManager
from sessions.records import Reply
from sessions.sampling import SamplingParams
from tests.conftest import make_settings

PROMPTS = [
    "Where is my order 4411?",
    "Tell me about cats.",
    "What is two plus two?",
    "Write a haiku about rain.",
    "Name three colours.",
    "How do I reset my password?",
    "Translate hello to French.",
    "Why is the sky blue?",
]


def in_threads(count: int, work: Callable[[int], object]) -> list[object]:
    """Run `work(i)` for i < count in threads started together; return results (or raised errors)."""
    results: list[object] = [None] * count
    start = threading.Barrier(count)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = work(i)
        except Exception as exc:  # noqa: BLE001 - the test inspects what each thread raised
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return results


@pytest.fixture
def loop_manager(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SessionManager]:
    """A manager on the engine named by the test's parameter (`tiny_engine` or `real_engine`)."""
    engine = request.getfixturevalue(getattr(request, "param", "tiny_engine"))
    with SessionManager(make_settings(tmp_path / "home"), engine=engine) as manager:
        yield manager


def greedy_logits(engine: Engine, prompts: list[str], concurrent: bool) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Greedy replies with every sampled row's logits, each prompt in its own request."""
    requests = []
    for prompt in prompts:
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
        requests.append(
            Request(
                tenant_id=engine_tenant(len(requests)),
                prefill_ids=ids,
                params=SamplingParams(max_new_tokens=12),
                start=engine.empty_cache(None),
                stop_token_ids=engine.stop_token_ids,
                keep_logits=True,
            )
        )
    out = []
    if concurrent:
        for r in requests:
            engine.loop.submit(r)
        results = [r.result() for r in requests]
    else:
        results = [engine.loop.submit(r).result() for r in requests]
    for r, result in zip(requests, results, strict=True):
        assert isinstance(result, RequestResult) and r.sampled_logits is not None
        out.append((list(result.generated), r.sampled_logits))
    return out


def engine_tenant(i: int) -> str:
    return f"tn_test{i}"


@pytest.mark.parametrize("engine_name", ["tiny_engine", pytest.param("real_engine", marks=pytest.mark.real_model)])
def test_eight_requests_in_one_batch_give_their_solo_logits(engine_name: str, request: pytest.FixtureRequest) -> None:
    engine: Engine = request.getfixturevalue(engine_name)
    steps: list[int] = []
    forward = engine.runner.forward
    engine.runner.forward = lambda batch: (steps.append(len(batch.segments)), forward(batch))[1]  # type: ignore[method-assign]
    try:
        solo = greedy_logits(engine, PROMPTS, concurrent=False)
        solo_steps = list(steps)
        steps.clear()
        batched = greedy_logits(engine, PROMPTS, concurrent=True)
    finally:
        del engine.runner.forward  # back to the class's method
    assert max(solo_steps) == 1 and max(steps) == 8  # solo ran alone; the batch really was batched
    worst = 0.0
    for (solo_ids, solo_logits), (ids, logits) in zip(solo, batched, strict=True):
        assert ids == solo_ids
        for a, b in zip(solo_logits, logits, strict=True):
            worst = max(worst, float((a - b).abs().max()))
    print(f"\n{engine_name}: largest logit difference batched vs solo: {worst:.3g}")
    assert worst < 1e-3


@pytest.mark.parametrize(
    "loop_manager", ["tiny_engine", pytest.param("real_engine", marks=pytest.mark.real_model)], indirect=True
)
def test_eight_concurrent_sessions_reply_as_each_would_alone(loop_manager: SessionManager) -> None:
    manager = loop_manager
    tenants = [manager.create_tenant(f"t{i}") for i in range(4)]

    def session(i: int) -> tuple[object, str]:
        return tenants[i % 4], manager.open_session(tenants[i % 4], system_prompt="You are a helpful assistant.")

    def two_turns(tenant: object, sid: str, i: int) -> list[Reply]:
        return [manager.chat(tenant, sid, text, max_new_tokens=8) for text in (PROMPTS[i], "And then?")]  # type: ignore[arg-type]

    solo = [two_turns(*session(i), i) for i in range(8)]
    pairs = [session(i) for i in range(8)]
    batched = in_threads(8, lambda i: two_turns(*pairs[i], i))
    for i, (alone, together) in enumerate(zip(solo, batched, strict=True)):
        assert isinstance(together, list), together
        assert [r.token_ids for r in together] == [r.token_ids for r in alone], f"session {i}"
        assert together[1].stats.restored_from == "device" and together[1].stats.queue_s >= 0.0


def test_closing_a_stream_cancels_the_request_and_frees_its_kv(tiny_manager: SessionManager) -> None:
    manager = tiny_manager
    tenant = manager.create_tenant("acme")
    sid = manager.open_session(tenant)
    stream = manager.stream_chat(tenant, sid, "hello", max_new_tokens=200, temperature=1.0, seed=3)
    first = next(stream)
    assert isinstance(first, str)
    stream.close()
    manager.internals.engine.loop.submit(  # a request behind it runs once the cancelled one is dropped
        Request(tenant_id=tenant.id, prefill_ids=[1, 2], params=None, start=manager.internals.engine.empty_cache(None))
    ).result()
    stats = manager.internals.engine.loop.stats()
    assert sum(stats.running.values()) == 0 and sum(stats.waiting.values()) == 0
    assert manager.internals.tiers.usage().reserved_device_bytes == 0
    assert manager.history(tenant, sid) == []  # nothing stored
    reply = manager.chat(tenant, sid, "hello again", max_new_tokens=4)  # the session is free at once
    assert len(manager.history(tenant, sid)) == 2 and reply.stats.restored_from == "new"


def hold_the_loop(engine: Engine) -> tuple[threading.Event, threading.Event, Callable[[], None]]:
    """Make the next forward pass wait until released: (entered, release, undo)."""
    entered, release = threading.Event(), threading.Event()
    forward = engine.runner.forward

    def held(batch: PackedBatch) -> torch.Tensor:
        entered.set()
        release.wait(timeout=60)
        return forward(batch)

    engine.runner.forward = held  # type: ignore[method-assign]

    def undo() -> None:
        del engine.runner.forward

    return entered, release, undo


def test_a_waiting_request_whose_session_is_deleted_fails_with_session_not_found(
    tmp_path: Path, tiny_engine: Engine
) -> None:
    settings = make_settings(tmp_path / "home", max_running_requests=1)
    with SessionManager(settings, engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        running, waiting = manager.open_session(tenant), manager.open_session(tenant)
        entered, release, undo = hold_the_loop(tiny_engine)
        try:
            results: dict[str, object] = {}
            first = threading.Thread(
                target=lambda: results.update(a=manager.chat(tenant, running, "hi", max_new_tokens=4))
            )
            first.start()
            assert entered.wait(30)

            def second() -> None:
                try:
                    manager.chat(tenant, waiting, "hi", max_new_tokens=4)
                except SessionNotFound as exc:
                    results["b"] = exc

            thread = threading.Thread(target=second)
            thread.start()
            for _ in range(500):  # until the second turn is queued behind the first
                if sum(tiny_engine.loop.stats().waiting.values()):
                    break
                threading.Event().wait(0.01)
            manager.delete_session(tenant, waiting)
            release.set()
            first.join(30)
            thread.join(30)
        finally:
            release.set()
            undo()
        assert isinstance(results.get("b"), SessionNotFound)
        assert isinstance(results.get("a"), Reply) and len(manager.history(tenant, running)) == 2
        assert manager.internals.tiers.usage().reserved_device_bytes == 0
        tiny_engine.loop.configure(SchedulerConfig())


def test_a_tenant_deleted_mid_batch_fails_only_its_own_turns(tiny_manager: SessionManager) -> None:
    manager = tiny_manager
    doomed, kept = manager.create_tenant("doomed"), manager.create_tenant("kept")
    sessions = [(doomed, manager.open_session(doomed)) for _ in range(3)] + [
        (kept, manager.open_session(kept)) for _ in range(3)
    ]
    reference = manager.open_session(kept)
    want = manager.chat(kept, reference, "same words", max_new_tokens=24).token_ids
    entered, release, undo = hold_the_loop(manager.internals.engine)
    try:
        results: list[object] = [None] * 6

        def turn(i: int) -> None:
            tenant, sid = sessions[i]
            try:
                results[i] = manager.chat(tenant, sid, "same words", max_new_tokens=24)
            except (SessionNotFound, TenantNotFound) as exc:
                results[i] = exc

        threads = [threading.Thread(target=turn, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        assert entered.wait(30)
        release.set()
        undo()
        for _ in range(500):  # until all six decode together
            if sum(manager.internals.engine.loop.stats().running.values()) == 6:
                break
            threading.Event().wait(0.005)
        manager.delete_tenant(doomed)
        for t in threads:
            t.join(60)
    finally:
        release.set()
    assert all(isinstance(r, SessionNotFound | TenantNotFound) for r in results[:3]), results[:3]
    assert all(isinstance(r, Reply) and r.token_ids == want for r in results[3:]), results[3:]
    assert manager.internals.tiers.usage().reserved_device_bytes == 0


def test_a_long_prefill_shares_each_step_with_the_running_decode(tmp_path: Path, tiny_engine: Engine) -> None:
    settings = make_settings(tmp_path / "home", max_step_tokens=32)
    with SessionManager(settings, engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        short, long = manager.open_session(tenant), manager.open_session(tenant)
        steps: list[list[int]] = []
        forward = tiny_engine.runner.forward
        tiny_engine.runner.forward = lambda b: (steps.append([s.length for s in b.segments]), forward(b))[1]  # type: ignore[method-assign]
        try:
            stream = manager.stream_chat(tenant, short, "hi", max_new_tokens=60, temperature=1.0, seed=1)
            next(stream)  # decoding now
            steps.clear()
            reply = manager.chat(tenant, long, "word " * 150, max_new_tokens=2)
            rest = list(stream)
        finally:
            del tiny_engine.runner.forward
            tiny_engine.loop.configure(SchedulerConfig())
        assert reply.stats.prefill_tokens > 150 and isinstance(rest[-1], Reply)
        chunked = [s for s in steps if max(s) > 1]
        assert len(chunked) >= reply.stats.prefill_tokens // 32
        assert all(sum(s) <= 32 for s in steps)
        # While the short turn decodes, every step that carries a prefill chunk carries its token too.
        decoding = [s for s in chunked if len(s) == 2]
        assert decoding and all(s[0] == 1 for s in decoding)


def test_twenty_threads_over_four_tenants_with_small_budgets(tmp_path: Path, tiny_engine: Engine) -> None:
    per_token = tiny_engine.layout.bytes_per_token
    budget = 300 * per_token  # a few sessions' caches: turns must offload others and wait for room
    settings = make_settings(
        tmp_path / "home", device_budget_bytes=budget, host_budget_bytes=budget, tenant_device_quota_bytes=budget
    )
    with SessionManager(settings, engine=tiny_engine) as manager:
        tenants = [manager.create_tenant(f"t{i}") for i in range(4)]
        sids = [manager.open_session(tenants[i % 4]) for i in range(20)]
        want = {}
        for n in range(20):  # each first turn alone, in a session of its own, then deleted
            reference = manager.open_session(tenants[0])
            want[n] = manager.chat(tenants[0], reference, f"message {n}", max_new_tokens=8).token_ids
            manager.delete_session(tenants[0], reference)
        replies = in_threads(20, lambda i: manager.chat(tenants[i % 4], sids[i], f"message {i}", max_new_tokens=8))
        for i, reply in enumerate(replies):
            assert isinstance(reply, Reply), reply
            assert reply.token_ids == want[i], f"session {i} got another reply"  # no mixed replies
            history = manager.history(tenants[i % 4], sids[i])
            assert [m.text for m in history] == [f"message {i}", reply.text]  # nothing lost
        usage = manager.internals.tiers.usage()
        assert usage.bytes[Tier.DEVICE] <= budget and usage.bytes[Tier.HOST] <= budget
        assert usage.sessions[Tier.HOST] + usage.sessions[Tier.DISK] > 0  # the budget did force offloading
        assert usage.reserved_device_bytes == 0


def test_one_requests_bad_logits_fail_only_that_request(tiny_manager: SessionManager) -> None:
    manager, engine = tiny_manager, tiny_manager.internals.engine
    tenant = manager.create_tenant("acme")
    sids = [manager.open_session(tenant) for _ in range(4)]
    alone = attempt(manager, tenant, manager.open_session(tenant))
    assert isinstance(alone, Reply)
    want = alone.token_ids
    entered, release, undo = hold_the_loop(engine)
    forward = engine.runner.forward
    poisoned: list[int] = []

    def nan_once(batch: PackedBatch) -> torch.Tensor:
        logits = forward(batch)
        if not poisoned and len(batch.segments) == 4:
            poisoned.append(1)
            logits[0] = float("nan")  # the first request's row, as an fp16 overflow would leave it
        return logits

    try:
        results = [None] * 4
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, attempt(manager, tenant, sids[i])))
            for i in range(4)
        ]
        for t in threads:
            t.start()
        assert entered.wait(30)
        undo()
        engine.runner.forward = nan_once  # type: ignore[method-assign]
        release.set()
        for t in threads:
            t.join(60)
    finally:
        release.set()
        if "forward" in vars(engine.runner):
            del engine.runner.forward
    assert poisoned
    failed = [r for r in results if isinstance(r, RuntimeError)]
    assert len(failed) == 1, results
    assert [r.token_ids for r in results if isinstance(r, Reply)] == [want] * 3
    assert manager.internals.tiers.usage().reserved_device_bytes == 0


def attempt(manager: SessionManager, tenant: object, sid: str) -> object:
    try:
        return manager.chat(tenant, sid, "same", max_new_tokens=6, temperature=0.7, seed=1)  # type: ignore[arg-type]
    except RuntimeError as exc:
        return exc


def test_a_failed_eviction_at_admission_releases_its_reservation(tmp_path: Path, tiny_engine: Engine) -> None:
    budget = 60 * tiny_engine.layout.bytes_per_token
    settings = make_settings(tmp_path / "home", device_budget_bytes=budget, tenant_device_quota_bytes=budget)
    with SessionManager(settings, engine=tiny_engine) as manager:
        tenant = manager.create_tenant("acme")
        first, second = manager.open_session(tenant), manager.open_session(tenant)
        manager.chat(tenant, first, "hello there", max_new_tokens=8)  # idle on the device now
        evict = manager.internals.tiers._moves._evict_one_from_device

        def full_disk(tenant_id: object) -> int | None:
            raise OSError(28, "No space left on device")

        manager.internals.tiers._moves._evict_one_from_device = full_disk  # type: ignore[method-assign,assignment]
        try:
            with pytest.raises(OSError):
                manager.chat(tenant, second, "and you", max_new_tokens=30)
        finally:
            manager.internals.tiers._moves._evict_one_from_device = evict  # type: ignore[method-assign]
        assert manager.internals.tiers.usage().reserved_device_bytes == 0
        assert manager.history(tenant, second) == []
        reply = manager.chat(tenant, second, "and you", max_new_tokens=30)  # the loop still serves
        assert len(manager.history(tenant, second)) == 2 and reply.text is not None


def test_close_cancels_turns_in_flight_and_refuses_new_ones(tmp_path: Path, tiny_engine: Engine) -> None:
    manager = SessionManager(make_settings(tmp_path / "home"), engine=tiny_engine)
    tenant = manager.create_tenant("acme")
    sid = manager.open_session(tenant)
    stream = manager.stream_chat(tenant, sid, "hello", max_new_tokens=500, temperature=1.0, seed=2)
    next(stream)
    ended: list[BaseException] = []

    def read_on() -> None:  # the caller keeps reading, as a server's response does
        try:
            list(stream)
        except ManagerClosed as exc:
            ended.append(exc)

    reader = threading.Thread(target=read_on)
    reader.start()
    manager.close()  # returns once the cancelled turn let go of its session
    reader.join(timeout=60)
    assert len(ended) == 1 and not reader.is_alive()
    with pytest.raises(ManagerClosed):
        manager.chat(tenant, sid, "again")
    with pytest.raises(ManagerClosed):
        manager.open_session(tenant)
    with SessionManager(make_settings(tmp_path / "home"), engine=tiny_engine) as reopened:
        assert reopened.history(tenant.id, sid) == []  # the cancelled turn stored nothing
        assert reopened.chat(tenant.id, sid, "hello", max_new_tokens=4).stats.decode_tokens > 0


def test_min_new_tokens_and_ignore_eos_mask_the_stop_tokens_of_their_own_request_only(tiny_engine: Engine) -> None:
    """The tiny model's first greedy token, made a stop token, ends a reply at once; with
    `min_new_tokens=4` each of the first 4 tokens is the best other token (the stop token's logit
    masked), then decoding is plain greedy; with `ignore_eos` the reply runs to its limit. A
    request running beside them gets exactly its solo reply."""
    engine = tiny_engine
    prompt = engine.tokenizer.encode("Tell me about cats.", add_special_tokens=False)

    def request(stop: tuple[int, ...], **params: object) -> Request:
        return Request(
            tenant_id=engine_tenant(0),  # type: ignore[arg-type]
            prefill_ids=prompt,
            params=SamplingParams(max_new_tokens=8, **params),  # type: ignore[arg-type]
            start=engine.empty_cache(None),
            stop_token_ids=stop,
            keep_logits=True,
        )

    solo = engine.loop.submit(request(engine.stop_token_ids)).result().generated
    first = solo[0]
    assert engine.loop.submit(request((first,))).result().generated == (first,)
    masked, ignoring, beside = (
        request((first,), min_new_tokens=4),
        request((first,), ignore_eos=True),
        request(engine.stop_token_ids),
    )
    for r in (masked, ignoring, beside):
        engine.loop.submit(r)
    generated, ignored = masked.result().generated, ignoring.result().generated
    assert beside.result().generated == solo
    assert len(generated) >= 4 and first not in generated[:4]
    assert len(ignored) == 8 and first not in ignored
    assert masked.sampled_logits is not None
    for i, (logits, token) in enumerate(zip(masked.sampled_logits, generated, strict=True)):
        if i < 4:
            logits = logits.index_fill(0, torch.tensor([first]), float("-inf"))
        assert token == int(torch.argmax(logits))
