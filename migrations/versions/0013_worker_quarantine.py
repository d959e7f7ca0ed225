"""worker quarantine and trial attempts blamed on the right party

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26 08:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Existing trials lost no worker yet (the attempts they spent on lost packs stay spent: the past is not re-judged)
    # and wait for no backoff; existing workers lost no pack and are not quarantined. The server defaults stay:
    # rows written outside the scheduler (the API's trials, tests) need no value either.
    with op.batch_alter_table('trials', schema=None) as batch_op:
        batch_op.add_column(sa.Column('worker_losses', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('not_before', sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('lost_packs', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('quarantines', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('quarantined_until', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_column('quarantined_until')
        batch_op.drop_column('quarantines')
        batch_op.drop_column('lost_packs')
    with op.batch_alter_table('trials', schema=None) as batch_op:
        batch_op.drop_column('not_before')
        batch_op.drop_column('worker_losses')
