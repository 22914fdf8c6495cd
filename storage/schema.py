"""SQLAlchemy 2 models of the metadata database. The schema itself comes from the Alembic
migrations in `storage/migrations`; tests alone may call `Base.metadata.create_all`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.sql.expression import false


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: chatkv stores UTC-aware timestamps")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: UTCDateTime}


class TenantRow(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    wrapped_data_key: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    """The tenant's AES-256 data key sealed with the master key (nonce + ciphertext + tag)."""
    master_key_id: Mapped[str | None] = mapped_column(String(32), default=None)
    api_key_salt: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    api_key_hash: Mapped[bytes | None] = mapped_column(LargeBinary, default=None)
    implicit_retention_s: Mapped[float | None] = mapped_column(Float, default=None)
    """Idle TTL of this tenant's implicit sessions and forks in seconds (NULL: the server's)."""

    sessions: Mapped[list[SessionRow]] = relationship(
        back_populates="tenant", cascade="all, delete-orphan", passive_deletes=True
    )


class SessionRow(Base):
    __tablename__ = "sessions"
    __table_args__ = (
        Index("ix_sessions_tenant_history", "tenant_id", "history_digest"),
        Index("ix_sessions_origin_active", "origin", "last_active_at"),
        UniqueConstraint("tenant_id", "name", name="uq_sessions_tenant_name"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    title: Mapped[str | None] = mapped_column(String(200), default=None)
    system_prompt: Mapped[str | None] = mapped_column(Text, default=None)
    model_fingerprint: Mapped[str] = mapped_column(String(64))
    token_count: Mapped[int] = mapped_column(Integer, default=0)
    """Tokens of the conversation stream fed to the model so far (demoted turns included)."""
    pinned_turns: Mapped[list[int]] = mapped_column(JSON, default=list)
    last_ttft_s: Mapped[float | None] = mapped_column(Float, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_active_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    history_digest: Mapped[str | None] = mapped_column(String(64), default=None)
    """SHA-256 chain over the history as its client saw it (`storage.history_digest`); NULL for
    sessions older than migration 0004, which the implicit lookup then never finds."""
    parent_id: Mapped[str | None] = mapped_column(String(40), default=None)
    """The session this one was forked from (it may have been deleted since)."""
    fork_turns: Mapped[int | None] = mapped_column(Integer, default=None)
    """How many of the parent's turns the fork started with."""
    name: Mapped[str | None] = mapped_column(String(128), default=None)
    """The id the client chose for the session (unique per tenant), if it chose one."""
    origin: Mapped[str] = mapped_column(String(8), default="explicit", server_default="explicit")
    """`explicit` (created by id), `implicit` (found no session for a posted history), `named` (a
    client-chosen id), `fork`: implicit and fork sessions expire after an idle TTL."""

    tenant: Mapped[TenantRow] = relationship(back_populates="sessions")
    messages: Mapped[list[MessageRow]] = relationship(
        back_populates="session",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="MessageRow.index",
    )


class MessageRow(Base):
    __tablename__ = "messages"
    __table_args__ = (UniqueConstraint("session_id", "index", name="uq_messages_session_index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), index=True)
    index: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(16))
    text: Mapped[str] = mapped_column(Text)
    token_ids: Mapped[list[int]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    session: Mapped[SessionRow] = relationship(back_populates="messages")


class TurnDigestRow(Base):
    """One turn of a session as a posted history finds it: the digest of the history through the
    turn as its client saw it, and the stream length after the turn's reply (NULL for turns
    brought along in a posted history: their tokens were not fed here as a turn)."""

    __tablename__ = "turn_digests"
    __table_args__ = (Index("ix_turn_digests_tenant_digest", "tenant_id", "history_digest"),)

    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True)
    turn_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    history_digest: Mapped[str] = mapped_column(String(64))
    token_count: Mapped[int | None] = mapped_column(Integer, default=None)


class CacheBlobRow(Base):
    """A sealed cache blob in a lower tier: a session's cache, or a shared base layer (`session_id`
    null). `location` says whose copy it is: a replica's own disk (its replica id; `""` for a
    single process) or the shared Redis tier (`"redis"`), so replicas sharing one database never
    mistake another replica's files for their own."""

    __tablename__ = "cache_blobs"
    __table_args__ = (UniqueConstraint("tenant_id", "name", "location", name="uq_cache_blobs_tenant_name_location"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    session_id: Mapped[str | None] = mapped_column(
        ForeignKey("sessions.id", ondelete="CASCADE"), index=True, default=None
    )
    name: Mapped[str] = mapped_column(String(120))
    tier: Mapped[str] = mapped_column(String(8))
    path: Mapped[str] = mapped_column(String(512))
    nbytes: Mapped[int] = mapped_column(BigInteger)
    checksum: Mapped[str] = mapped_column(String(64))
    """SHA-256 of the sealed bytes as written; in Redis, of the value under the blob's key: a
    chunked blob's manifest (its header, whose random blob id names that write's chunks alone)."""
    model_fingerprint: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    location: Mapped[str] = mapped_column(String(64), default="", server_default="")


class ReplicaRow(Base):
    """A `chatkv serve` process sharing this database: registered at start, heartbeat while it lives."""

    __tablename__ = "replicas"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    url: Mapped[str] = mapped_column(String(512))
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_unix_s: Mapped[float] = mapped_column(Float)
    """The same instant as `heartbeat_at` in Unix seconds, compared with `session_owners.expires_unix_s`."""
    cache_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    """Bytes of session caches this replica holds in its device, host and disk tiers."""
    incarnation: Mapped[str | None] = mapped_column(String(32), default=None)
    """Random per process: tells a restarted process, or a second one started with the same id,
    from the one that registered."""
    queued_turns: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Turns waiting in the replica's engine queue at its last heartbeat (others hand a session over
    rather than forward a turn to an owner over their `forward_queue_limit`)."""
    draining: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """The replica hands its sessions over and takes no new ones: set by itself when it stops, or
    by an operator (`chatkv replicas drain`); read by its keeper with each heartbeat."""


class SessionOwnerRow(Base):
    """The ownership lease of a session: the one replica allowed to run its turns.

    `replica_id` is NULL while nobody holds it. `epoch` grows by one on every take-over and fences
    a turn's commit (`MetadataStore.record_turn` checks it), so a replica that lost its lease while
    a turn ran cannot store that turn. `last_owner` is the replica that held it most recently: a
    replica taking a session back after another held it knows its own local copies are stale.
    """

    __tablename__ = "session_owners"

    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    replica_id: Mapped[str | None] = mapped_column(String(64), default=None, index=True)
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    expires_unix_s: Mapped[float] = mapped_column(Float, default=0.0)
    last_owner: Mapped[str | None] = mapped_column(String(64), default=None)
    wanted_by: Mapped[str | None] = mapped_column(String(64), default=None)
    """A replica waiting for this session: the owner hands it over as soon as it is idle."""
    incarnation: Mapped[str | None] = mapped_column(String(32), default=None)
    """The incarnation (`ReplicaRow.incarnation`) of the process holding the lease: only that
    process renews it, takes it again without a new epoch, and commits under it."""


class IdempotencyKeyRow(Base):
    """The answer recorded under a client's `Idempotency-Key` (`storage.idempotency_store`).

    `state` is `running` while the first request with the key runs, `done` once its answer is in
    `response` (JSON), or is the stored response `response_id` (Responses API: the answer is read
    from that row, and the key's row goes with it and with its conversation, if any).
    `request_digest` (SHA-256 of the route, the
    headers that say where the turn goes, and the body) tells a retry from a different request
    reusing the key. `holder` is the incarnation of the process running the request: a claim
    whose holder is dead is free. The row goes with its tenant and with its session.
    """

    __tablename__ = "idempotency_keys"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    request_digest: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(8))
    session_id: Mapped[str | None] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), default=None)
    response: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    holder: Mapped[str | None] = mapped_column(String(32), default=None)
    """The incarnation (`ReplicaRow.incarnation`, or a single process's own) that claimed the key;
    NULL for claims made before migration 0011."""
    response_id: Mapped[str | None] = mapped_column(
        ForeignKey("responses.id", ondelete="CASCADE", name="fk_idempotency_keys_response_id_responses"),
        default=None,
        index=True,
    )
    conversation_id: Mapped[str | None] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE", name="fk_idempotency_keys_conversation_id_conversations"),
        default=None,
        index=True,
    )
    """The conversation the response was created in: the key's row goes with it too."""


class ResponseRow(Base):
    """A stored response (OpenAI's Responses API): the end of turn `turn_index` of a session
    (`storage.response_store`). `response` is the response object as answered and `input_items`
    the items it was created with (JSON text). The row goes with its tenant and with its session.
    """

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), index=True)
    turn_index: Mapped[int] = mapped_column(Integer)
    previous_response_id: Mapped[str | None] = mapped_column(String(40), default=None)
    response: Mapped[str] = mapped_column(Text)
    input_items: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ConversationRow(Base):
    """A conversation (OpenAI's Responses API): a durable id over a session
    (`storage.conversation_store`). `metadata` (JSON object) is kept as given, its items are rows
    of `conversation_items`; `item_count` and `item_bytes` are their number and size (what the
    caps are checked on), `next_position` the position the next item takes. `session_id` is the
    session holding the items' turns (NULL once it is gone)."""

    __tablename__ = "conversations"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    session_id: Mapped[str | None] = mapped_column(ForeignKey("sessions.id", ondelete="SET NULL"), default=None)
    metadata_json: Mapped[str] = mapped_column("metadata", Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    item_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    item_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    next_position: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class ConversationItemRow(Base):
    """One item of a conversation (a message object as JSON text, `nbytes` UTF-8 bytes long), at
    `position` (growing as items are appended; a deleted item leaves a gap). `item_id` is the
    item's own id (`msg_...`), unique in its conversation. The row goes with its conversation."""

    __tablename__ = "conversation_items"
    __table_args__ = (UniqueConstraint("conversation_id", "item_id", name="uq_conversation_items_item_id"),)

    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    item_id: Mapped[str] = mapped_column(String(64))
    item: Mapped[str] = mapped_column(Text)
    nbytes: Mapped[int] = mapped_column(Integer)
