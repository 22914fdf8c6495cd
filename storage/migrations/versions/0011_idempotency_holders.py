"""Idempotency keys that die with their process and go with their response: `holder` records the
incarnation of the process that claimed a key (a claim whose holder no longer heartbeats is free,
so a retry after a crash is not blocked), and `response_id` ties a key recorded by the Responses
API to the stored response it answers (the answer is read from that row, and deleting the
response deletes the key's row: nothing of a deleted response stays replayable). Migration 0012
ties it to the response's conversation as well.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-16
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("idempotency_keys") as batch:
        batch.add_column(sa.Column("holder", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("response_id", sa.String(length=40), nullable=True))
        batch.create_foreign_key(
            "fk_idempotency_keys_response_id_responses", "responses", ["response_id"], ["id"], ondelete="CASCADE"
        )
        batch.create_index("ix_idempotency_keys_response_id", ["response_id"])


def downgrade() -> None:
    with op.batch_alter_table("idempotency_keys") as batch:
        batch.drop_index("ix_idempotency_keys_response_id")
        batch.drop_constraint("fk_idempotency_keys_response_id_responses", type_="foreignkey")
        batch.drop_column("response_id")
        batch.drop_column("holder")
