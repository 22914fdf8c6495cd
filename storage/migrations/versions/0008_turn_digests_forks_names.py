"""Warm on every path: every turn's history digest (not only the latest), forks, client-named
sessions and their retention.

- `turn_digests`: one row per turn of a session: the digest of the history through that turn as
  its client saw it (`storage.history_digest`), and the conversation-stream length after the
  turn's reply (`token_count`; NULL for turns brought along rather than generated here). A posted
  history finds the session and the turn with the longest matching prefix in one query on
  `(tenant_id, history_digest)`.
- `sessions.parent_id` / `fork_turns`: the session a fork started from and how many of its turns
  it started with; `sessions.name`: a client-chosen id, unique per tenant; `sessions.origin`
  (`explicit`, `implicit`, `named`, `fork`) decides its retention.
- `tenants.implicit_retention_s`: the tenant's idle TTL of implicit sessions (NULL: the server's).

Existing sessions with a history digest get their turn rows back-filled from their transcripts
when the stored texts chain to that digest (always, unless a stop string cut a reply before
stop-cut replies were stored as returned): the last turn's row carries the session's token count.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

import hashlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_VERSION = b"chatkv-history-v1"


def _field(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return len(data).to_bytes(8, "big") + data


def _chain(system_prompt: str | None, turns: list[tuple[str, str]]) -> list[str]:
    """`storage.history_digest`'s chain, frozen here as of this revision."""
    digest = hashlib.sha256(_VERSION + (b"\1" + _field(system_prompt) if system_prompt is not None else b"\0"))
    current = digest.hexdigest()
    out = []
    for user_text, reply_text in turns:
        current = hashlib.sha256(current.encode() + b"\0" + _field(user_text) + _field(reply_text)).hexdigest()
        out.append(current)
    return out


def upgrade() -> None:
    op.create_table(
        "turn_digests",
        sa.Column("session_id", sa.String(length=40), sa.ForeignKey("sessions.id", ondelete="CASCADE"), nullable=False),
        sa.Column("turn_index", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("history_digest", sa.String(length=64), nullable=False),
        sa.Column("token_count", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("session_id", "turn_index"),
    )
    op.create_index("ix_turn_digests_tenant_digest", "turn_digests", ["tenant_id", "history_digest"])
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("parent_id", sa.String(length=40), nullable=True))
        batch.add_column(sa.Column("fork_turns", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("name", sa.String(length=128), nullable=True))
        batch.add_column(sa.Column("origin", sa.String(length=8), nullable=False, server_default="explicit"))
        batch.create_unique_constraint("uq_sessions_tenant_name", ["tenant_id", "name"])
    op.create_index("ix_sessions_origin_active", "sessions", ["origin", "last_active_at"])
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("implicit_retention_s", sa.Float(), nullable=True))
    _backfill()


def _backfill() -> None:
    connection = op.get_bind()
    sessions = connection.execute(
        sa.text("SELECT id, tenant_id, system_prompt, token_count, history_digest FROM sessions WHERE history_digest IS NOT NULL")
    ).fetchall()
    for session_id, tenant_id, system_prompt, token_count, stored in sessions:
        messages = connection.execute(
            sa.text('SELECT role, text FROM messages WHERE session_id = :s ORDER BY "index"'), {"s": session_id}
        ).fetchall()
        roles = [role for role, _ in messages]
        if not messages or len(roles) % 2 or roles != ["user", "assistant"] * (len(roles) // 2):
            continue
        turns = [(messages[i][1], messages[i + 1][1]) for i in range(0, len(messages), 2)]
        chain = _chain(system_prompt, turns)
        if chain[-1] != stored:
            continue
        rows = [
            {
                "session_id": session_id,
                "turn_index": index,
                "tenant_id": tenant_id,
                "history_digest": digest,
                "token_count": token_count if index == len(chain) - 1 else None,
            }
            for index, digest in enumerate(chain)
        ]
        connection.execute(
            sa.text(
                "INSERT INTO turn_digests (session_id, turn_index, tenant_id, history_digest, token_count) "
                "VALUES (:session_id, :turn_index, :tenant_id, :history_digest, :token_count)"
            ),
            rows,
        )


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("implicit_retention_s")
    op.drop_index("ix_sessions_origin_active", table_name="sessions")
    with op.batch_alter_table("sessions") as batch:
        batch.drop_constraint("uq_sessions_tenant_name", type_="unique")
        batch.drop_column("origin")
        batch.drop_column("name")
        batch.drop_column("fork_turns")
        batch.drop_column("parent_id")
    op.drop_index("ix_turn_digests_tenant_digest", table_name="turn_digests")
    op.drop_table("turn_digests")
