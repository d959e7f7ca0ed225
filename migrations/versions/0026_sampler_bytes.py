"""sampler_bytes: the device memory a worker's sampler process holds, which the planner keeps packs out of

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-27 23:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0026'
down_revision = '0025'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('workers', sa.Column('sampler_bytes', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column('workers', 'sampler_bytes')
