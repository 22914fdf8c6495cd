"""Conversation items as rows: each item of a conversation is a row of `conversation_items` (its
position, its id, its JSON text and size), so appending an item inserts rows instead of rewriting
the conversation's whole list, and one item is read or deleted by its id. The conversation keeps
its item count and bytes (the caps are checked on them) and the position of its next item.
Existing conversations' items move from their JSON list into rows, in order. An idempotency key
answered by a response made in a conversation names it (`conversation_id`): the key's row goes
with the conversation.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-16
"""

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_conversations = sa.table(
    "conversations",
    sa.column("id", sa.String),
    sa.column("items", sa.Text),
    sa.column("item_count", sa.Integer),
    sa.column("item_bytes", sa.BigInteger),
    sa.column("next_position", sa.Integer),
)
_items = sa.table(
    "conversation_items",
    sa.column("conversation_id", sa.String),
    sa.column("position", sa.Integer),
    sa.column("item_id", sa.String),
    sa.column("item", sa.Text),
    sa.column("nbytes", sa.Integer),
)


def _text(item: object) -> str:
    return json.dumps(item, ensure_ascii=False, separators=(",", ":"))


def upgrade() -> None:
    bind = op.get_bind()
    # `.c["items"]`: `.c.items` is the column collection's own method.
    query = sa.select(_conversations.c.id, _conversations.c["items"])
    lists = {row[0]: json.loads(row[1]) for row in bind.execute(query)}
    # The list column goes first: on SQLite the batch copies the table, which must not yet be
    # referenced by item or key rows (dropping the old copy would cascade to them).
    with op.batch_alter_table("conversations") as batch:
        batch.drop_column("items")
        batch.add_column(sa.Column("item_count", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("item_bytes", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("next_position", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("idempotency_keys") as batch:
        batch.add_column(sa.Column("conversation_id", sa.String(length=40), nullable=True))
        batch.create_foreign_key(
            "fk_idempotency_keys_conversation_id_conversations",
            "conversations",
            ["conversation_id"],
            ["id"],
            ondelete="CASCADE",
        )
        batch.create_index("ix_idempotency_keys_conversation_id", ["conversation_id"])
    op.create_table(
        "conversation_items",
        sa.Column(
            "conversation_id",
            sa.String(length=40),
            sa.ForeignKey("conversations.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("item_id", sa.String(length=64), nullable=False),
        sa.Column("item", sa.Text(), nullable=False),
        sa.Column("nbytes", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("conversation_id", "position"),
        sa.UniqueConstraint("conversation_id", "item_id", name="uq_conversation_items_item_id"),
    )
    for conversation_id, items in lists.items():
        rows = []
        for position, item in enumerate(items):
            text = _text(item)
            rows.append(
                {
                    "conversation_id": conversation_id,
                    "position": position,
                    "item_id": item["id"],
                    "item": text,
                    "nbytes": len(text.encode()),
                }
            )
        if rows:
            op.bulk_insert(_items, rows)
        bind.execute(
            sa.update(_conversations)
            .where(_conversations.c.id == conversation_id)
            .values(item_count=len(rows), item_bytes=sum(r["nbytes"] for r in rows), next_position=len(rows))
        )


def downgrade() -> None:
    bind = op.get_bind()
    lists: dict[str, list[object]] = {}
    for row in bind.execute(sa.select(_items.c.conversation_id, _items.c.item).order_by(_items.c.position)):
        lists.setdefault(row.conversation_id, []).append(json.loads(row.item))
    op.drop_table("conversation_items")
    with op.batch_alter_table("idempotency_keys") as batch:
        batch.drop_index("ix_idempotency_keys_conversation_id")
        batch.drop_constraint("fk_idempotency_keys_conversation_id_conversations", type_="foreignkey")
        batch.drop_column("conversation_id")
    with op.batch_alter_table("conversations") as batch:
        batch.drop_column("next_position")
        batch.drop_column("item_bytes")
        batch.drop_column("item_count")
        batch.add_column(sa.Column("items", sa.Text(), nullable=False, server_default="[]"))
    for conversation_id, items in lists.items():
        bind.execute(sa.update(_conversations).where(_conversations.c.id == conversation_id).values(items=_text(items)))
    with op.batch_alter_table("conversations") as batch:
        batch.alter_column("items", existing_type=sa.Text(), server_default=None)
