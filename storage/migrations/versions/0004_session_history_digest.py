"""The digest of each session's history as its client saw it, for the implicit session lookup of
the OpenAI-compatible API (`storage/history_digest.py`).

Sessions that exist before this migration keep NULL: the stateless lookup never finds them (they
are still reachable by id), and their later turns leave it NULL, since the texts their client saw
are not known.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("history_digest", sa.String(length=64), nullable=True))
    op.create_index("ix_sessions_tenant_history", "sessions", ["tenant_id", "history_digest"])


def downgrade() -> None:
    op.drop_index("ix_sessions_tenant_history", table_name="sessions")
    with op.batch_alter_table("sessions") as batch:
        batch.drop_column("history_digest")
