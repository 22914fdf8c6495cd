"""Where a turn runs among replicas, decided before it starts (docs/replicas.md, "Routing").

A turn may reach any replica; its session may be owned by another. Rather than take the session
over (the owner publishes its cache to Redis and releases it, this replica restores it: a
**hand-over**), this replica may **forward** the request to the owner, which runs the turn on the
KV where it already is; the HTTP face streams the owner's answer back (`app.http.forwarding`).

    the session                              the owner (its last heartbeat)        route
    held here, nobody's, expired, new        -                                     local
    another replica's lease                  alive, not draining, queue <= limit   forward (its URL)
                                             silent, draining, over the limit,     handover
                                             or no URL
    this replica drains (a local route)      another live replica, not draining    forward (to it)
    the request was forwarded already        -                                     local (never
                                                                                   forwarded twice)

`Settings.routing = "handover"` routes every turn locally (the hold hands over). A `local` or
`handover` route runs here: the turn's hold (`SessionOwnership.hold`) waits for the owner to hand
the session over. A forward that fails before the owner received the request is handed over the
same way. The decision reads the database once per turn of a session not held here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from cache.tiers import CacheKey
from sessions.replicas.ownership import SessionOwnership
from storage.replica_store import OwnerRecord, ReplicaRecord

RouteKind = Literal["local", "forward", "handover"]


@dataclass(frozen=True)
class Route:
    """Where a turn runs (`SessionManager.plan_turn`'s `TurnPlan.route`; `route_turn`).

    Attributes:
        kind: `local` (here), `forward` (send the request to `url`), or `handover` (here, once the
            owner hands the session over).
        session_id: the session the turn runs on (for a posted history: the one it continues, or
            the parent it forks); `None` for a new session.
        url: where to forward (`forward` only): the owner's `CHATKV_REPLICA_URL`, or, while this
            replica drains, another live replica's.
        replica_id: the replica at `url`, or the owner a hand-over waits for.
        reason: why the turn does not simply run here: `owner` (forward to the owner), `draining`
            (this replica drains), `owner_gone`, `owner_draining`, `owner_busy`, `owner_no_url`.
    """

    kind: RouteKind
    session_id: str | None = None
    url: str | None = None
    replica_id: str | None = None
    reason: str = ""


class Router:
    """Chooses routes for one replica. Thread-safe (reads only).

    Args:
        ownership: this replica's leases (what it holds, whether it drains) and the registry.
        forward: `Settings.routing == "forward"`; off, every route is local.
        queue_limit: an owner reporting more queued turns than this is handed over from, not
            forwarded to.
    """

    def __init__(self, ownership: SessionOwnership, *, forward: bool, queue_limit: int) -> None:
        if queue_limit < 0:
            raise ValueError(f"queue_limit must be >= 0, got {queue_limit!r}")
        self._ownership = ownership
        self._forward = forward
        self._queue_limit = queue_limit

    def route(self, key: CacheKey | None, *, forwarded: bool) -> Route:
        """The route of a turn on the session `key` (`None`: a session not made yet).

        Args:
            forwarded: the request came from another replica (its hop marker): run it here.
        """
        session_id = key.name if key is not None else None
        if forwarded or not self._forward:
            return Route("local", session_id)
        own = self._ownership
        if key is not None and not own.owns(key):
            away = self._from_lease(own.store.owner(session_id=key.name), session_id)
            if away is not None:
                return away
        if own.draining:
            target = self._another_replica()
            if target is not None:
                return Route("forward", session_id, target.url, target.id, "draining")
        return Route("local", session_id)

    def _from_lease(self, lease: OwnerRecord | None, session_id: str | None) -> Route | None:
        """Forward to, or hand over from, the lease's live holder; `None` when the session is free
        (or this replica's own)."""
        now = time.time()
        own = self._ownership
        if lease is None or lease.replica_id in (None, own.replica_id) or lease.expires_unix_s < now:
            return None
        heartbeat = lease.owner_heartbeat_unix_s
        if heartbeat is None or now - heartbeat > own.lease_s:
            reason = "owner_gone"
        elif lease.owner_draining:
            reason = "owner_draining"
        elif lease.owner_queued_turns > self._queue_limit:
            reason = "owner_busy"
        elif not lease.owner_url:
            reason = "owner_no_url"  # an embedding process, not a server: nothing to forward to
        else:
            return Route("forward", session_id, lease.owner_url, lease.replica_id, "owner")
        return Route("handover", session_id, None, lease.replica_id, reason)

    def _another_replica(self) -> ReplicaRecord | None:
        """The live, not draining replica with a URL and the shortest queue (then the fewest
        sessions), other than this one; `None` if there is none."""
        own = self._ownership
        now = time.time()
        others = [
            r
            for r in own.store.list_replicas(now_unix_s=now)
            if r.id != own.replica_id and r.url and not r.draining and now - r.heartbeat_unix_s <= own.lease_s
        ]
        return min(others, key=lambda r: (r.queued_turns, r.sessions_owned), default=None)
