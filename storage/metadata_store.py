"""Repository over the metadata database: tenants, sessions, messages, cache blob rows.

Every method is one unit of work (one transaction) with keyword-only arguments. Session reads and
writes filter on the tenant id as well as the session id, so another tenant's session is simply
not found (invariant 2). Results are frozen records detached from the ORM session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError

from storage.database import Repository
from storage.errors import AlreadyExists, SessionGone
from storage.history_digest import digest_chain, extend_digest, history_digest
from storage.replica_store import OwnerToken, check_owner
from storage.schema import CacheBlobRow, MessageRow, SessionRow, TenantRow, TurnDigestRow, utcnow

MessageValues = tuple[str, str, Sequence[int]]
"""A message to store: `(role, text, token_ids)`."""
MAX_HISTORY_MATCHES = 8


@dataclass(frozen=True)
class TenantRecord:
    id: str
    name: str
    created_at: datetime
    wrapped_data_key: bytes | None
    master_key_id: str | None
    api_key_salt: bytes | None
    api_key_hash: bytes | None
    implicit_retention_s: float | None = None
    """The tenant's own idle TTL of implicit sessions and uncontinued forks (`None`: the server's)."""


@dataclass(frozen=True)
class SessionRecord:
    id: str
    tenant_id: str
    title: str | None
    system_prompt: str | None
    model_fingerprint: str
    token_count: int
    message_count: int
    pinned_turns: tuple[int, ...]
    last_ttft_s: float | None
    created_at: datetime
    last_active_at: datetime
    history_digest: str | None = None
    parent_id: str | None = None
    fork_turns: int | None = None
    name: str | None = None
    origin: str = "explicit"


@dataclass(frozen=True)
class MessageRecord:
    index: int
    role: str
    text: str
    token_ids: tuple[int, ...]
    created_at: datetime


@dataclass(frozen=True)
class BlobRecord:
    tenant_id: str
    session_id: str | None
    name: str
    tier: str
    path: str
    nbytes: int
    checksum: str
    model_fingerprint: str
    created_at: datetime
    location: str = ""


def _token_ids(value: object) -> tuple[int, ...]:
    """Stored token ids as a tuple; a row edited into something else reads as no ids (the caller
    then treats the message's ids as missing rather than failing on every turn)."""
    if isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return tuple(value)
    return ()


def _tenant(row: TenantRow) -> TenantRecord:
    return TenantRecord(
        id=row.id,
        name=row.name,
        created_at=row.created_at,
        wrapped_data_key=row.wrapped_data_key,
        master_key_id=row.master_key_id,
        api_key_salt=row.api_key_salt,
        api_key_hash=row.api_key_hash,
        implicit_retention_s=row.implicit_retention_s,
    )


def _session(row: SessionRow, message_count: int) -> SessionRecord:
    return SessionRecord(
        id=row.id,
        tenant_id=row.tenant_id,
        title=row.title,
        system_prompt=row.system_prompt,
        model_fingerprint=row.model_fingerprint,
        token_count=row.token_count,
        message_count=message_count,
        pinned_turns=tuple(row.pinned_turns or ()),
        last_ttft_s=row.last_ttft_s,
        created_at=row.created_at,
        last_active_at=row.last_active_at,
        history_digest=row.history_digest,
        parent_id=row.parent_id,
        fork_turns=row.fork_turns,
        name=row.name,
        origin=row.origin,
    )


def _blob(row: CacheBlobRow) -> BlobRecord:
    return BlobRecord(
        tenant_id=row.tenant_id,
        session_id=row.session_id,
        name=row.name,
        tier=row.tier,
        path=row.path,
        nbytes=row.nbytes,
        checksum=row.checksum,
        model_fingerprint=row.model_fingerprint,
        created_at=row.created_at,
        location=row.location,
    )


class MetadataStore(Repository):
    """Tenants, sessions, messages and cache blob rows in one SQLAlchemy database."""

    # -- tenants -------------------------------------------------------------------------------

    def create_tenant(
        self,
        *,
        tenant_id: str,
        name: str,
        wrapped_data_key: bytes | None = None,
        master_key_id: str | None = None,
    ) -> TenantRecord:
        """Raises `AlreadyExists` if the name is taken."""
        try:
            with self._unit() as db:
                row = TenantRow(
                    id=tenant_id,
                    name=name,
                    wrapped_data_key=wrapped_data_key,
                    master_key_id=master_key_id,
                    created_at=utcnow(),
                )
                db.add(row)
                db.flush()
                return _tenant(row)
        except IntegrityError as exc:
            raise AlreadyExists(f"tenant name taken: {name}") from exc

    def get_tenant(self, *, tenant_id: str | None = None, name: str | None = None) -> TenantRecord | None:
        with self._unit() as db:
            query = select(TenantRow)
            query = (
                query.where(TenantRow.id == tenant_id) if tenant_id is not None else query.where(TenantRow.name == name)
            )
            row = db.scalars(query).first()
            return _tenant(row) if row else None

    def list_tenants(self) -> list[TenantRecord]:
        with self._unit() as db:
            return [_tenant(row) for row in db.scalars(select(TenantRow).order_by(TenantRow.created_at))]

    def set_tenant_key(self, *, tenant_id: str, wrapped_data_key: bytes | None, master_key_id: str | None) -> None:
        with self._unit() as db:
            db.execute(
                update(TenantRow)
                .where(TenantRow.id == tenant_id)
                .values(wrapped_data_key=wrapped_data_key, master_key_id=master_key_id)
            )

    def set_tenant_keys(self, *, wrapped: dict[str, tuple[bytes, str]]) -> None:
        """Replace several tenants' wrapped data keys in one transaction (master key rotation)."""
        with self._unit() as db:
            for tenant_id, (key, key_id) in wrapped.items():
                db.execute(
                    update(TenantRow)
                    .where(TenantRow.id == tenant_id)
                    .values(wrapped_data_key=key, master_key_id=key_id)
                )

    def set_api_key(self, *, tenant_id: str, salt: bytes, digest: bytes) -> None:
        with self._unit() as db:
            db.execute(
                update(TenantRow).where(TenantRow.id == tenant_id).values(api_key_salt=salt, api_key_hash=digest)
            )

    def delete_tenant(self, *, tenant_id: str) -> bool:
        """Delete the tenant and (by cascade) its sessions, messages and blob rows."""
        with self._unit() as db:
            result = db.execute(delete(TenantRow).where(TenantRow.id == tenant_id))
            return bool(getattr(result, "rowcount", 0))

    # -- sessions ------------------------------------------------------------------------------

    def create_session(
        self,
        *,
        tenant_id: str,
        session_id: str,
        title: str | None,
        system_prompt: str | None,
        model_fingerprint: str,
        pinned_turns: Sequence[int] = (),
        messages: Sequence[MessageValues] = (),
        token_count: int = 0,
        origin: str = "explicit",
        name: str | None = None,
    ) -> SessionRecord:
        """Create a session, with `messages` already in its transcript (a history imported from a
        client; alternating user and assistant messages). Its history digest covers them, and each
        of their turns is indexed (`turn_digests`, without a stream length: they were not fed here).

        Raises:
            AlreadyExists: if the tenant has a session called `name`.
        """
        pairs = _turn_texts(messages)
        if pairs is None:
            raise ValueError("a session's initial messages must alternate user and assistant, from a user message")
        try:
            return self._create_session(
                tenant_id,
                session_id,
                title,
                system_prompt,
                model_fingerprint,
                pinned_turns,
                messages,
                pairs,
                token_count,
                origin,
                name,
            )
        except IntegrityError as exc:
            if name is None:  # a foreign key: the tenant was deleted meanwhile
                raise
            raise AlreadyExists(f"session name taken: {name}") from exc

    def _create_session(
        self,
        tenant_id: str,
        session_id: str,
        title: str | None,
        system_prompt: str | None,
        model_fingerprint: str,
        pinned_turns: Sequence[int],
        messages: Sequence[MessageValues],
        pairs: list[tuple[str, str]],
        token_count: int,
        origin: str,
        name: str | None,
    ) -> SessionRecord:
        with self._unit() as db:
            now = utcnow()
            row = SessionRow(
                id=session_id,
                tenant_id=tenant_id,
                title=title,
                system_prompt=system_prompt,
                model_fingerprint=model_fingerprint,
                token_count=token_count,
                pinned_turns=list(pinned_turns),
                created_at=now,
                last_active_at=now,
                history_digest=history_digest(system_prompt, pairs),
                origin=origin,
                name=name,
            )
            db.add(row)
            db.flush()
            for index, digest in enumerate(digest_chain(system_prompt, pairs)):
                db.add(
                    TurnDigestRow(session_id=session_id, turn_index=index, tenant_id=tenant_id, history_digest=digest)
                )
            for index, (role, text, ids) in enumerate(messages):
                db.add(
                    MessageRow(
                        session_id=session_id,
                        index=index,
                        role=role,
                        text=text,
                        token_ids=[int(i) for i in ids],
                        created_at=now,
                    )
                )
            return _session(row, len(messages))

    def sessions_by_history(self, *, tenant_id: str, history_digest: str) -> list[str]:
        """Ids of the tenant's sessions whose history has this digest, most recently active first
        (at most `MAX_HISTORY_MATCHES`; one index lookup on `(tenant_id, history_digest)`)."""
        with self._unit() as db:
            query = (
                select(SessionRow.id)
                .where(SessionRow.tenant_id == tenant_id, SessionRow.history_digest == history_digest)
                .order_by(SessionRow.last_active_at.desc())
                .limit(MAX_HISTORY_MATCHES)
            )
            return list(db.scalars(query))

    def get_session(self, *, tenant_id: str, session_id: str) -> SessionRecord | None:
        """The tenant's session with this id, or with this client-chosen name (the two never clash:
        names cannot take the form of ids)."""
        with self._unit() as db:
            row = db.scalars(
                select(SessionRow).where(
                    or_(SessionRow.id == session_id, SessionRow.name == session_id), SessionRow.tenant_id == tenant_id
                )
            ).first()
            if row is None:
                return None
            count = db.scalar(select(func.count()).where(MessageRow.session_id == row.id)) or 0
            return _session(row, count)

    def list_sessions(
        self, *, tenant_id: str | None = None, idle_before: datetime | None = None
    ) -> list[SessionRecord]:
        """Sessions, most recently active first; all tenants' when `tenant_id` is `None`."""
        with self._unit() as db:
            counts = select(MessageRow.session_id, func.count().label("n")).group_by(MessageRow.session_id).subquery()
            query = select(SessionRow, func.coalesce(counts.c.n, 0)).outerjoin(
                counts, counts.c.session_id == SessionRow.id
            )
            if tenant_id is not None:
                query = query.where(SessionRow.tenant_id == tenant_id)
            if idle_before is not None:
                query = query.where(SessionRow.last_active_at < idle_before)
            query = query.order_by(SessionRow.last_active_at.desc())
            return [_session(row, int(n)) for row, n in db.execute(query)]

    def delete_session(self, *, tenant_id: str, session_id: str) -> bool:
        with self._unit() as db:
            result = db.execute(
                delete(SessionRow).where(SessionRow.id == session_id, SessionRow.tenant_id == tenant_id)
            )
            return bool(getattr(result, "rowcount", 0))

    def messages(self, *, tenant_id: str, session_id: str) -> list[MessageRecord] | None:
        """The transcript in order, or `None` if the session does not exist for this tenant."""
        with self._unit() as db:
            owner = db.scalar(
                select(SessionRow.id).where(SessionRow.id == session_id, SessionRow.tenant_id == tenant_id)
            )
            if owner is None:
                return None
            rows = db.scalars(select(MessageRow).where(MessageRow.session_id == session_id).order_by(MessageRow.index))
            return [
                MessageRecord(
                    index=r.index,
                    role=r.role,
                    text=r.text,
                    token_ids=_token_ids(r.token_ids),
                    created_at=r.created_at,
                )
                for r in rows
            ]

    def record_turn(
        self,
        *,
        tenant_id: str,
        session_id: str,
        messages: Sequence[tuple[str, str, Sequence[int]]],
        token_count: int,
        model_fingerprint: str,
        ttft_s: float | None,
        returned_texts: tuple[str, str] | None = None,
        owner: OwnerToken | None = None,
    ) -> int:
        """Append `(role, text, token_ids)` messages (one turn: user, assistant) and update the
        session, in one transaction: its token count, last activity, and its history digest, which
        is extended by `returned_texts` (the user text and the reply as the client received it;
        default the stored texts) unless it is NULL.

        With `owner` (replicas sharing the database), the turn is stored only while that lease
        still holds the session (`storage.replica_store.check_owner`).

        The turn is indexed for the longest-prefix lookup (`turn_digests`: its history digest and
        the stream length `token_count` after it).

        Returns the index of the first appended message.

        Raises:
            SessionGone: if the session does not exist for this tenant (deleted while the turn ran).
            OwnershipLost: if `owner` lost the session's lease.
        """
        # Over 60 lines (most of it the docstring): one transaction, whose steps must stay together.
        turns = [returned_texts] if returned_texts is not None else _turn_texts(messages)
        now = utcnow()
        values: dict[str, object] = {
            "token_count": token_count,
            "model_fingerprint": model_fingerprint,
            "last_active_at": now,
        }
        if ttft_s is not None:
            values["last_ttft_s"] = ttft_s
        try:
            with self._unit() as db:
                if owner is not None:
                    check_owner(db, session_id=session_id, token=owner)
                # A conditional UPDATE first: it takes the row's write lock on every backend (SQLite
                # ignores FOR UPDATE) and tells whether the session still exists for this tenant.
                updated = db.execute(
                    update(SessionRow)
                    .where(SessionRow.id == session_id, SessionRow.tenant_id == tenant_id)
                    .values(**values)
                )
                if not getattr(updated, "rowcount", 0):
                    raise SessionGone(session_id)
                # The row is locked by the update above: the digest read here is the latest one.
                digest = db.scalar(select(SessionRow.history_digest).where(SessionRow.id == session_id))
                start = int(
                    db.scalar(
                        select(func.coalesce(func.max(MessageRow.index) + 1, 0)).where(
                            MessageRow.session_id == session_id
                        )
                    )
                    or 0
                )
                if digest is not None:
                    # Messages that are not whole turns leave a history no client could post.
                    for user_text, reply_text in turns or ():
                        digest = extend_digest(digest, user_text, reply_text)
                    db.execute(
                        update(SessionRow)
                        .where(SessionRow.id == session_id)
                        .values(history_digest=digest if turns is not None else None)
                    )
                    if turns is not None and len(turns) == 1:
                        db.add(
                            TurnDigestRow(
                                session_id=session_id,
                                turn_index=start // 2,
                                tenant_id=tenant_id,
                                history_digest=digest,
                                token_count=token_count,
                            )
                        )
                for offset, (role, text, ids) in enumerate(messages):
                    db.add(
                        MessageRow(
                            session_id=session_id,
                            index=start + offset,
                            role=role,
                            text=text,
                            token_ids=[int(i) for i in ids],
                            created_at=now,
                        )
                    )
                db.flush()
                return start
        except IntegrityError as exc:  # the session was deleted between the update and the insert
            raise SessionGone(session_id) from exc

    def set_pinned_turns(self, *, tenant_id: str, session_id: str, pinned_turns: Sequence[int]) -> None:
        with self._unit() as db:
            db.execute(
                update(SessionRow)
                .where(SessionRow.id == session_id, SessionRow.tenant_id == tenant_id)
                .values(pinned_turns=sorted(set(pinned_turns)))
            )

    # -- cache blobs ---------------------------------------------------------------------------

    def put_blob(
        self,
        *,
        tenant_id: str,
        session_id: str | None,
        name: str,
        tier: str,
        path: str,
        nbytes: int,
        checksum: str,
        model_fingerprint: str,
        location: str = "",
    ) -> bool:
        """Insert or replace the row of blob `(tenant_id, name)` at `location` (a replica's disk:
        its id, `""` for a single process; the shared tier: `"redis"`). Returns `False` (and
        writes nothing) if its tenant or session no longer exists.

        One upsert (`INSERT … ON CONFLICT DO UPDATE`), so two writers of the same blob at once
        (a write-back and a hand-over publishing one session) both succeed: with a delete and an
        insert, the loser's unique-key violation read as "its session is gone", and its caller
        deleted the value the winner had just recorded."""
        values = {
            "tenant_id": tenant_id,
            "session_id": session_id,
            "name": name,
            "tier": tier,
            "path": path,
            "nbytes": nbytes,
            "checksum": checksum,
            "model_fingerprint": model_fingerprint,
            "created_at": utcnow(),
            "location": location,
        }
        unique = ("tenant_id", "name", "location")
        statement: postgresql.Insert | sqlite.Insert
        if self.database.dialect.name == "postgresql":
            statement = postgresql.insert(CacheBlobRow).values(**values)
        else:  # `open_database` admits SQLite and PostgreSQL only
            statement = sqlite.insert(CacheBlobRow).values(**values)
        upsert = statement.on_conflict_do_update(
            index_elements=unique, set_={c: statement.excluded[c] for c in values if c not in unique}
        )
        try:
            with self._unit() as db:
                db.execute(upsert)
        except IntegrityError:  # the foreign keys: its tenant or session was deleted
            return False
        return True

    def delete_blob(self, *, tenant_id: str, name: str, location: str = "", checksum: str | None = None) -> bool:
        """Delete the row of blob `(tenant_id, name)` at `location`; with `checksum`, only if the
        row still records that blob (not one written since by another writer). Returns whether a
        row was deleted."""
        where = [CacheBlobRow.tenant_id == tenant_id, CacheBlobRow.name == name, CacheBlobRow.location == location]
        if checksum is not None:
            where.append(CacheBlobRow.checksum == checksum)
        with self._unit() as db:
            return bool(getattr(db.execute(delete(CacheBlobRow).where(*where)), "rowcount", 0))

    def get_blob(self, *, tenant_id: str, name: str, location: str = "") -> BlobRecord | None:
        """The row of blob `(tenant_id, name)` at `location`, or `None`."""
        with self._unit() as db:
            row = db.scalars(
                select(CacheBlobRow).where(
                    CacheBlobRow.tenant_id == tenant_id, CacheBlobRow.name == name, CacheBlobRow.location == location
                )
            ).first()
            return None if row is None else _blob(row)

    def list_blobs(self, *, tenant_id: str | None = None, location: str | None = "") -> list[BlobRecord]:
        """Blob rows, oldest first: at `location` (default a single process's disk; `None`: all)."""
        with self._unit() as db:
            query = select(CacheBlobRow).order_by(CacheBlobRow.created_at, CacheBlobRow.id)
            if tenant_id is not None:
                query = query.where(CacheBlobRow.tenant_id == tenant_id)
            if location is not None:
                query = query.where(CacheBlobRow.location == location)
            return [_blob(row) for row in db.scalars(query)]


def _turn_texts(messages: Sequence[MessageValues]) -> list[tuple[str, str]] | None:
    """`(user text, assistant text)` of each turn, or `None` unless the messages are whole turns
    (alternating user and assistant messages, starting with a user message)."""
    roles = [role for role, _, _ in messages]
    if len(roles) % 2 or roles != ["user", "assistant"] * (len(roles) // 2):
        return None
    return [(messages[i][1], messages[i + 1][1]) for i in range(0, len(messages), 2)]
