"""Replica load and drain, for forwarding turns to their session's owner: each heartbeat records
how many turns wait in the replica's engine queue (`queued_turns`: others hand a session over
rather than forward to an owner over their limit), and `draining` says the replica is handing its
sessions over before it stops (set by the replica on SIGTERM, or by `chatkv replicas drain`; the
replica's keeper reads it with each heartbeat; a new process under the id starts with it unset).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-09
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.add_column(sa.Column("queued_turns", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("draining", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.drop_column("draining")
        batch.drop_column("queued_turns")
