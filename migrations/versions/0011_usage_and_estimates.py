"""usage and estimates: what each trial trained in each pack (trial_usage), a task's estimate and its actual cost

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('trial_usage',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('pack_id', sa.String(length=40), nullable=False),
    sa.Column('trial_id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=40), nullable=False),
    sa.Column('tokens', sa.BigInteger(), nullable=False),
    sa.Column('steps', sa.Integer(), nullable=False),
    sa.Column('end_step', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['trial_id'], ['trials.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('pack_id', 'trial_id', 'end_step', name='uq_trial_usage_pack_trial_step')
    )
    with op.batch_alter_table('trial_usage', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_trial_usage_pack_id'), ['pack_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_trial_usage_tenant_id'), ['tenant_id'], unique=False)
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        # null: a task submitted before estimates (or a dry run, which stores nothing)
        batch_op.add_column(sa.Column('estimate', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.drop_column('estimate')
    with op.batch_alter_table('trial_usage', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_trial_usage_tenant_id'))
        batch_op.drop_index(batch_op.f('ix_trial_usage_pack_id'))
    op.drop_table('trial_usage')
