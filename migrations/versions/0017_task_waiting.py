"""why a task's pending trials wait

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-26 15:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Null: nothing said yet (every existing task, until the scheduler's next round judges its pending trials).
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.add_column(sa.Column('waiting', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.drop_column('waiting')
