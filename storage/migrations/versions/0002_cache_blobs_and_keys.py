"""Sealed cache blobs on disk, and each tenant's wrapped data-encryption key.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import storage.schema

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("wrapped_data_key", sa.LargeBinary(), nullable=True))
        batch.add_column(sa.Column("master_key_id", sa.String(length=32), nullable=True))
    op.create_table(
        "cache_blobs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("session_id", sa.String(length=40), nullable=True),
        sa.Column("name", sa.String(length=120), nullable=False),
        sa.Column("tier", sa.String(length=8), nullable=False),
        sa.Column("path", sa.String(length=512), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.Column("checksum", sa.String(length=64), nullable=False),
        sa.Column("model_fingerprint", sa.String(length=64), nullable=False),
        sa.Column("created_at", storage.schema.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "name", name="uq_cache_blobs_tenant_name"),
    )
    op.create_index("ix_cache_blobs_tenant_id", "cache_blobs", ["tenant_id"])
    op.create_index("ix_cache_blobs_session_id", "cache_blobs", ["session_id"])


def downgrade() -> None:
    op.drop_index("ix_cache_blobs_session_id", table_name="cache_blobs")
    op.drop_index("ix_cache_blobs_tenant_id", table_name="cache_blobs")
    op.drop_table("cache_blobs")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("master_key_id")
        batch.drop_column("wrapped_data_key")
