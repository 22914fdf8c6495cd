"""Where a turn runs among replicas (`sessions.replicas.routing`), decided from the leases and the
replicas' heartbeats in one real database (a SQLite file): forwarded to a live owner, handed over
from an owner that is silent, draining or over its queue limit, never forwarded twice, and sent
away from a replica that drains."""

from __future__ import annotations

import time

from sqlalchemy import Engine

from cache.tiers import CacheKey
from sessions.replicas.routing import Route, Router
from tests.sessions.test_ownership import KEY, Replica, engine  # noqa: F401  (fixture)


def router(replica: Replica, *, forward: bool = True, queue_limit: int = 2) -> Router:
    return Router(replica.ownership, forward=forward, queue_limit=queue_limit)


def beat(replica: Replica, *, ago_s: float = 0.0, queued_turns: int = 0) -> None:
    """A heartbeat of `replica` as of `ago_s` seconds ago, reporting `queued_turns`."""
    own = replica.ownership
    own.store.heartbeat(
        replica_id=own.replica_id,
        incarnation=own.incarnation,
        cache_bytes=0,
        now_unix_s=time.time() - ago_s,
        queued_turns=queued_turns,
    )


def test_a_turn_for_a_live_owners_session_is_forwarded_to_it_and_never_twice(engine: Engine) -> None:  # noqa: F811
    a, b = Replica(engine, "r_a"), Replica(engine, "r_b")
    with a.ownership.hold(KEY):
        pass
    assert router(b).route(KEY, forwarded=False) == Route("forward", "s_1", "http://r_a:7860", "r_a", "owner")
    # Another replica's forward is run here, whoever owns the session (its hold hands it over).
    assert router(b).route(KEY, forwarded=True) == Route("local", "s_1")
    assert router(b, forward=False).route(KEY, forwarded=False) == Route("local", "s_1")
    assert router(a).route(KEY, forwarded=False) == Route("local", "s_1")  # the owner itself
    assert router(b).route(None, forwarded=False) == Route("local")  # a new session
    assert router(b).route(CacheKey("tn_a", "s_free"), forwarded=False) == Route("local", "s_free")


def test_an_owner_that_is_silent_draining_or_over_its_queue_limit_is_handed_over_from(
    engine: Engine,  # noqa: F811
) -> None:
    a, b = Replica(engine, "r_a"), Replica(engine, "r_b")
    with a.ownership.hold(KEY):
        pass
    beat(a, queued_turns=3)  # over b's limit of 2
    assert router(b).route(KEY, forwarded=False) == Route("handover", "s_1", None, "r_a", "owner_busy")
    assert router(b, queue_limit=3).route(KEY, forwarded=False).kind == "forward"
    beat(a, ago_s=31)  # older than b's lease: a is presumed dead, its lease not yet expired
    assert router(b).route(KEY, forwarded=False) == Route("handover", "s_1", None, "r_a", "owner_gone")
    beat(a)
    a.ownership.drain()
    assert router(b).route(KEY, forwarded=False) == Route("handover", "s_1", None, "r_a", "owner_draining")


def test_a_draining_replica_sends_its_turns_to_the_least_busy_live_replica(engine: Engine) -> None:  # noqa: F811
    a, b, c = Replica(engine, "r_a"), Replica(engine, "r_b"), Replica(engine, "r_c")
    with a.ownership.hold(KEY):
        pass
    beat(b, queued_turns=1)
    a.ownership.drain()
    # Its own session and new ones alike: the other replica's hold then waits for a's hand-over.
    assert router(a).route(KEY, forwarded=False) == Route("forward", "s_1", "http://r_c:7860", "r_c", "draining")
    assert router(a).route(None, forwarded=False).url == "http://r_c:7860"
    assert router(a).route(KEY, forwarded=True) == Route("local", "s_1")  # forwarded here: run it
    for other in (b, c):
        other.ownership.drain()
    assert router(a).route(KEY, forwarded=False) == Route("local", "s_1")  # nowhere else to go
