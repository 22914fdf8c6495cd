"""Replica incarnations: each `chatkv serve` process registers with a random incarnation, and
the leases it takes carry it, so that a process restarted under the same replica id, or a second
process started with the same id by mistake, never renews or commits under another's leases.

Rows from before this migration have no incarnation (NULL): no process holds them any more once
it restarts, so they expire as before.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.add_column(sa.Column("incarnation", sa.String(length=32), nullable=True))
    with op.batch_alter_table("session_owners") as batch:
        batch.add_column(sa.Column("incarnation", sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("session_owners") as batch:
        batch.drop_column("incarnation")
    with op.batch_alter_table("replicas") as batch:
        batch.drop_column("incarnation")
