"""tenants deleted by an operator

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-26 08:30:02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Null: a live tenant (every existing one). Deletion is soft: usage, tasks and events stay for billing.
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_column('deleted_at')
