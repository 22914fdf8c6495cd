"""`SessionOwnership`, one replica's side of the ownership leases, with two keepers on one real
database (a SQLite file): a turn waits for the owner's hand-over, and is refused with the owner's
URL when none comes; idle sessions are published then released; a lease lost to expiry drops the
local copies; a missing session is `SessionNotFound`. The keepers' rounds are driven by `tick()`
so nothing depends on thread timing except the bounded waits."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from app.http.api_errors import OWNER_URL_HEADER, response_for
from cache.tiers import CacheKey
from sessions.errors import ReplicaRetired, SessionBusy, SessionNotFound, SessionOwnedElsewhere
from sessions.replicas.ownership import SessionOwnership
from storage.database import open_database, upgrade
from storage.errors import StorageError
from storage.metadata_store import MetadataStore
from storage.replica_store import ReplicaIdInUse, ReplicaStore
from tests.storage.conftest import add_session

KEY = CacheKey("tn_a", "s_1")


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    url = f"sqlite:///{tmp_path / 'chatkv.db'}"
    engine = open_database(url)
    upgrade(url, engine)
    add_session(MetadataStore(engine), "tn_a", "s_1")
    yield engine
    engine.dispose()


class Replica:
    """A `SessionOwnership` with recorded publish / invalidate calls."""

    def __init__(self, engine: Engine, replica_id: str, *, start: bool = False, **timing: float) -> None:
        self.published: list[CacheKey] = []
        self.invalidated: list[CacheKey] = []
        self.publish_failures = 0
        self.publish_gate: threading.Event | None = None
        self.queued_turns = 0
        self.ownership = SessionOwnership(
            ReplicaStore(engine),
            replica_id=replica_id,
            url=f"http://{replica_id}:7860",
            lease_s=timing.get("lease_s", 30.0),
            wait_s=timing.get("wait_s", 0.3),
            idle_s=timing.get("idle_s", 60.0),
            publish=self.publish,
            invalidate=self.invalidated.append,
            cache_bytes=lambda: 1234,
            queued_turns=lambda: self.queued_turns,
            poll_s=0.02,
        )
        if start:  # with the keeper thread, as a server runs it
            self.ownership.start()
        else:  # registered; the tests drive the keeper's rounds with tick()
            self.ownership.store.register(
                replica_id=replica_id,
                incarnation=self.ownership.incarnation,
                url=f"http://{replica_id}:7860",
                hostname="h",
                pid=1,
                now_unix_s=time.time(),
                live_within_s=self.ownership.lease_s,
            )

    def publish(self, key: CacheKey) -> bool:
        if self.publish_gate is not None:  # a slow publish: until the test opens the gate
            assert self.publish_gate.wait(10)
        if self.publish_failures:
            self.publish_failures -= 1
            raise StorageError("the shared database went away")
        self.published.append(key)
        return True


def test_a_turn_on_another_replica_is_refused_with_the_owners_url_after_the_wait(engine: Engine) -> None:
    a, b = Replica(engine, "r_a"), Replica(engine, "r_b", wait_s=0.3)
    with a.ownership.hold(KEY):
        started = time.monotonic()
        with pytest.raises(SessionOwnedElsewhere) as refused, b.ownership.hold(KEY):
            pass
        assert time.monotonic() - started >= 0.3  # it waited the bounded time first
    assert (refused.value.owner_id, refused.value.owner_url) == ("r_a", "http://r_a:7860")
    assert "http://r_a:7860" in str(refused.value)
    assert isinstance(refused.value, SessionBusy)
    answer = response_for(refused.value)  # what the HTTP faces send
    assert answer.status_code == 409 and answer.headers[OWNER_URL_HEADER] == "http://r_a:7860"
    assert answer.headers["Retry-After"] == "1"
    assert json.loads(answer.body)["error"]["code"] == "session_owned_elsewhere"
    assert a.ownership.owns(KEY) and not b.ownership.owns(KEY)


def test_the_owner_hands_an_idle_session_over_to_a_waiting_replica(engine: Engine) -> None:
    a, b = Replica(engine, "r_a"), Replica(engine, "r_b", wait_s=5.0)
    with a.ownership.hold(KEY):
        pass
    stop = threading.Event()

    def keep_a() -> None:  # the owner's keeper, as its thread would run it
        while not stop.wait(0.02):
            a.ownership.tick()

    keeper = threading.Thread(target=keep_a)
    keeper.start()
    try:
        with b.ownership.hold(KEY) as token:
            assert token.replica_id == "r_b" and token.epoch == 2
    finally:
        stop.set()
        keeper.join()
    assert a.published == [KEY]  # the cache went to the shared tier before the lease was released
    assert not a.ownership.owns(KEY) and b.ownership.owns(KEY)
    assert b.invalidated == [KEY]  # another replica held it since: b's own copies are stale


def test_a_session_in_a_turn_is_not_handed_over(engine: Engine) -> None:
    a, b = Replica(engine, "r_a"), Replica(engine, "r_b", wait_s=0.3)
    refusals: list[BaseException] = []

    def ask_b() -> None:
        try:
            with b.ownership.hold(KEY):
                pass
        except SessionOwnedElsewhere as exc:
            refusals.append(exc)

    with a.ownership.hold(KEY):
        asking = threading.Thread(target=ask_b)
        asking.start()
        while asking.is_alive():  # b waits; a's keeper sees it wanted but busy
            a.ownership.tick()
            time.sleep(0.02)
        asking.join()
    assert len(refusals) == 1 and a.published == [] and a.ownership.owns(KEY)


def test_idle_sessions_are_published_then_released(engine: Engine) -> None:
    a = Replica(engine, "r_a", idle_s=0.05)
    with a.ownership.hold(KEY):
        pass
    time.sleep(0.1)
    a.ownership.tick()
    assert a.published == [KEY] and not a.ownership.owns(KEY)
    owner = a.ownership.store.owner(session_id="s_1")
    assert owner is None or owner.replica_id is None


def test_a_replica_marked_draining_hands_every_session_over_once_its_turn_ends(engine: Engine) -> None:
    add_session(MetadataStore(engine), "tn_a", "s_2")
    other = CacheKey("tn_a", "s_2")
    a = Replica(engine, "r_a")
    a.queued_turns = 3
    with a.ownership.hold(KEY):
        pass
    with a.ownership.hold(other):
        assert a.ownership.store.set_draining(replica_id="r_a")  # `chatkv replicas drain r_a`
        a.ownership.tick()  # the heartbeat reads the mark; the idle session goes at once
        assert a.ownership.draining
        assert a.published == [KEY] and not a.ownership.owns(KEY) and a.ownership.owns(other)
    a.ownership.tick()  # the turn ended: its session goes too, without waiting for idle_s
    assert a.published == [KEY, other] and not a.ownership.owns(other)
    (listed,) = a.ownership.store.list_replicas(now_unix_s=time.time())
    assert (listed.id, listed.draining, listed.queued_turns) == ("r_a", True, 3)


def test_a_lease_lost_to_expiry_drops_the_local_copies(engine: Engine) -> None:
    a, b = Replica(engine, "r_a", lease_s=0.5), Replica(engine, "r_b", wait_s=2.0, lease_s=0.5)
    with a.ownership.hold(KEY):
        pass
    a.invalidated.clear()
    # a stops renewing (a stalled or dead replica); b takes the session over after the lease.
    with b.ownership.hold(KEY) as token:
        assert token.epoch == 2
    a.ownership.tick()  # a's next renewal finds the lease gone
    assert not a.ownership.owns(KEY) and a.invalidated == [KEY]


def test_a_failed_hand_over_is_retried_not_wedged(engine: Engine) -> None:
    a = Replica(engine, "r_a", idle_s=0.05)
    a.publish_failures = 1
    with a.ownership.hold(KEY):
        pass
    time.sleep(0.1)
    a.ownership.tick()  # the publish raises: logged, and the session is still a's, not half-released
    assert a.published == [] and a.ownership.owns(KEY)
    with a.ownership.hold(KEY) as token:  # a's own turns go on meanwhile
        assert token.epoch == 1
    time.sleep(0.1)
    a.ownership.tick()
    assert a.published == [KEY] and not a.ownership.owns(KEY)


def test_a_turn_claiming_its_lease_while_the_keeper_hands_it_over_keeps_it(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = Replica(engine, "r_a", idle_s=0.05)
    with a.ownership.hold(KEY):
        pass
    time.sleep(0.1)  # idle: the next keeper round hands it over
    claimed, handed = threading.Event(), threading.Event()
    a.publish_gate = claimed  # the hand-over's publish is slow: it ends once the turn has claimed
    claim = a.ownership.store.try_acquire

    def claim_then_let_the_keeper_finish(**arguments: Any) -> Any:
        result = claim(**arguments)  # the database still shows a's lease: the same epoch comes back
        claimed.set()
        assert handed.wait(10)  # the keeper's release decision falls between the claim and its record
        return result

    monkeypatch.setattr(a.ownership.store, "try_acquire", claim_then_let_the_keeper_finish)
    keeper = threading.Thread(target=lambda: (a.ownership.tick(), handed.set()))
    keeper.start()
    while a.ownership.owns(KEY):  # until the keeper has marked it as leaving
        time.sleep(0.01)
    with a.ownership.hold(KEY) as token:
        keeper.join()
        owner = a.ownership.store.owner(session_id=KEY.name)
        # Not released under the turn: its commit fence would fail with SessionMoved.
        assert owner is not None and (owner.replica_id, owner.epoch) == ("r_a", token.epoch) == ("r_a", 1)
    assert a.ownership.owns(KEY) and a.published == [KEY]


def test_a_second_live_process_under_one_replica_id_is_refused(engine: Engine) -> None:
    first = Replica(engine, "r_a", start=True, lease_s=0.6)
    try:
        with first.ownership.hold(KEY):
            pass
        with pytest.raises(ReplicaIdInUse, match="in use by a live process"):
            Replica(engine, "r_a", start=True, lease_s=0.6)  # waits, sees the heartbeat move on
        assert first.ownership.owns(KEY)
    finally:
        first.ownership._stop.set()  # the first process dies: no clean shutdown, no release
        assert first.ownership._thread is not None
        first.ownership._thread.join()
    # A restart under the id waits until the dead process's heartbeat is a lease old, then takes
    # its leases back at a new epoch.
    restarted = Replica(engine, "r_a", start=True, lease_s=0.6)
    try:
        with restarted.ownership.hold(KEY) as token:
            assert (token.epoch, token.incarnation) == (2, restarted.ownership.incarnation)
    finally:
        restarted.ownership.close()


def test_a_process_replaced_under_its_id_runs_no_more_turns(engine: Engine) -> None:
    old = Replica(engine, "r_1", lease_s=1.0, idle_s=0.05)
    with old.ownership.hold(KEY):  # a turn: the old process has local copies of the session
        pass
    old.invalidated.clear()
    time.sleep(1.2)  # it stalls (SIGSTOP) past its lease; a new process registers under r_1
    new = Replica(engine, "r_1", lease_s=1.0, idle_s=0.05)
    with new.ownership.hold(KEY) as token:
        assert (token.epoch, token.incarnation) == (2, new.ownership.incarnation)
    # Its predecessor on the same home: the home's copies are current (a restart resumes warm).
    assert new.invalidated == []
    # The old process resumes: before its keeper even runs, a claim is refused...
    with pytest.raises(ReplicaRetired, match="replaced by another process"), old.ownership.hold(KEY):
        pass
    old.ownership.tick()  # ...and its keeper finds the id taken and drops what it held
    assert old.invalidated == [KEY] and not old.ownership.owns(KEY)
    with pytest.raises(ReplicaRetired), old.ownership.hold(CacheKey("tn_a", "s_other")):
        pass
    assert response_for(ReplicaRetired("gone")).status_code == 503


def test_a_missing_session_is_not_found(engine: Engine) -> None:
    a = Replica(engine, "r_a")
    with pytest.raises(SessionNotFound), a.ownership.hold(CacheKey("tn_a", "s_missing")):
        pass


@pytest.mark.parametrize(
    ("timing", "message"),
    [
        ({"lease_s": 0.0}, "lease_s must be > 0, got 0.0"),
        ({"idle_s": -1.0}, "idle_s must be > 0, got -1.0"),
        ({"wait_s": -1.0}, "wait_s must be >= 0, got -1.0"),
    ],
)
def test_bad_durations_are_refused(engine: Engine, timing: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        Replica(engine, "r_a", **timing)
