"""Salted hash of each tenant's API key (the key itself is shown once and never stored).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("api_key_salt", sa.LargeBinary(), nullable=True))
        batch.add_column(sa.Column("api_key_hash", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("api_key_hash")
        batch.drop_column("api_key_salt")
