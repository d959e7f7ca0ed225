"""checkpoints: each trial's adapter kept at epoch ends, its best and its last step, for download and sampling

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-27 19:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0024'
down_revision = '0023'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'checkpoints',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), primary_key=True, autoincrement=True),
        sa.Column('trial_id', sa.String(40), sa.ForeignKey('trials.id', ondelete='CASCADE'), nullable=False),
        sa.Column('task_id', sa.String(40), sa.ForeignKey('tasks.id', ondelete='CASCADE'), nullable=False),
        sa.Column('tenant_id', sa.String(40), sa.ForeignKey('tenants.id', ondelete='CASCADE'), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('epoch', sa.Float(), nullable=False),
        sa.Column('epoch_end', sa.Boolean(), nullable=False),
        sa.Column('val_loss', sa.Float(), nullable=True),
        sa.Column('adapter_key', sa.String(300), nullable=False),
        sa.Column('size_bytes', sa.BigInteger(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint('trial_id', 'step', name='uq_checkpoints_trial_step'),
    )
    op.create_index('ix_checkpoints_tenant_id', 'checkpoints', ['tenant_id'])


def downgrade() -> None:
    op.drop_index('ix_checkpoints_tenant_id', table_name='checkpoints')
    op.drop_table('checkpoints')
