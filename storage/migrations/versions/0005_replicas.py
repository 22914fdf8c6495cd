"""Replicas sharing one database: the replica registry, per-session ownership leases, and the
location of each cache blob row (a replica's own disk, or the shared Redis tier).

Rows that exist before this migration are a single process's disk blobs: location `""`.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("cache_blobs") as batch:
        batch.add_column(sa.Column("location", sa.String(length=64), nullable=False, server_default=""))
        batch.drop_constraint("uq_cache_blobs_tenant_name", type_="unique")
        batch.create_unique_constraint("uq_cache_blobs_tenant_name_location", ["tenant_id", "name", "location"])
    op.create_table(
        "replicas",
        sa.Column("id", sa.String(length=64), primary_key=True),
        sa.Column("url", sa.String(length=512), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_unix_s", sa.Float(), nullable=False),
        sa.Column("cache_bytes", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "session_owners",
        sa.Column(
            "session_id", sa.String(length=40), sa.ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column(
            "tenant_id", sa.String(length=40), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("replica_id", sa.String(length=64), nullable=True),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("expires_unix_s", sa.Float(), nullable=False),
        sa.Column("last_owner", sa.String(length=64), nullable=True),
        sa.Column("wanted_by", sa.String(length=64), nullable=True),
    )
    op.create_index("ix_session_owners_tenant_id", "session_owners", ["tenant_id"])
    op.create_index("ix_session_owners_replica_id", "session_owners", ["replica_id"])


def downgrade() -> None:
    op.drop_index("ix_session_owners_replica_id", table_name="session_owners")
    op.drop_index("ix_session_owners_tenant_id", table_name="session_owners")
    op.drop_table("session_owners")
    op.drop_table("replicas")
    with op.batch_alter_table("cache_blobs") as batch:
        batch.drop_constraint("uq_cache_blobs_tenant_name_location", type_="unique")
        batch.create_unique_constraint("uq_cache_blobs_tenant_name", ["tenant_id", "name"])
        batch.drop_column("location")
