"""back-fill into running packs: pack shape, trials awaiting admission

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 14:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('packs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('capacity', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('max_rank', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('target_modules', sa.JSON(), nullable=True))

    with op.batch_alter_table('trials', schema=None) as batch_op:
        batch_op.add_column(sa.Column('awaiting_admission', sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('trials', schema=None) as batch_op:
        batch_op.drop_column('awaiting_admission')

    with op.batch_alter_table('packs', schema=None) as batch_op:
        batch_op.drop_column('target_modules')
        batch_op.drop_column('max_rank')
        batch_op.drop_column('capacity')
