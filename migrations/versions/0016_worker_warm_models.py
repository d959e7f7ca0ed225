"""the base models a worker holds warm

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26 11:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Null: the worker has not said (every existing one, until its next heartbeat names its warm models).
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('warm_models', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_column('warm_models')
