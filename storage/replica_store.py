"""Repository of the replica registry and the per-session ownership leases (tables `replicas` and
`session_owners`): what lets several `chatkv serve` processes share one database.

A lease is a row taken with a compare-and-swap on its `epoch` (`try_acquire`): read the row (with
`FOR UPDATE` where the backend has it), decide, then update only if the epoch is still the one
read. That is atomic on PostgreSQL and on SQLite alike without relying on either's locking
details. Expiry uses Unix seconds from the replicas' own clocks, so replicas need synchronised
clocks (NTP); the lease time should be many times the expected skew.

Every method is one unit of work (one transaction) with keyword-only arguments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import ColumnElement, delete, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from storage.database import Repository
from storage.errors import SessionGone, StorageError
from storage.schema import ReplicaRow, SessionOwnerRow, SessionRow

log = logging.getLogger(__name__)

_CAS_ATTEMPTS = 8


class OwnershipLost(StorageError):
    """The replica no longer holds the session's lease (it expired and another replica took the
    session over): the turn it was running must not be stored."""


class IncarnationReplaced(StorageError):
    """The replica id is registered by another incarnation now: the calling process was replaced
    (it stalled past its lease and a new process took the id over)."""


class ReplicaIdInUse(StorageError):
    """Another live process heartbeats under this replica id (two processes were given one
    `CHATKV_REPLICA_ID`, or one home was copied)."""


@dataclass(frozen=True)
class OwnerToken:
    """Proof of ownership for a commit: the replica, the epoch it took the lease at, and the
    incarnation (process) of the replica that took it."""

    replica_id: str
    epoch: int
    incarnation: str


@dataclass(frozen=True)
class Claim:
    """Outcome of `try_acquire`.

    `acquired`: the caller now holds the lease at `epoch`; `previous_owner` is the replica that
    held it last before (None: nobody ever did). Otherwise `owner_id` holds it until
    `expires_unix_s`, reachable at `owner_url` (None if it never registered a URL)."""

    acquired: bool
    epoch: int = 0
    previous_owner: str | None = None
    owner_id: str | None = None
    owner_url: str | None = None
    expires_unix_s: float = 0.0


@dataclass(frozen=True)
class ReplicaRecord:
    id: str
    url: str
    hostname: str
    pid: int
    started_at: datetime
    heartbeat_at: datetime
    heartbeat_unix_s: float
    cache_bytes: int
    sessions_owned: int
    queued_turns: int = 0
    draining: bool = False


@dataclass(frozen=True)
class OwnerRecord:
    """A session's lease row, with what its holder's last heartbeat said (where to forward a turn,
    and whether the holder is fit to take it: `owner_heartbeat_unix_s` is `None` when nobody holds
    the lease or its replica is not registered any more)."""

    session_id: str
    replica_id: str | None
    epoch: int
    expires_unix_s: float
    last_owner: str | None
    wanted_by: str | None
    owner_url: str | None
    owner_heartbeat_unix_s: float | None = None
    owner_draining: bool = False
    owner_queued_turns: int = 0


@dataclass(frozen=True)
class HeldLease:
    """A lease the replica still holds after a renewal: its epoch and who waits for it."""

    epoch: int
    wanted_by: str | None


class ReplicaStore(Repository):
    """Replica registry and ownership leases in one SQLAlchemy database."""

    # -- registry ------------------------------------------------------------------------------

    def register(
        self,
        *,
        replica_id: str,
        incarnation: str,
        url: str,
        hostname: str,
        pid: int,
        now_unix_s: float,
        live_within_s: float,
    ) -> ReplicaRecord | None:
        """Insert or take over the replica id's row for this process (`incarnation`), unless
        another incarnation heartbeat under the id less than `live_within_s` ago: then nothing is
        written and that incarnation's row is returned (the caller waits for it to go stale, or
        gives up). On success returns `None`, and every lease an earlier incarnation of this id
        still holds is released: that process is gone, and nobody would renew or hand them over
        (their caches are rebuilt from the transcripts where Redis has no current copy)."""
        now = datetime.fromtimestamp(now_unix_s, UTC)
        retried = False
        while True:
            try:
                with self._unit() as db:
                    row = db.scalar(select(ReplicaRow).where(ReplicaRow.id == replica_id).with_for_update())
                    if row is not None and row.incarnation != incarnation:
                        if row.heartbeat_unix_s > now_unix_s - live_within_s:
                            return _record(row, sessions_owned=0)
                        row.started_at, row.cache_bytes = now, 0
                        row.queued_turns, row.draining = 0, False  # a new process drains when told
                    if row is None:
                        row = ReplicaRow(id=replica_id, cache_bytes=0, started_at=now, queued_turns=0, draining=False)
                        db.add(row)
                    row.incarnation, row.url, row.hostname, row.pid = incarnation, url, hostname, pid
                    row.heartbeat_at, row.heartbeat_unix_s = now, now_unix_s
                    db.execute(
                        update(SessionOwnerRow)
                        .where(
                            SessionOwnerRow.replica_id == replica_id,
                            or_(SessionOwnerRow.incarnation.is_(None), SessionOwnerRow.incarnation != incarnation),
                        )
                        .values(replica_id=None, incarnation=None)
                        .execution_options(synchronize_session=False)
                    )
                    return None
            except IntegrityError:
                # Another process inserted the id's first row meanwhile (`FOR UPDATE` locks no
                # row that does not exist yet): look again, once, and see it.
                if retried:
                    raise
                retried = True

    def heartbeat(
        self, *, replica_id: str, incarnation: str, cache_bytes: int, now_unix_s: float, queued_turns: int = 0
    ) -> str:
        """Record that this incarnation of the replica lives, with its cache bytes and the turns
        waiting in its engine queue. Returns `"ok"`; `"draining"` if the replica is to drain (it,
        or an operator, said so: `set_draining`); `"missing"` if the row is gone (an operator
        removed it: the caller registers again); `"taken"` if another process registered under
        the id since (the caller stops holding anything)."""
        with self._unit() as db:
            result = db.execute(
                update(ReplicaRow)
                .where(ReplicaRow.id == replica_id, ReplicaRow.incarnation == incarnation)
                .values(
                    heartbeat_at=datetime.fromtimestamp(now_unix_s, UTC),
                    heartbeat_unix_s=now_unix_s,
                    cache_bytes=cache_bytes,
                    queued_turns=queued_turns,
                )
            )
            if getattr(result, "rowcount", 0):
                draining = db.scalar(select(ReplicaRow.draining).where(ReplicaRow.id == replica_id))
                return "draining" if draining else "ok"
            return "missing" if db.get(ReplicaRow, replica_id) is None else "taken"

    def set_draining(self, *, replica_id: str) -> bool:
        """Mark the replica as draining (it hands its sessions over, others stop forwarding turns
        to it); its keeper reads the mark with its next heartbeat. Returns `False` if no replica is
        registered under the id. The mark lasts until a new process registers under the id."""
        with self._unit() as db:
            result = db.execute(update(ReplicaRow).where(ReplicaRow.id == replica_id).values(draining=True))
            return bool(getattr(result, "rowcount", 0))

    def unregister(self, *, replica_id: str, incarnation: str) -> None:
        """Remove the replica's row and give up its leases (a clean shutdown); rows and leases of
        another incarnation under the same id are left alone."""
        with self._unit() as db:
            db.execute(
                update(SessionOwnerRow)
                .where(SessionOwnerRow.replica_id == replica_id, SessionOwnerRow.incarnation == incarnation)
                .values(replica_id=None, incarnation=None, wanted_by=None)
            )
            db.execute(delete(ReplicaRow).where(ReplicaRow.id == replica_id, ReplicaRow.incarnation == incarnation))

    def list_replicas(self, *, now_unix_s: float) -> list[ReplicaRecord]:
        """Every registered replica, most recent heartbeat first, with the sessions it owns now
        (leases not expired at `now_unix_s`)."""
        with self._unit() as db:
            owned = dict(
                db.execute(
                    select(SessionOwnerRow.replica_id, func.count())
                    .where(SessionOwnerRow.replica_id.is_not(None), SessionOwnerRow.expires_unix_s >= now_unix_s)
                    .group_by(SessionOwnerRow.replica_id)
                ).all()
            )
            rows = db.scalars(select(ReplicaRow).order_by(ReplicaRow.heartbeat_unix_s.desc()))
            return [_record(r, sessions_owned=int(owned.get(r.id, 0))) for r in rows]

    # -- ownership leases ----------------------------------------------------------------------

    def try_acquire(
        self, *, tenant_id: str, session_id: str, replica_id: str, incarnation: str, lease_s: float, now_unix_s: float
    ) -> Claim:
        """Take the session's lease if it is free, expired or already this process's (the same
        replica id and incarnation); otherwise
        mark this replica as waiting for it (`wanted_by`) and say who holds it.

        Raises:
            SessionGone: if the session does not exist for this tenant.
            IncarnationReplaced: if another process registered under `replica_id` since this
                incarnation did.
            StorageError: if the compare-and-swap kept losing to other replicas (a bug or a storm).
        """
        for _ in range(_CAS_ATTEMPTS):
            claim = self._try_acquire_once(tenant_id, session_id, replica_id, incarnation, lease_s, now_unix_s)
            if claim is not None:
                return claim
        raise StorageError(f"could not settle the ownership of session {session_id} after {_CAS_ATTEMPTS} attempts")

    def _try_acquire_once(
        self, tenant_id: str, session_id: str, replica_id: str, incarnation: str, lease_s: float, now_unix_s: float
    ) -> Claim | None:
        """One compare-and-swap round; `None` when another replica changed the row meanwhile."""
        # Over 60 lines: one transaction's read, decision and conditional write belong together.
        expires = now_unix_s + lease_s
        with self._unit() as db:
            exists = db.scalar(
                select(SessionRow.id).where(SessionRow.id == session_id, SessionRow.tenant_id == tenant_id)
            )
            if exists is None:
                raise SessionGone(session_id)
            registered = db.scalar(select(ReplicaRow.incarnation).where(ReplicaRow.id == replica_id))
            if registered is not None and registered != incarnation:
                raise IncarnationReplaced(f"replica id {replica_id} is registered by another process now")
            row = db.scalar(select(SessionOwnerRow).where(SessionOwnerRow.session_id == session_id).with_for_update())
            if row is None:
                try:
                    with db.begin_nested():
                        db.add(
                            SessionOwnerRow(
                                session_id=session_id,
                                tenant_id=tenant_id,
                                replica_id=replica_id,
                                incarnation=incarnation,
                                epoch=1,
                                expires_unix_s=expires,
                                last_owner=replica_id,
                                wanted_by=None,
                            )
                        )
                except IntegrityError:
                    return None  # another replica inserted it first (or the session just went)
                return Claim(acquired=True, epoch=1, previous_owner=None)
            if row.replica_id == replica_id and row.incarnation == incarnation and row.expires_unix_s >= now_unix_s:
                row.expires_unix_s = expires
                if row.wanted_by == replica_id:
                    row.wanted_by = None
                return Claim(acquired=True, epoch=row.epoch, previous_owner=row.last_owner)
            if row.replica_id is None or row.expires_unix_s < now_unix_s:
                previous, epoch = row.last_owner, row.epoch
                swapped = db.execute(
                    update(SessionOwnerRow)
                    .where(SessionOwnerRow.session_id == session_id, SessionOwnerRow.epoch == epoch)
                    .values(
                        replica_id=replica_id,
                        incarnation=incarnation,
                        epoch=epoch + 1,
                        expires_unix_s=expires,
                        last_owner=replica_id,
                        wanted_by=None if row.wanted_by == replica_id else row.wanted_by,
                    )
                    .execution_options(synchronize_session=False)
                )
                if not getattr(swapped, "rowcount", 0):
                    return None
                return Claim(acquired=True, epoch=epoch + 1, previous_owner=previous)
            if row.wanted_by != replica_id:
                row.wanted_by = replica_id
            owner_url = db.scalar(select(ReplicaRow.url).where(ReplicaRow.id == row.replica_id))
            return Claim(
                acquired=False, owner_id=row.replica_id, owner_url=owner_url, expires_unix_s=row.expires_unix_s
            )

    def renew(self, *, replica_id: str, incarnation: str, lease_s: float, now_unix_s: float) -> dict[str, HeldLease]:
        """Extend every lease this incarnation of the replica holds and return them by session id.
        A session missing from the result is no longer its own (taken over after expiry, or
        deleted)."""
        mine = (SessionOwnerRow.replica_id == replica_id, SessionOwnerRow.incarnation == incarnation)
        with self._unit() as db:
            db.execute(update(SessionOwnerRow).where(*mine).values(expires_unix_s=now_unix_s + lease_s))
            rows = db.execute(
                select(SessionOwnerRow.session_id, SessionOwnerRow.epoch, SessionOwnerRow.wanted_by).where(*mine)
            ).all()
            return {session_id: HeldLease(epoch, wanted_by) for session_id, epoch, wanted_by in rows}

    def wanted(self, *, replica_id: str, incarnation: str) -> set[str]:
        """Sessions this incarnation of the replica holds that another replica waits for."""
        with self._unit() as db:
            return set(
                db.scalars(
                    select(SessionOwnerRow.session_id).where(
                        SessionOwnerRow.replica_id == replica_id,
                        SessionOwnerRow.incarnation == incarnation,
                        SessionOwnerRow.wanted_by.is_not(None),
                    )
                )
            )

    def release(self, *, session_id: str, token: OwnerToken) -> bool:
        """Give the lease up (the session's cache is in the shared tier). Returns `False` if the
        replica did not hold it at that epoch any more."""
        with self._unit() as db:
            result = db.execute(
                update(SessionOwnerRow)
                .where(*_held_by(session_id, token))
                .values(replica_id=None, incarnation=None, wanted_by=None)
            )
            return bool(getattr(result, "rowcount", 0))

    def owner(self, *, session_id: str) -> OwnerRecord | None:
        """The session's lease row with its owner's URL, or `None` if nobody ever held it."""
        with self._unit() as db:
            row = db.get(SessionOwnerRow, session_id)
            if row is None:
                return None
            holder = db.get(ReplicaRow, row.replica_id) if row.replica_id else None
            return OwnerRecord(
                session_id=row.session_id,
                replica_id=row.replica_id,
                epoch=row.epoch,
                expires_unix_s=row.expires_unix_s,
                last_owner=row.last_owner,
                wanted_by=row.wanted_by,
                owner_url=holder.url if holder is not None else None,
                owner_heartbeat_unix_s=holder.heartbeat_unix_s if holder is not None else None,
                owner_draining=bool(holder.draining) if holder is not None else False,
                owner_queued_turns=holder.queued_turns if holder is not None else 0,
            )


def check_owner(db: Session, *, session_id: str, token: OwnerToken) -> None:
    """Inside a commit's transaction: lock the session's lease row and check that `token` still
    holds it, so a replica whose lease was taken over cannot store a turn (the fencing token of
    the lease). The no-op update takes the row's write lock on every backend, so a take-over
    waits for this transaction instead of racing it.

    Raises:
        OwnershipLost: if the lease is another replica's now, or was taken at a later epoch.
    """
    result = db.execute(
        update(SessionOwnerRow)
        .where(*_held_by(session_id, token))
        .values(epoch=SessionOwnerRow.epoch)
        .execution_options(synchronize_session=False)
    )
    if not getattr(result, "rowcount", 0):
        raise OwnershipLost(f"replica {token.replica_id} lost session {session_id} (epoch {token.epoch})")


def _held_by(session_id: str, token: OwnerToken) -> tuple[ColumnElement[bool], ...]:
    """The conditions of a lease row that `token` still holds (same process, same epoch)."""
    return (
        SessionOwnerRow.session_id == session_id,
        SessionOwnerRow.replica_id == token.replica_id,
        SessionOwnerRow.incarnation == token.incarnation,
        SessionOwnerRow.epoch == token.epoch,
    )


def _record(row: ReplicaRow, *, sessions_owned: int) -> ReplicaRecord:
    return ReplicaRecord(
        id=row.id,
        url=row.url,
        hostname=row.hostname,
        pid=row.pid,
        started_at=row.started_at,
        heartbeat_at=row.heartbeat_at,
        heartbeat_unix_s=row.heartbeat_unix_s,
        cache_bytes=row.cache_bytes,
        sessions_owned=sessions_owned,
        queued_turns=row.queued_turns,
        draining=bool(row.draining),
    )
