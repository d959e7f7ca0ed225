"""preemption with a time slice: how often a trial was preempted, and for which tenant it is held back

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-27 06:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0022'
down_revision = '0021'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('trials', sa.Column('preemptions', sa.Integer(), nullable=False, server_default='0'))
    op.add_column('trials', sa.Column('preempted_for', sa.String(length=40), nullable=True))


def downgrade() -> None:
    op.drop_column('trials', 'preempted_for')
    op.drop_column('trials', 'preemptions')
