"""Replica registry and ownership leases on SQLite and PostgreSQL: one owner at a time, take-over
only after expiry, a waiting replica is recorded, a commit is fenced by the lease's epoch, and a
second process under one replica id (a restart, or a duplicate) never shares the first's leases."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import pytest
from sqlalchemy import Engine

from storage.metadata_store import MetadataStore
from storage.replica_store import (
    Claim,
    IncarnationReplaced,
    OwnershipLost,
    OwnerToken,
    ReplicaRecord,
    ReplicaStore,
    SessionGone,
)
from tests.storage.conftest import add_session

T = TypeVar("T")

LEASE_S = 10.0
T0 = 1_000_000.0


@pytest.fixture
def replicas(db_engine: Engine, metadata: MetadataStore) -> ReplicaStore:
    add_session(metadata, "tn_a", "s_1")
    store = ReplicaStore(db_engine)
    register(store, "r_a", T0)
    register(store, "r_b", T0)
    return store


def incarnation(replica: str) -> str:
    return f"{replica}-1"


def token(replica: str, epoch: int) -> OwnerToken:
    return OwnerToken(replica, epoch, incarnation(replica))


def took(epoch: int, previous: str = "r_a") -> Claim:
    """A claim that took the lease at `epoch` from `previous`."""
    return Claim(acquired=True, epoch=epoch, previous_owner=previous)


def register(store: ReplicaStore, replica: str, now: float, incarnation_: str | None = None) -> ReplicaRecord | None:
    return store.register(
        replica_id=replica,
        incarnation=incarnation_ or incarnation(replica),
        url=f"http://{replica[-1]}:7860",
        hostname=replica[-1],
        pid=1,
        now_unix_s=now,
        live_within_s=LEASE_S,
    )


def acquire(
    store: ReplicaStore, replica: str, now: float, session: str = "s_1", incarnation_: str | None = None
) -> Claim:
    return store.try_acquire(
        tenant_id="tn_a",
        session_id=session,
        replica_id=replica,
        incarnation=incarnation_ or incarnation(replica),
        lease_s=LEASE_S,
        now_unix_s=now,
    )


def commit(metadata: MetadataStore, owner: OwnerToken) -> None:
    """Store one turn of session s_1 under `owner`'s lease (`OwnershipLost` if it no longer holds it)."""
    metadata.record_turn(
        tenant_id="tn_a",
        session_id="s_1",
        messages=[("user", "hi", [1]), ("assistant", "yo", [2])],
        token_count=2,
        model_fingerprint="fp-a",
        ttft_s=None,
        owner=owner,
    )


def test_first_claim_takes_the_lease_and_another_replica_waits(replicas: ReplicaStore) -> None:
    assert acquire(replicas, "r_a", T0) == Claim(acquired=True, epoch=1, previous_owner=None)
    blocked = acquire(replicas, "r_b", T0 + 1)
    assert blocked == Claim(acquired=False, owner_id="r_a", owner_url="http://a:7860", expires_unix_s=T0 + LEASE_S)
    owner = replicas.owner(session_id="s_1")
    assert owner is not None and (owner.replica_id, owner.wanted_by, owner.epoch) == ("r_a", "r_b", 1)
    # The owner asking again keeps its epoch (a turn in flight stays valid) and clears nothing else.
    assert acquire(replicas, "r_a", T0 + 2) == took(1)


def test_release_hands_over_with_a_new_epoch_and_names_the_previous_owner(replicas: ReplicaStore) -> None:
    acquire(replicas, "r_a", T0)
    assert replicas.release(session_id="s_1", token=token("r_a", 1))
    assert not replicas.release(session_id="s_1", token=token("r_a", 1))  # not held any more
    assert acquire(replicas, "r_b", T0 + 1) == took(2)
    assert acquire(replicas, "r_a", T0 + 2).owner_id == "r_b"


def test_an_expired_lease_is_taken_over_and_fences_the_old_owners_commit(
    replicas: ReplicaStore, metadata: MetadataStore
) -> None:
    acquire(replicas, "r_a", T0)
    assert not acquire(replicas, "r_b", T0 + LEASE_S - 0.5).acquired
    assert acquire(replicas, "r_b", T0 + LEASE_S + 0.5) == took(2)
    with pytest.raises(OwnershipLost):
        commit(metadata, token("r_a", 1))
    assert metadata.messages(tenant_id="tn_a", session_id="s_1") == []
    commit(metadata, token("r_b", 2))
    assert [m.text for m in metadata.messages(tenant_id="tn_a", session_id="s_1") or []] == ["hi", "yo"]


def test_renew_extends_held_leases_and_reports_waiters_and_losses(
    replicas: ReplicaStore, metadata: MetadataStore
) -> None:
    add_session(metadata, "tn_a", "s_2")
    acquire(replicas, "r_a", T0)
    acquire(replicas, "r_a", T0, session="s_2")
    acquire(replicas, "r_b", T0 + 1)  # waits for s_1
    held = replicas.renew(replica_id="r_a", incarnation="r_a-1", lease_s=LEASE_S, now_unix_s=T0 + 5)
    assert {k: (v.epoch, v.wanted_by) for k, v in held.items()} == {"s_1": (1, "r_b"), "s_2": (1, None)}
    assert not acquire(replicas, "r_b", T0 + LEASE_S + 1).acquired  # renewed to T0 + 15
    assert acquire(replicas, "r_b", T0 + 16).acquired
    assert set(replicas.renew(replica_id="r_a", incarnation="r_a-1", lease_s=LEASE_S, now_unix_s=T0 + 17)) == {"s_2"}


def test_registry_lists_replicas_with_sessions_owned_and_unregister_frees_leases(replicas: ReplicaStore) -> None:
    acquire(replicas, "r_a", T0)
    assert replicas.heartbeat(replica_id="r_a", incarnation="r_a-1", cache_bytes=1234, now_unix_s=T0 + 3) == "ok"
    listed = {r.id: r for r in replicas.list_replicas(now_unix_s=T0 + 4)}
    assert (listed["r_a"].sessions_owned, listed["r_a"].cache_bytes, listed["r_b"].sessions_owned) == (1, 1234, 0)
    assert [r.id for r in replicas.list_replicas(now_unix_s=T0 + 4)] == ["r_a", "r_b"]  # latest heartbeat first
    replicas.unregister(replica_id="r_a", incarnation="r_a-1")
    assert replicas.heartbeat(replica_id="r_a", incarnation="r_a-1", cache_bytes=0, now_unix_s=T0 + 5) == "missing"
    assert acquire(replicas, "r_b", T0 + 5) == took(2)


def test_heartbeats_carry_the_queue_and_a_drain_mark_until_a_new_process_takes_the_id(replicas: ReplicaStore) -> None:
    acquire(replicas, "r_a", T0)
    beat = partial(replicas.heartbeat, replica_id="r_a", incarnation="r_a-1", cache_bytes=0)
    assert beat(now_unix_s=T0 + 1, queued_turns=7) == "ok"
    owner = replicas.owner(session_id="s_1")
    assert owner is not None
    assert (owner.owner_heartbeat_unix_s, owner.owner_queued_turns, owner.owner_draining) == (T0 + 1, 7, False)
    assert replicas.set_draining(replica_id="r_a") and not replicas.set_draining(replica_id="r_nope")
    assert beat(now_unix_s=T0 + 2) == "draining"
    owner = replicas.owner(session_id="s_1")
    assert owner is not None and (owner.owner_queued_turns, owner.owner_draining) == (0, True)
    listed = {r.id: (r.draining, r.queued_turns) for r in replicas.list_replicas(now_unix_s=T0 + 3)}
    assert listed == {"r_a": (True, 0), "r_b": (False, 0)}
    register(replicas, "r_a", T0 + 2 + LEASE_S + 1, incarnation_="r_a-2")  # a restart: not draining
    assert replicas.heartbeat(replica_id="r_a", incarnation="r_a-2", cache_bytes=0, now_unix_s=T0 + 14) == "ok"


def test_a_missing_or_other_tenants_session_cannot_be_claimed(replicas: ReplicaStore, metadata: MetadataStore) -> None:
    add_session(metadata, "tn_b", "s_b")
    with pytest.raises(SessionGone):
        acquire(replicas, "r_a", T0, session="s_nope")
    with pytest.raises(SessionGone):
        acquire(replicas, "r_a", T0, session="s_b")  # tn_b's session, claimed as tn_a's
    metadata.delete_session(tenant_id="tn_a", session_id="s_1")
    with pytest.raises(SessionGone):
        acquire(replicas, "r_a", T0)


def at_once(calls: dict[str, Callable[[], T]]) -> dict[str, T]:
    """Every call of `calls` started at the same instant, each on its own thread; their results by name."""
    results: dict[str, T] = {}
    barrier = threading.Barrier(len(calls))

    def run(name: str) -> None:
        barrier.wait()
        results[name] = calls[name]()

    threads = [threading.Thread(target=run, args=(name,)) for name in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def race(store: ReplicaStore, names: list[str], session: str) -> dict[str, Claim]:
    """Every replica in `names` claims `session` at once; their claims by name."""
    return at_once({n: partial(acquire, store, n, T0, session=session) for n in names})


def test_racing_replicas_never_both_take_a_free_session(replicas: ReplicaStore, metadata: MetadataStore) -> None:
    names = [f"r_{i}" for i in range(6)]
    for round_ in range(4):
        add_session(metadata, "tn_a", f"s_race{round_}")
        results = race(replicas, names, f"s_race{round_}")
        winners = [n for n, c in results.items() if c.acquired]
        assert len(winners) == 1, results
        assert {c.owner_id for c in results.values() if not c.acquired} == set(winners)


def test_a_restart_under_the_same_id_waits_for_the_old_heartbeat_then_frees_its_leases(
    replicas: ReplicaStore, metadata: MetadataStore
) -> None:
    acquire(replicas, "r_a", T0)
    # A new process under r_a while the old one's heartbeat is fresh: nothing is written.
    fresh = register(replicas, "r_a", T0 + 1, incarnation_="r_a-2")
    assert fresh is not None and fresh.heartbeat_unix_s == T0
    # Unregistered, it cannot take the old process's lease, nor any other.
    with pytest.raises(IncarnationReplaced):
        acquire(replicas, "r_a", T0 + 1, incarnation_="r_a-2")
    # Once that heartbeat is lease_s old, the new process takes the id and the old leases are freed.
    assert register(replicas, "r_a", T0 + LEASE_S + 1, incarnation_="r_a-2") is None
    owner = replicas.owner(session_id="s_1")
    assert owner is not None and owner.replica_id is None
    # The old process, if it only stalled, renews nothing, is told so, and cannot commit.
    assert replicas.renew(replica_id="r_a", incarnation="r_a-1", lease_s=LEASE_S, now_unix_s=T0 + 12) == {}
    assert replicas.heartbeat(replica_id="r_a", incarnation="r_a-1", cache_bytes=0, now_unix_s=T0 + 12) == "taken"
    with pytest.raises(IncarnationReplaced):  # nor take any lease any more
        acquire(replicas, "r_a", T0 + 12)
    assert acquire(replicas, "r_a", T0 + 12, incarnation_="r_a-2") == took(2)
    with pytest.raises(OwnershipLost):
        commit(metadata, token("r_a", 1))
    # A clean shutdown of the stalled process leaves the new one's row and lease alone.
    replicas.unregister(replica_id="r_a", incarnation="r_a-1")
    assert replicas.heartbeat(replica_id="r_a", incarnation="r_a-2", cache_bytes=0, now_unix_s=T0 + 13) == "ok"
    assert set(replicas.renew(replica_id="r_a", incarnation="r_a-2", lease_s=LEASE_S, now_unix_s=T0 + 13)) == {"s_1"}


def register_at_once(store: ReplicaStore, replica: str, incarnations: list[str]) -> dict[str, ReplicaRecord | None]:
    """Every incarnation registers `replica` at the same instant; what each got back."""
    return at_once({i: partial(register, store, replica, T0, incarnation_=i) for i in incarnations})


def test_two_processes_registering_a_new_id_at_once_get_one_row_and_one_refusal(replicas: ReplicaStore) -> None:
    for round_ in range(5):
        replica = f"r_new{round_}"
        results = register_at_once(replicas, replica, [f"{replica}-1", f"{replica}-2"])
        # A thread that raised (the duplicate INSERT) would be missing from the results.
        assert len(results) == 2, results
        winners = [i for i, refused in results.items() if refused is None]
        assert len(winners) == 1, results
        loser = next(r for r in results.values() if r is not None)
        assert loser.id == replica
