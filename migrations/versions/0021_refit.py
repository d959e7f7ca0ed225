"""a task's refit: the best configuration trained again on training + validation rows

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-27 01:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0021'
down_revision = '0020'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('tasks', sa.Column('refit_trial_id', sa.String(length=40), nullable=True))
    op.add_column('trials', sa.Column('refit_of', sa.String(length=40), nullable=True))


def downgrade() -> None:
    op.drop_column('trials', 'refit_of')
    op.drop_column('tasks', 'refit_trial_id')
