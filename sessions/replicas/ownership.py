"""One owner per session across replicas: this replica's side of the ownership leases.

Replicas share one database (PostgreSQL) and a shared KV tier (Redis). A turn runs only on the
replica holding the session's lease (`storage/replica_store.py`); `SessionOwnership.hold` takes
it for the turn, waiting a bounded time for another owner to hand it over. A background thread,
the keeper, does the rest:

    every `lease_s / 3`   heartbeat in `replicas`; renew this replica's leases; a lease that is
                          gone (expired and taken over, or its session deleted) is forgotten
                          locally, with its local cache copies (they are stale now)
    every `poll_s`        hand over the idle sessions another replica waits for, and those idle
                          for `idle_s`: publish the cache to the shared tier, then release

A draining replica (`drain()`, or the drain mark an operator set in its `replicas` row, read with
each heartbeat) hands over every session as soon as no turn uses it, and its heartbeat tells the
others so (they hand sessions over rather than forward turns to it: `sessions.replicas.routing`).

A replica taking a session that another replica held since it last did drops its own local
copies first (`invalidate`): the shared tier, or the transcript, has the newer state. A turn's
commit is fenced by the lease's epoch (`MetadataStore.record_turn(owner=...)`), so a replica that
lost its lease mid-turn (stalled past `lease_s`) cannot store the turn: no two replicas ever both
store turns of one session. Expiry compares Unix times of different machines: run NTP.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy.exc import InterfaceError, OperationalError

from cache.tiers import CacheKey
from sessions.errors import ReplicaRetired, SessionNotFound, SessionOwnedElsewhere
from storage.errors import StorageError
from storage.replica_store import (
    Claim,
    IncarnationReplaced,
    OwnerToken,
    ReplicaIdInUse,
    ReplicaRecord,
    ReplicaStore,
    SessionGone,
)

log = logging.getLogger(__name__)

RENEW_MARGIN = 0.5
"""Share of `lease_s` that must be left on a held lease for a turn to start without asking the
database again (the keeper renews every third of it, so this holds unless renewals fail)."""


@dataclass
class _Held:
    token: OwnerToken
    expires_monotonic: float
    last_used_monotonic: float
    in_use: int = 0
    releasing: bool = False


class SessionOwnership:
    """The leases this replica holds, and the keeper thread. Thread-safe.

    Args:
        store: the replica registry and leases (shared database).
        replica_id, url: this replica's id and the URL it serves at (shown to a client that is
            refused with `SessionOwnedElsewhere`, and by `chatkv replicas`).
        lease_s: lease length in seconds; a dead replica's sessions are taken over this long
            after its last renewal.
        wait_s: how long `hold` waits for another replica to hand a session over.
        idle_s: a session idle this long is published to the shared tier and released.
        poll_s: how often the keeper looks for sessions other replicas wait for, and how often a
            waiting `hold` asks again.
        publish: puts a session's current cache into the shared tier (before a hand-over).
        invalidate: drops this replica's local copies of a session (another replica moved it on).
        cache_bytes: bytes of KV cache this replica holds (reported with each heartbeat).
        queued_turns: turns waiting in this replica's engine queue (reported with each heartbeat).

    Raises:
        ValueError: for non-positive durations.
    """

    def __init__(
        self,
        store: ReplicaStore,
        *,
        replica_id: str,
        url: str,
        lease_s: float,
        wait_s: float,
        idle_s: float,
        publish: Callable[[CacheKey], bool],
        invalidate: Callable[[CacheKey], None],
        cache_bytes: Callable[[], int],
        queued_turns: Callable[[], int] = lambda: 0,
        poll_s: float = 0.1,
    ) -> None:
        for name, value in (("lease_s", lease_s), ("idle_s", idle_s), ("poll_s", poll_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s!r}")
        self.store = store
        self.replica_id, self.url = replica_id, url
        self.lease_s, self.wait_s, self.idle_s, self.poll_s = lease_s, wait_s, idle_s, poll_s
        self._publish, self._invalidate, self._cache_bytes = publish, invalidate, cache_bytes
        self._queued_turns = queued_turns
        self._draining = False
        self.incarnation = secrets.token_hex(8)
        """Random per process (and per instance): the leases it takes carry it."""
        self._retired = False
        self._held: dict[CacheKey, _Held] = {}
        self._acquiring: Counter[CacheKey] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_renew = 0.0

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Register this replica and start the keeper.

        If another process heartbeats under the same replica id, wait until its heartbeat is
        `lease_s` old (a process restarted after a crash: the old one's row is still fresh), then
        take the id over and release the leases the old process held.

        Raises:
            ReplicaIdInUse: the other process's heartbeat moved on while this one waited (it is
                alive: two processes were given one replica id).
        """
        first_seen: float | None = None
        while True:
            other = self._register()
            if other is None:
                break
            if first_seen is None:
                first_seen = other.heartbeat_unix_s
                log.warning(
                    "replica id %s was in use by pid %d on %s %.1f s ago; waiting until its heartbeat is %.0f s old",
                    self.replica_id,
                    other.pid,
                    other.hostname,
                    time.time() - other.heartbeat_unix_s,
                    self.lease_s,
                )
            elif other.heartbeat_unix_s != first_seen:
                raise ReplicaIdInUse(
                    f"replica id {self.replica_id} is in use by a live process (pid {other.pid} on "
                    f"{other.hostname}); give every process its own CHATKV_REPLICA_ID"
                )
            time.sleep(min(1.0, self.lease_s / 3))
        self._thread = threading.Thread(target=self._keep, name="chatkv-ownership", daemon=True)
        self._thread.start()

    def set_url(self, url: str) -> None:
        """The URL this replica serves at, once the server knows it."""
        self.url = url
        self._register()

    def _register(self) -> ReplicaRecord | None:
        return self.store.register(
            replica_id=self.replica_id,
            incarnation=self.incarnation,
            url=self.url,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            now_unix_s=time.time(),
            live_within_s=self.lease_s,
        )

    @property
    def draining(self) -> bool:
        """Whether this replica hands its sessions over (`drain`, or an operator's drain mark)."""
        return self._draining

    def drain(self) -> None:
        """Start draining: mark this replica as draining in the registry (other replicas then hand
        its sessions over instead of forwarding turns to it) and hand every session over as soon as
        no turn uses it (the keeper's next rounds). Turns in flight finish and are stored."""
        self._start_draining("asked to stop")
        self.store.set_draining(replica_id=self.replica_id)

    def _start_draining(self, why: str) -> None:
        if not self._draining:
            self._draining = True
            log.info("replica %s drains (%s): its sessions are handed over as their turns end", self.replica_id, why)

    def close(self) -> None:
        """Stop the keeper, publish every held session's cache and give the leases up, and
        unregister (a clean shutdown: other replicas take the sessions over at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            held = [(key, h) for key, h in self._held.items() if not h.in_use]
        for key, h in held:
            self._hand_over(key, h, to_another=False)
        self.store.unregister(replica_id=self.replica_id, incarnation=self.incarnation)

    # -- turns ---------------------------------------------------------------------------------

    @contextmanager
    def hold(self, key: CacheKey) -> Iterator[OwnerToken]:
        """Hold the session's lease while the `with` block runs (a turn): the keeper neither
        hands it over nor releases it meanwhile. Yields the token to commit the turn with.

        Raises:
            SessionNotFound: if the session does not exist for this tenant.
            SessionOwnedElsewhere: if another live replica keeps it past `wait_s`.
            ReplicaRetired: if another process took this replica's id over (this one stalled).
        """
        token = self._acquire(key)
        try:
            yield token
        finally:
            with self._lock:
                held = self._held.get(key)
                if held is not None and held.token == token:
                    held.in_use -= 1
                    held.last_used_monotonic = time.monotonic()

    def _acquire(self, key: CacheKey) -> OwnerToken:
        if self._retired:
            raise self._retired_error()
        with self._lock:
            held = self._held.get(key)
            if (
                held is not None
                and not held.releasing
                and held.expires_monotonic - time.monotonic() > RENEW_MARGIN * self.lease_s
            ):
                held.in_use += 1
                return held.token
            # Until the lease is recorded in `_held`, the keeper must not release a lease of this
            # session that the database still shows as this process's: the claim below would
            # return that lease, and the turn would then fail its commit fence for nothing.
            self._acquiring[key] += 1
        try:
            return self._claim(key)
        finally:
            with self._lock:
                self._acquiring[key] -= 1
                if not self._acquiring[key]:
                    del self._acquiring[key]

    def _claim(self, key: CacheKey) -> OwnerToken:
        deadline = time.monotonic() + self.wait_s
        while True:
            asked = time.monotonic()
            try:
                claim = self.store.try_acquire(
                    tenant_id=key.tenant_id,
                    session_id=key.name,
                    replica_id=self.replica_id,
                    incarnation=self.incarnation,
                    lease_s=self.lease_s,
                    now_unix_s=time.time(),
                )
            except SessionGone:
                raise SessionNotFound(key.name) from None
            except IncarnationReplaced:
                self._retire()
                raise self._retired_error() from None
            if claim.acquired:
                return self._took(key, claim, asked)
            if time.monotonic() >= deadline:
                raise SessionOwnedElsewhere(key.name, claim.owner_id, claim.owner_url, self.wait_s)
            time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))

    def _took(self, key: CacheKey, claim: Claim, asked: float) -> OwnerToken:
        """Record a lease just taken; drop stale local copies if another replica held it since.

        A lease last held by an earlier process under this replica id keeps the local copies:
        that process was this one's predecessor on the same home (a restart: its disk copies are
        current, and every restored cache is checked against the transcript anyway), and it
        cannot have run turns since this process registered (`IncarnationReplaced`)."""
        token = OwnerToken(self.replica_id, claim.epoch, self.incarnation)
        with self._lock:
            held = self._held.get(key)
            same = held is not None and held.token == token
        if not same and claim.previous_owner != self.replica_id:
            self._invalidate(key)
        with self._lock:
            held = self._held.get(key)
            if held is None or held.token != token:
                held = self._held[key] = _Held(token, asked + self.lease_s, time.monotonic())
            held.releasing = False
            held.expires_monotonic = max(held.expires_monotonic, asked + self.lease_s)
            held.in_use += 1
        return token

    def owns(self, key: CacheKey) -> bool:
        """Whether this replica holds the session's lease and is not handing it over (as far as
        it knows: a lease lost to expiry is noticed at the next renewal)."""
        with self._lock:
            held = self._held.get(key)
            return held is not None and not held.releasing

    def _retire(self) -> None:
        if not self._retired:
            self._retired = True
            log.error(
                "replica id %s was taken over by another process while this one stalled; "
                "it runs no more turns: restart it",
                self.replica_id,
            )

    def _retired_error(self) -> ReplicaRetired:
        return ReplicaRetired(
            f"replica {self.replica_id} was replaced by another process under its id and runs no more "
            "turns; send the request to another replica"
        )

    # -- the keeper ------------------------------------------------------------------------------

    def _keep(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.tick()
            # The keeper must outlive a database or Redis outage: a failed round is retried at the
            # next poll, and leases it could not renew expire (turns then fail their commit fence).
            except (OperationalError, InterfaceError, StorageError) as exc:  # an outage: one line
                log.warning("ownership keeper round failed (%s); retrying", str(exc).splitlines()[0])
            except Exception:  # anything else is a bug: with its traceback
                log.exception("ownership keeper round failed; retrying")

    def tick(self) -> None:
        """One keeper round (the thread calls it every `poll_s`; tests call it directly)."""
        now = time.monotonic()
        if now >= self._next_renew:
            self._renew(now)
            self._next_renew = now + self.lease_s / 3
        wanted = self.store.wanted(replica_id=self.replica_id, incarnation=self.incarnation) if self._held else set()
        with self._lock:
            due = [
                (key, held, key.name in wanted)
                for key, held in self._held.items()
                if not held.in_use
                and not held.releasing
                and (key.name in wanted or self._draining or now - held.last_used_monotonic >= self.idle_s)
            ]
            for _, held, _ in due:
                held.releasing = True
        for key, held, to_another in due:
            try:
                self._hand_over(key, held, to_another)
            # A hand-over that failed (the database went away mid-release) must not leave the
            # session marked as leaving: it would be renewed forever and never handed over. It is
            # tried again next round; the other sessions due are still handed over in this one.
            except Exception:
                with self._lock:
                    if self._held.get(key) is held:
                        held.releasing = False
                log.exception("handing session %s over failed; retrying", key.name)

    def _renew(self, asked: float) -> None:
        beat = self.store.heartbeat(
            replica_id=self.replica_id,
            incarnation=self.incarnation,
            cache_bytes=self._cache_bytes(),
            now_unix_s=time.time(),
            queued_turns=self._queued_turns(),
        )
        if beat == "draining":
            self._start_draining("marked draining in the registry")
        elif beat == "missing":  # an operator removed the row: register again
            self._register()
        elif beat == "taken":
            # Only possible when this process stalled for `lease_s` and another started under its
            # id meanwhile. The renewal below finds no lease of this incarnation, so every local
            # copy is dropped; from now on every turn here is refused (`ReplicaRetired`).
            self._retire()
        renewed = self.store.renew(
            replica_id=self.replica_id, incarnation=self.incarnation, lease_s=self.lease_s, now_unix_s=time.time()
        )
        lost = []
        with self._lock:
            for key, held in list(self._held.items()):
                lease = renewed.get(key.name)
                if lease is None or lease.epoch != held.token.epoch:
                    del self._held[key]
                    lost.append(key)
                else:
                    held.expires_monotonic = asked + self.lease_s
        for key in lost:
            log.warning("replica %s lost session %s to another replica or a delete", self.replica_id, key.name)
            self._invalidate_quietly(key)

    def _hand_over(self, key: CacheKey, held: _Held, to_another: bool) -> None:
        """Publish the session's cache to the shared tier, then release its lease. A failed
        publish still releases: the next owner rebuilds from the transcript. The local copies
        stay: if this replica takes the session back before anyone else ran a turn, they are
        current (`_took` drops them otherwise)."""
        published = self._publish(key)
        with self._lock:
            if held.in_use or self._acquiring[key]:  # a local turn started meanwhile: it keeps the lease
                held.releasing = False
                return
            released = self.store.release(session_id=key.name, token=held.token)
            if self._held.get(key) is held:
                del self._held[key]
        # A hand-over that could not publish makes the next owner rebuild the cache: worth a line.
        log.log(
            logging.DEBUG if published else logging.WARNING,
            "replica %s released session %s%s (published: %s, released: %s)",
            self.replica_id,
            key.name,
            " to a waiting replica" if to_another else " (idle)",
            published,
            released,
        )

    def _invalidate_quietly(self, key: CacheKey) -> None:
        try:
            self._invalidate(key)
        except StorageError as exc:
            log.warning("could not drop the local copies of session %s: %s", key.name, exc)
