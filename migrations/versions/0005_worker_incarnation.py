"""worker incarnations: which process of a worker id is alive, and which one runs each pack

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 21:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('incarnation', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('incarnation_started_at', sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table('packs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('incarnation', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('packs', schema=None) as batch_op:
        batch_op.drop_column('incarnation')
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_column('incarnation_started_at')
        batch_op.drop_column('incarnation')
