"""Responses and conversations (OpenAI's Responses API): each stored response is a point in a
session, the end of one of its turns (`storage.response_store`). The row keeps the response object
as it was answered and the input items it was created with (JSON), so a retrieval after a restart
returns them as they were; it goes with its tenant and with its session. A conversation
(`storage.conversation_store`) is a durable id over a session: its items (JSON) and metadata, and
the session holding them (NULL once that session is gone: the next response rebuilds one).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from storage.schema import UTCDateTime

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column(
            "session_id", sa.String(length=40), sa.ForeignKey("sessions.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("turn_index", sa.Integer(), nullable=False),
        sa.Column("previous_response_id", sa.String(length=40), nullable=True),
        sa.Column("response", sa.Text(), nullable=False),
        sa.Column("input_items", sa.Text(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_responses_tenant_id", "responses", ["tenant_id"])
    op.create_index("ix_responses_session_id", "responses", ["session_id"])
    op.create_table(
        "conversations",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column(
            "session_id", sa.String(length=40), sa.ForeignKey("sessions.id", ondelete="SET NULL"), nullable=True
        ),
        sa.Column("metadata", sa.Text(), nullable=False),
        sa.Column("items", sa.Text(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_conversations_tenant_id", "conversations", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_conversations_tenant_id", table_name="conversations")
    op.drop_table("conversations")
    op.drop_index("ix_responses_session_id", table_name="responses")
    op.drop_index("ix_responses_tenant_id", table_name="responses")
    op.drop_table("responses")
