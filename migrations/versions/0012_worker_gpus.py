"""worker and pack gpus: how many GPUs of one host a worker runs each pack over, and a pack ran over

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-24 12:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Existing workers, and workers whose heartbeat does not say (older ones), own one GPU. The server default stays
    # (unlike the tenant quotas' in 0006): rows written outside the scheduler's ingest need no value either.
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('gpus', sa.Integer(), nullable=False, server_default='1'))
    # Every pack before this ran on one GPU.
    with op.batch_alter_table('packs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('gpus', sa.Integer(), nullable=False, server_default='1'))


def downgrade() -> None:
    with op.batch_alter_table('packs', schema=None) as batch_op:
        batch_op.drop_column('gpus')
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_column('gpus')
