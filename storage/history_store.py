"""Sessions as a tree of histories: which session holds the longest prefix of a posted history,
forks (a new session holding the first turns of another), client-chosen names, and the sessions
whose retention ran out. Every method is one unit of work; every read is filtered by tenant.

    posted history  system S, u1 a1, u2 a2, ..., un an (+ the new message)
    digests         d1 .. dn (`storage.history_digest.digest_chain`)
    longest_prefix  the tenant's turn rows whose digest is one of them: the largest turn index
                    k is the longest prefix any session holds (a digest chains every earlier
                    turn, so one match is the whole prefix)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError

from storage.database import Repository
from storage.errors import AlreadyExists, SessionGone, StorageError
from storage.history_digest import start_digest
from storage.schema import MessageRow, SessionRow, TenantRow, TurnDigestRow, utcnow

MAX_PREFIX_MATCHES = 8
"""Sessions considered for one posted history (the most recently active that share its longest prefix)."""


class NoSuchTurn(StorageError):
    """A fork asked for more turns than its parent has."""


@dataclass(frozen=True)
class PrefixMatch:
    """A session holding a prefix of a posted history.

    Attributes:
        session_id: the session.
        turns: how many turns of the posted history it holds (the prefix length).
        token_count: stream length after the last of those turns (`None`: not fed here).
        whole: the prefix is the session's whole history (continue it rather than fork it).
        last_active_at: for choosing among sessions holding the same prefix.
        origin: how the session was made (`explicit`, `named`, `implicit`, `fork`): only an
            implicit session, made for a stateless client, is continued by a posted history.
    """

    session_id: str
    turns: int
    token_count: int | None
    whole: bool
    last_active_at: datetime
    origin: str


@dataclass(frozen=True)
class ExpiredSession:
    tenant_id: str
    session_id: str
    last_active_at: datetime


class HistoryStore(Repository):
    """Prefix lookups, forks, names and retention over the metadata database."""

    def longest_prefix(self, *, tenant_id: str, digests: Sequence[str]) -> list[PrefixMatch]:
        """The tenant's sessions holding the longest prefix of the history whose turn digests are
        `digests` (`[d1, ..., dn]`), most recently active first; empty when none holds its first
        turn. One query on the index `(tenant_id, history_digest)`.

        A fork that has not run a turn of its own yet is left out: it holds nothing its parent
        does not, and the request that made it is about to run its first turn on it (found here,
        a concurrent request would take it over and the maker would find it busy)."""
        if not digests:
            return []
        whole = SessionRow.history_digest.is_not(None) & (SessionRow.history_digest == TurnDigestRow.history_digest)
        unused_fork = (
            SessionRow.parent_id.is_not(None) & whole & (TurnDigestRow.turn_index == SessionRow.fork_turns - 1)
        )
        with self._unit() as db:
            rows = db.execute(
                select(
                    TurnDigestRow.session_id,
                    TurnDigestRow.turn_index,
                    TurnDigestRow.token_count,
                    whole,
                    SessionRow.last_active_at,
                    SessionRow.origin,
                )
                .join(SessionRow, SessionRow.id == TurnDigestRow.session_id)
                .where(
                    TurnDigestRow.tenant_id == tenant_id,
                    TurnDigestRow.history_digest.in_(list(digests)),
                    ~unused_fork,
                )
                .order_by(TurnDigestRow.turn_index.desc(), SessionRow.last_active_at.desc())
                .limit(MAX_PREFIX_MATCHES)
            ).all()
        if not rows:
            return []
        longest = rows[0][1]
        return [
            PrefixMatch(session_id, index + 1, token_count, bool(is_whole), active, origin)
            for session_id, index, token_count, is_whole, active, origin in rows
            if index == longest and digests[index] is not None
        ]

    def fork(
        self, *, tenant_id: str, parent_id: str, session_id: str, turns: int, origin: str, name: str | None = None
    ) -> int | None:
        """Create `session_id` as a fork of the tenant's `parent_id` holding its first `turns`
        turns: its messages (with their exact token ids), their turn rows, its pins among them,
        and the history digest and stream length after them. One transaction.

        Returns the stream length after the fork turn (`None`: those turns were not fed here, or
        `turns` is 0: the fork's cache starts from nothing but the system prompt).

        Raises:
            SessionGone: if the parent does not exist for this tenant.
            NoSuchTurn: if the parent has fewer than `turns` turns.
            AlreadyExists: if the tenant has a session called `name`.
        """
        try:
            with self._unit() as db:
                parent = db.scalars(
                    select(SessionRow).where(SessionRow.id == parent_id, SessionRow.tenant_id == tenant_id)
                ).first()
                if parent is None:
                    raise SessionGone(parent_id)
                messages = list(
                    db.scalars(
                        select(MessageRow)
                        .where(MessageRow.session_id == parent_id, MessageRow.index < 2 * turns)
                        .order_by(MessageRow.index)
                    )
                )
                if len(messages) != 2 * turns:
                    raise NoSuchTurn(f"session {parent_id} has {len(messages) // 2} turns, not {turns}")
                rows = list(
                    db.scalars(
                        select(TurnDigestRow)
                        .where(TurnDigestRow.session_id == parent_id, TurnDigestRow.turn_index < turns)
                        .order_by(TurnDigestRow.turn_index)
                    )
                )
                known = len(rows) == turns
                last = rows[-1] if rows and known else None
                token_count = last.token_count if last is not None else None
                now = utcnow()
                db.add(
                    SessionRow(
                        id=session_id,
                        tenant_id=tenant_id,
                        title=parent.title,
                        system_prompt=parent.system_prompt,
                        model_fingerprint=parent.model_fingerprint,
                        token_count=token_count or 0,
                        pinned_turns=[t for t in parent.pinned_turns or () if t < turns],
                        created_at=now,
                        last_active_at=now,
                        history_digest=(
                            None
                            if parent.history_digest is None or (turns and not known)
                            else last.history_digest
                            if last is not None
                            else start_digest(parent.system_prompt)
                        ),
                        parent_id=parent_id,
                        fork_turns=turns,
                        origin=origin,
                        name=name,
                    )
                )
                db.flush()
                for message in messages:
                    db.add(
                        MessageRow(
                            session_id=session_id,
                            index=message.index,
                            role=message.role,
                            text=message.text,
                            token_ids=list(message.token_ids),
                            created_at=now,
                        )
                    )
                for row in rows if known else ():
                    db.add(
                        TurnDigestRow(
                            session_id=session_id,
                            turn_index=row.turn_index,
                            tenant_id=tenant_id,
                            history_digest=row.history_digest,
                            token_count=row.token_count,
                        )
                    )
                return token_count if turns else None
        except IntegrityError as exc:
            if name is None:
                raise SessionGone(parent_id) from exc  # the tenant went meanwhile
            raise AlreadyExists(f"session name taken: {name}") from exc

    def set_retention(self, *, tenant_id: str, retention_s: float | None) -> bool:
        """Set the tenant's idle TTL of implicit sessions and forks (`None`: the server's).
        Returns whether the tenant exists."""
        with self._unit() as db:
            tenant = db.get(TenantRow, tenant_id)
            if tenant is None:
                return False
            tenant.implicit_retention_s = retention_s
            return True

    def expired(self, *, now: datetime, default_retention_s: float, limit: int = 1000) -> list[ExpiredSession]:
        """Sessions whose retention ran out at `now`, oldest first (at most `limit`): implicit
        sessions, and forks nobody continued (no turn beyond the fork), idle longer than their
        tenant's TTL (`tenants.implicit_retention_s`, else `default_retention_s`). One query per
        distinct TTL, each on the index `(origin, last_active_at)`."""
        with self._unit() as db:
            overrides = db.execute(
                select(TenantRow.id, TenantRow.implicit_retention_s).where(TenantRow.implicit_retention_s.is_not(None))
            ).all()
            by_ttl: dict[float, list[str]] = {}
            for tenant_id, ttl in overrides:
                by_ttl.setdefault(float(ttl or 0), []).append(tenant_id)
            overridden = [tenant_id for tenant_id, _ in overrides]
            turns = select(func.count()).where(MessageRow.session_id == SessionRow.id).scalar_subquery()
            uncontinued = (SessionRow.origin == "fork") & (turns <= 2 * func.coalesce(SessionRow.fork_turns, 0))
            groups = [(default_retention_s, SessionRow.tenant_id.not_in(overridden))]
            groups += [(ttl, SessionRow.tenant_id.in_(tenants)) for ttl, tenants in by_ttl.items()]
            found: list[ExpiredSession] = []
            for ttl, tenants in groups:
                rows = db.execute(
                    select(SessionRow.tenant_id, SessionRow.id, SessionRow.last_active_at)
                    .where(
                        tenants,
                        or_(SessionRow.origin == "implicit", uncontinued),
                        SessionRow.last_active_at < now - timedelta(seconds=ttl),
                    )
                    .order_by(SessionRow.last_active_at)
                    .limit(limit)
                ).all()
                found += [ExpiredSession(t, sid, active) for t, sid, active in rows]
        return sorted(found, key=lambda e: e.last_active_at)[:limit]
