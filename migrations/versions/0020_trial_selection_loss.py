"""each trial's smoothed validation score, what its task's trials are ranked by

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-26 22:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('trials', sa.Column('selection_loss', sa.Float(), nullable=True))
    # Trials stored before it keep ranking as they did: by their lowest point (common.metrics.rank_key's fallback
    # where it is None), so a finished task's best trial does not change under it.


def downgrade() -> None:
    op.drop_column('trials', 'selection_loss')
