"""trial metric score: a trial's score on its task's generative metric (exact_match, contains, regex, json_valid)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # trials.metric_score null: a task judged by validation loss (every task before this revision), or a trial
    # not scored yet. The points it comes from are metric_points of split "metric" (split is String(10) already).
    with op.batch_alter_table('trials', schema=None) as batch_op:
        batch_op.add_column(sa.Column('metric_score', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('trials', schema=None) as batch_op:
        batch_op.drop_column('metric_score')
