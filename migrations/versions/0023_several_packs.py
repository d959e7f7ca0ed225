"""several packs on one worker: how many a worker runs at once, the memory its packs left, each pack's planned bytes

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-27 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0023'
down_revision = '0022'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('workers', sa.Column('max_packs', sa.Integer(), nullable=False, server_default='1'))
    op.add_column('workers', sa.Column('free_memory_bytes', sa.BigInteger(), nullable=True))
    op.add_column('packs', sa.Column('memory_bytes', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column('packs', 'memory_bytes')
    op.drop_column('workers', 'free_memory_bytes')
    op.drop_column('workers', 'max_packs')
