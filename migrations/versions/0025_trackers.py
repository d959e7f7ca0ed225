"""trackers: experiment trackers a task logs its trials to, and each trial's run and how far it is synced

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-27 20:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0025'
down_revision = '0024'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'trackers',
        sa.Column('id', sa.String(40), primary_key=True),
        sa.Column('tenant_id', sa.String(40), sa.ForeignKey('tenants.id', ondelete='CASCADE'), nullable=False),
        sa.Column('task_id', sa.String(40), sa.ForeignKey('tasks.id', ondelete='CASCADE'), nullable=False),
        sa.Column('type', sa.String(20), nullable=False),
        sa.Column('tracking_uri', sa.String(2000), nullable=False),
        sa.Column('experiment', sa.String(250), nullable=False),
        sa.Column('entity', sa.String(250), nullable=True),
        sa.Column('mode', sa.String(20), nullable=True),
        sa.Column('token_encrypted', sa.String(2000), nullable=True),
        sa.Column('done_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index('ix_trackers_tenant_id', 'trackers', ['tenant_id'])
    op.create_index('ix_trackers_task_id', 'trackers', ['task_id'])
    op.create_table(
        'tracker_runs',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), primary_key=True, autoincrement=True),
        sa.Column('tracker_id', sa.String(40), sa.ForeignKey('trackers.id', ondelete='CASCADE'), nullable=False),
        sa.Column('trial_id', sa.String(40), sa.ForeignKey('trials.id', ondelete='CASCADE'), nullable=False),
        sa.Column('run_id', sa.String(100), nullable=True),
        sa.Column('artifact_uri', sa.String(2000), nullable=True),
        sa.Column('params_synced', sa.Boolean(), nullable=False),
        sa.Column('point_cursor', sa.BigInteger(), nullable=False),
        sa.Column('finished', sa.Boolean(), nullable=False),
        sa.Column('attempts', sa.Integer(), nullable=False),
        sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('last_error', sa.Text(), nullable=True),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint('tracker_id', 'trial_id', name='uq_tracker_runs_tracker_trial'),
    )


def downgrade() -> None:
    op.drop_table('tracker_runs')
    op.drop_index('ix_trackers_task_id', table_name='trackers')
    op.drop_index('ix_trackers_tenant_id', table_name='trackers')
    op.drop_table('trackers')
