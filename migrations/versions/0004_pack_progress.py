"""pack progress: measured step time of a running pack

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 14:50:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('packs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('progress', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('packs', schema=None) as batch_op:
        batch_op.drop_column('progress')
